import numpy as np
import pytest

from engine.errors import InvalidInput, Unavailable
from engine.placement import describe_ids, routing_table, split_by_bytes


def test_split_by_bytes_balances_and_covers_every_expert():
    sizes = {(layer, e): 100 + 10 * (e % 3) for layer in range(3) for e in range(8)}
    groups = split_by_bytes(sizes, 3)
    assert sorted(k for g in groups for k in g) == sorted(sizes)
    totals = [sum(sizes[k] for k in g) for g in groups]
    assert max(totals) - min(totals) <= max(sizes.values())


def test_split_by_bytes_is_deterministic_and_refuses_bad_counts():
    sizes = {(0, e): 10 for e in range(4)}
    assert split_by_bytes(sizes, 2) == split_by_bytes(dict(reversed(sizes.items())), 2)
    with pytest.raises(InvalidInput):
        split_by_bytes(sizes, 0)
    with pytest.raises(InvalidInput, match="only 4 experts"):
        split_by_bytes(sizes, 5)


def test_routing_table_spreads_replicas_and_prefers_fixed_order():
    holdings = [{(0, 0), (0, 1), (0, 2), (0, 3)}, {(0, 0), (0, 1)}]
    table = routing_table({0: 4}, holdings)
    assert table[0].tolist() == [0, 1, 0, 0]
    assert routing_table({0: 4}, holdings)[0].tolist() == table[0].tolist()


def test_routing_table_names_every_missing_expert():
    holdings = [{(1, 0), (1, 4)}, {(2, e) for e in range(4)}]
    with pytest.raises(Unavailable) as info:
        routing_table({1: 6, 2: 4}, holdings)
    assert "layer 1: experts 1-3, 5" in str(info.value)
    assert "layer 2" not in str(info.value)


def test_describe_ids():
    assert describe_ids([7, 1, 2, 3]) == "experts 1-3, 7"
    assert describe_ids(np.array([4]).tolist()) == "experts 4"
