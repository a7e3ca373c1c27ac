import numpy as np
import pytest

from engine.cache_policy import (
    BudgetSpec,
    Heat,
    admit,
    choose_victims,
    parse_budget,
    pinned,
    resolve_budget,
)
from engine.errors import InvalidInput


def test_budgets_are_sizes_or_shares_of_the_experts():
    assert parse_budget("512M") == BudgetSpec(bytes=512 << 20)
    assert parse_budget("8G") == BudgetSpec(bytes=8 << 30)
    assert parse_budget("1.5GiB") == BudgetSpec(bytes=int(1.5 * (1 << 30)))
    assert parse_budget("4096") == BudgetSpec(bytes=4096)
    assert parse_budget("50%") == BudgetSpec(share=0.5)
    assert resolve_budget(parse_budget("25%"), 1000, 10**9) == 250
    assert resolve_budget(BudgetSpec(), 1000, 10**9) == 6 * 10**8
    for bad in ("lots", "0%", "150%", "0", "-1G"):
        with pytest.raises(InvalidInput):
            parse_budget(bad)


def test_heat_halves_every_half_life_and_adds_tokens():
    heat = Heat(3, half_life=2.0)
    heat.add(np.array([0, 1]), np.array([4, 1]))
    heat.advance(2)
    np.testing.assert_allclose(heat.values(), [2.0, 0.5, 0.0])
    heat.add(np.array([1]), np.array([3]))
    np.testing.assert_allclose(heat.values(), [2.0, 3.5, 0.0])


def test_only_the_hottest_resident_experts_are_pinned_within_the_pin_share():
    heat = np.array([9.0, 5.0, 3.0, 1.0, 8.0])
    sizes = np.full(5, 10)
    resident = np.array([True, True, True, True, False])
    mask = pinned(heat, sizes, resident, pin_bytes=20, threshold=2.0)
    assert mask.tolist() == [True, True, False, False, False]  # 4 is not resident, 2 does not fit


def test_victims_are_unpinned_cold_then_least_recently_used_and_as_few_as_needed():
    heat = np.array([0.0, 0.0, 5.0, 0.5, 9.0])
    last_used = np.array([7, 3, 1, 2, 0])
    sizes = np.array([10, 10, 10, 10, 30])
    evictable = np.ones(5, dtype=bool)
    pins = np.array([False, False, False, False, True])
    victims = choose_victims(heat, last_used, sizes, evictable, pins, need_bytes=15)
    assert victims.tolist() == [1, 0]  # both cold: the less recently used goes first
    victims = choose_victims(heat, last_used, sizes, evictable, pins, need_bytes=45)
    assert victims.tolist() == [1, 0, 3, 2, 4]  # the pinned one only when nothing else will do
    assert choose_victims(heat, last_used, sizes, evictable, pins, 0).size == 0
    in_use = np.array([True, True, False, False, False])
    assert choose_victims(heat, last_used, sizes, ~in_use, pins, need_bytes=55) is None


def test_an_expert_read_joins_the_kept_only_if_routed_more_than_the_least_routed_kept_one():
    frequency = np.array([5.0, 3.0, 1.0, 4.0, 3.0])
    kept = np.array([True, True, False, False, False])
    assert admit(frequency, np.array([2, 3, 4]), kept).tolist() == [False, True, False]
    assert admit(frequency, np.array([2]), np.zeros(5, dtype=bool)).tolist() == [True]  # room


def test_experts_on_probation_go_before_any_kept_one_however_cold():
    heat = np.array([0.0, 7.0, 9.0])
    last_used = np.array([1, 2, 3])
    sizes = np.full(3, 10)
    evictable = np.ones(3, dtype=bool)
    no_pins = np.zeros(3, dtype=bool)
    probation = np.array([False, True, True])
    victims = choose_victims(heat, last_used, sizes, evictable, no_pins, 15, probation)
    assert victims.tolist() == [1, 2]
    assert choose_victims(heat, last_used, sizes, evictable, no_pins, 15).tolist() == [0, 1]
