"""The migration planner: every step keeps a verified copy of every expert and an owner for
every served one, the plan reaches its target, and a run stopped after any prefix of its
steps is finished by planning again from what is then observed."""

import random

import pytest

from engine.errors import InvalidInput
from engine.migration import (
    DRAINING,
    LOCAL,
    SERVING,
    UNVERIFIED,
    Step,
    check_steps,
    holders_of,
    limit_moves,
    plan_migration,
)
from engine.placement import WorkerCapacity, imbalance, plan_placement

WORKERS = ["a", "b", "c", "d"]


def random_case(seed: int, experts: int = 12):
    rng = random.Random(seed)
    keys = [(layer, e) for layer in range(2) for e in range(experts // 2)]
    state, target = {}, {}
    for key in keys:
        holders = rng.sample(WORKERS, rng.randint(1, 3))
        copies = {w: SERVING for w in holders}
        if len(holders) > 1 and rng.random() < 0.3:  # an earlier run drained one
            copies[holders[-1]] = DRAINING
        state[key] = copies
        target[key] = tuple(sorted(rng.sample(WORKERS, rng.randint(1, 3))))
    sizes = {key: rng.choice([100, 150, 200]) for key in keys}
    return state, target, sizes


def observed(state):
    """What a re-run sees: a copy the receiver verified and renamed is served."""
    return {key: {w: SERVING if s == UNVERIFIED else s for w, s in copies.items()}
            for key, copies in state.items()}


def final_holders(state):
    assert all(s == SERVING for copies in state.values() for w, s in copies.items()
               if w != LOCAL), "something is left draining or unverified"
    return {key: tuple(sorted(w for w in copies if w != LOCAL)) for key, copies in state.items()}


@pytest.mark.parametrize("seed", range(25))
def test_every_step_keeps_a_verified_served_copy_and_the_plan_reaches_its_target(seed):
    state, target, sizes = random_case(seed)
    plan = plan_migration(state, target, sizes)
    assert not plan.blocked
    final = check_steps(state, plan.steps)  # raises at the first unsafe step
    assert final_holders(final) == target
    # copies come before the drops of the same expert, and only drained copies are deleted
    kinds = {}
    for step in plan.steps:
        kinds.setdefault(step.key, []).append(step.kind)
    for key, sequence in kinds.items():
        if "drain" in sequence and "copy" in sequence:
            assert sequence.index("copy") < sequence.index("drain"), key


@pytest.mark.parametrize("seed", range(8))
def test_a_run_stopped_after_any_prefix_is_finished_by_planning_again(seed):
    state, target, sizes = random_case(seed)
    steps = plan_migration(state, target, sizes).steps
    assert steps
    for cut in range(len(steps) + 1):
        reached = observed(check_steps(state, steps[:cut]))
        rest = plan_migration(reached, target, sizes)
        assert not rest.blocked
        assert final_holders(check_steps(reached, rest.steps)) == target, cut
        assert len(rest.steps) <= len(steps) - cut + sum(  # verify steps merge into copies
            s.kind == "copy" for s in steps[:cut])


def test_a_plan_for_the_state_it_reached_is_empty():
    state, target, sizes = random_case(3)
    done = observed(check_steps(state, plan_migration(state, target, sizes).steps))
    assert plan_migration(done, target, sizes).steps == ()


def test_unsafe_steps_are_refused_by_the_checker():
    state = {(0, 0): {"a": SERVING}, (0, 1): {"a": DRAINING, "b": DRAINING}}
    with pytest.raises(InvalidInput, match="no other worker serves"):
        check_steps(state, [Step("drain", (0, 0), "a")])
    with pytest.raises(InvalidInput, match="only a drained copy"):
        check_steps(state, [Step("delete", (0, 0), "a")])
    with pytest.raises(InvalidInput, match="no other worker serves"):
        check_steps(state, [Step("delete", (0, 1), "b")])  # a draining copy is not served
    with pytest.raises(InvalidInput, match="holds no verified copy"):
        check_steps(state, [Step("copy", (0, 0), "c", source="b", bytes=1)])
    # an unverified copy does not count as a served one
    with pytest.raises(InvalidInput, match="no other worker serves"):
        check_steps(state, [Step("copy", (0, 0), "b", source="a", bytes=1),
                            Step("drain", (0, 0), "a")])


def test_deploy_sends_from_the_local_files_and_never_drops_them():
    keys = [(0, e) for e in range(4)]
    state = {key: {LOCAL: SERVING} for key in keys}
    target = {key: (WORKERS[key[1] % 2],) for key in keys}
    plan = plan_migration(state, target, dict.fromkeys(keys, 10))
    assert {s.source for s in plan.steps if s.kind == "copy"} == {LOCAL}
    assert not any(s.worker == LOCAL for s in plan.steps)
    final = check_steps(state, plan.steps)
    assert all(copies[LOCAL] == SERVING for copies in final.values())


def test_copies_wait_for_room_made_by_deletes_and_impossible_ones_are_left_as_they_are():
    # Swap: a holds x, b holds y, each has room for exactly one more file.
    state = {(0, 0): {"a": SERVING}, (0, 1): {"b": SERVING}, (0, 2): {"a": SERVING}}
    target = {(0, 0): ("b",), (0, 1): ("a",), (0, 2): ("c",)}
    sizes = dict.fromkeys(state, 100)
    plan = plan_migration(state, target, sizes, room={"a": 0, "b": 100, "c": 100})
    assert not plan.blocked
    order = [(s.kind, s.key, s.worker) for s in plan.steps]
    # (0,1) needs room on a: it waits until (0,0) or (0,2) has left a
    first_delete_on_a = min(i for i, s in enumerate(order) if s[0] == "delete" and s[2] == "a")
    copy_to_a = order.index(("copy", (0, 1), "a"))
    assert first_delete_on_a < copy_to_a
    assert final_holders(check_steps(state, plan.steps)) == target

    stuck = plan_migration(state, target, sizes, room={"a": 0, "b": 0, "c": 0})
    assert set(stuck.blocked) == {(0, 0), (0, 1), (0, 2)}
    assert "not enough free disk" in stuck.blocked[(0, 0)]
    assert stuck.steps == ()


def test_an_expert_whose_only_copy_is_on_a_dead_worker_is_left_alone():
    state = {(0, 0): {}, (0, 1): {"a": SERVING}}  # (0, 0)'s holder is not live
    plan = plan_migration(state, {(0, 0): ("a",), (0, 1): ("b",)}, {(0, 0): 1, (0, 1): 1})
    assert set(plan.blocked) == {(0, 0)}
    assert {s.key for s in plan.steps} == {(0, 1)}


def test_a_draining_copy_the_target_wants_is_kept_not_copied_again():
    state = {(0, 0): {"a": DRAINING, "b": SERVING}}
    plan = plan_migration(state, {(0, 0): ("a",)}, {(0, 0): 5})
    assert [(s.kind, s.worker) for s in plan.steps] == [("keep", "a"), ("drain", "b"),
                                                        ("delete", "b")]


def test_limit_moves_copies_no_more_than_the_budget_hottest_first():
    keys = [(0, e) for e in range(6)]
    current = {key: ("a",) if key[1] < 4 else ("b",) for key in keys}
    heat = {key: 100.0 / (1 + key[1]) for key in keys}
    sizes = dict.fromkeys(keys, 10)
    target = plan_placement([WorkerCapacity("a", 10**6), WorkerCapacity("b", 10**6)], sizes,
                            heat, current=current).holders
    for budget in (0, 10, 25, 1000):
        limited = limit_moves(current, target, sizes, heat, budget)
        copied = sum(10 * len(set(limited[k]) - set(current[k])) for k in keys)
        assert copied <= budget
        assert imbalance(limited, heat) <= imbalance(current, heat) + 1e-9
    assert limit_moves(current, target, sizes, heat, 0) == current
    some = limit_moves(current, target, sizes, heat, 10)
    changed = [k for k in keys if some[k] != current[k]]
    assert changed == [(0, 0)]  # the hottest expert gets the one copy the budget allows


def test_holders_of_ignores_draining_and_local_copies():
    state = {(0, 0): {"a": SERVING, "b": DRAINING, LOCAL: SERVING}}
    assert holders_of(state) == {(0, 0): ("a",)}
