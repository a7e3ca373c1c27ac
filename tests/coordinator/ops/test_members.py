"""The members placement is told of: --member flags, a cluster config's memory_budget and
read_speed, measured drive rates, and how they override what live workers report."""

import pytest

from coordinator.ops.planning import (
    budget_words,
    live_members,
    parse_member,
    parse_read_speed,
    placement_members,
)
from engine.errors import InvalidInput
from engine.rebalance_plan import LiveWorker, drive_rate, with_members

CONFIG = '''name = "desk"
[[workers]]
node_id = "a"
address = "10.0.0.1:50551"
memory_budget = "24G"
read_speed = "40MB/s"
[[workers]]
address = "10.0.0.2:50551"
memory_budget = "24G"
read_speed = "80MB/s"
'''


def test_a_member_is_its_memory_budget_and_its_drives_read_speed():
    a = parse_member("a=24G:40MB/s")
    assert (a.name, a.memory, a.read_gbps) == ("a", 24 << 30, 0.04)
    assert parse_read_speed("1.5GB/s") == 1.5e9 and parse_read_speed("400MiB/s") == 400 * 2**20
    for bad in ("a=24G", "a=:40MB/s", "=24G:40MB/s", "a=24G:fast", "a=lots:40MB/s"):
        with pytest.raises(InvalidInput):
            parse_member(bad)
    assert parse_member("a=:40MB/s", live=True).memory == 0  # rebalance: the worker reports it
    assert budget_words(24 << 30) == "24G" and budget_words(96 << 10) == "96K"


def test_members_come_from_flags_or_a_cluster_config(tmp_path):
    config = tmp_path / "cluster.toml"
    config.write_text(CONFIG)
    members = placement_members(None, config)
    assert [(m.name, m.read_gbps) for m in members] == [("a", 0.04), ("10.0.0.2:50551", 0.08)]
    assert placement_members(["x=1G:40MB/s"], None)[0].name == "x"
    assert placement_members(None, None) == []
    with pytest.raises(InvalidInput, match="not both"):
        placement_members(["x=1G:40MB/s"], config)
    with pytest.raises(InvalidInput, match="unique"):
        placement_members(["x=1G:40MB/s", "x=2G:80MB/s"], None)
    config.write_text(CONFIG.replace('read_speed = "80MB/s"\n', ""))
    with pytest.raises(InvalidInput, match="missing for 10.0.0.2:50551"):
        placement_members(None, config)
    # rebalance takes what is given: a flag before the config's line for the same worker
    live = live_members(["a=:100MB/s"], config)
    assert [(m.name, m.read_gbps) for m in live] == [("a", 0.1)]


def test_given_speeds_override_measured_ones_by_node_id_or_address():
    workers = [LiveWorker("a", frozenset(), memory_budget=100, read_gbps=0.5),
               LiveWorker("b", frozenset(), memory_budget=100)]
    given = [parse_member("a=:40MB/s", live=True), parse_member("10.0.0.2:1=2K:80MB/s")]
    out = with_members(workers, given, {"10.0.0.2:1": "b"})
    assert [(w.name, w.memory_budget, w.read_gbps) for w in out] == [
        ("a", 100, 0.04), ("b", 2048, 0.08)]
    with pytest.raises(InvalidInput, match="no live worker is named c"):
        with_members(workers, [parse_member("c=:40MB/s", live=True)])
    # measured: each busy drive's rate, summed; too little reading says nothing
    assert drive_rate([(40_000_000, 1.0), (80_000_000, 2.0)]) == pytest.approx(0.08)
    assert drive_rate([(1000, 0.01)]) is None
