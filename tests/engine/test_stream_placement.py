import pytest

from engine.errors import InvalidInput
from engine.placement import WorkerCapacity, plan_placement
from engine.stream_placement import (
    cold_reads,
    member_hot_sets,
    plan_streaming,
    read_imbalance,
    selection_odds,
)
from engine.stream_speed import StreamingMember, predict_streaming, skewed_heat

LAYERS, EXPERTS, TOP_K, SIZE = 3, 32, 4, 100
SIZES = {(layer, e): SIZE for layer in range(LAYERS) for e in range(EXPERTS)}
SKEWED = skewed_heat(dict.fromkeys(range(LAYERS), EXPERTS), skew=1.0)
AMPLE = 1 << 40


def held(holders: dict, name: str) -> set:
    return {key for key, names in holders.items() if name in names}


def test_the_hottest_experts_fill_the_members_memory_and_every_expert_has_a_home():
    memory = {"a": 10 * SIZE, "b": 10 * SIZE}
    holders = plan_streaming(memory, dict.fromkeys(memory, AMPLE), dict.fromkeys(memory, 1e9),
                             SIZES, SKEWED, top_k=TOP_K)
    assert set(holders) == set(SIZES)
    odds = selection_odds(SKEWED, TOP_K)
    hottest = sorted(SIZES, key=lambda k: (-odds[k], k))[:20]
    # Each member's share of the hot set fits its memory: its cache can hold all of it.
    for name in memory:
        assert len(held(holders, name) & set(hottest)) * SIZE <= memory[name]
    assert all(len(holders[key]) == 1 for key in hottest)
    # Both members carry hot experts of every layer, so compute is spread too.
    for name in memory:
        assert {key[0] for key in held(holders, name) & set(hottest)} == set(range(LAYERS))


def test_cold_reads_follow_read_speed_not_bytes():
    memory = {"fast": 2 * SIZE, "slow": 2 * SIZE}
    speeds = {"fast": 3e9, "slow": 1e9}
    holders = plan_streaming(memory, dict.fromkeys(memory, AMPLE), speeds, SIZES, SKEWED,
                             top_k=TOP_K)
    odds = selection_odds(SKEWED, TOP_K)
    hot = set(sorted(SIZES, key=lambda k: (-odds[k], k))[:4])  # what memory holds
    reads = {n: sum(odds[k] * SIZE for k in held(holders, n) - hot) for n in memory}
    assert reads["fast"] / reads["slow"] == pytest.approx(3.0, rel=0.2)
    # Against an even split by bytes, the fast drive's extra share makes decode faster.
    even = {key: ("fast" if key[1] % 2 else "slow",) for key in SIZES}
    members = [StreamingMember(n, memory[n], speeds[n]) for n in memory]

    def speed(h: dict) -> float:
        return predict_streaming(h, members, SIZES, SKEWED, top_k=TOP_K, compute_seconds=0,
                                 samples=400)["tokens_per_second"]

    assert speed(holders) > 1.2 * speed(even)


def test_memory_no_cold_expert_fits_takes_replicas_of_the_hottest():
    sizes = {**SIZES, **{(0, e): 10 for e in range(4)}}  # four small, hot experts
    heat = {**SKEWED, **{(0, e): 100.0 for e in range(4)}}
    memory = {"a": 45, "b": 45}
    holders = plan_streaming(memory, dict.fromkeys(memory, AMPLE), dict.fromkeys(memory, 1e9),
                             sizes, heat, top_k=TOP_K)
    assert all(len(holders[(0, e)]) == 2 for e in range(4))
    assert all(len(holders[key]) == 1 for key in SIZES if key[1] >= 4)


def test_disks_bound_the_plan_and_bad_inputs_are_named():
    memory = {"a": SIZE, "b": SIZE}
    with pytest.raises(InvalidInput, match="fits on no member's disk"):
        plan_streaming(memory, dict.fromkeys(memory, 10 * SIZE), dict.fromkeys(memory, 1e9),
                       SIZES, SKEWED, top_k=TOP_K)
    with pytest.raises(InvalidInput, match="read speed"):
        plan_streaming(memory, dict.fromkeys(memory, AMPLE), {"a": 1e9}, SIZES, SKEWED,
                       top_k=TOP_K)
    with pytest.raises(InvalidInput, match="at least one member"):
        plan_streaming({}, {}, {}, SIZES, SKEWED, top_k=TOP_K)


def test_plan_placement_streams_by_read_speed_when_it_knows_them():
    workers = [WorkerCapacity("fast", 4 * SIZE, read_gbps=3.0),
               WorkerCapacity("slow", 4 * SIZE, read_gbps=1.0)]
    plan = plan_placement(workers, SIZES, SKEWED, spare=0.0, top_k=TOP_K)
    assert not plan.resident
    assert plan.bytes_per_worker["fast"] > 2 * plan.bytes_per_worker["slow"]
    assert sum(plan.bytes_per_worker.values()) == sum(SIZES.values())
    # Without read speeds, the placement by bytes and load stays as it was.
    unknown = [WorkerCapacity("fast", 4 * SIZE), WorkerCapacity("slow", 4 * SIZE)]
    by_bytes = plan_placement(unknown, SIZES, SKEWED, spare=0.0, top_k=TOP_K)
    assert by_bytes.bytes_per_worker["fast"] == pytest.approx(
        by_bytes.bytes_per_worker["slow"], rel=0.2)


def test_a_deploy_onto_workers_with_measured_read_speeds_places_for_streaming():
    from engine.rebalance_plan import LiveWorker, propose, state_of

    workers = [LiveWorker("fast", frozenset(), memory_budget=4 * SIZE, free_disk=1 << 30,
                          read_gbps=3.0),
               LiveWorker("slow", frozenset(), memory_budget=4 * SIZE, free_disk=1 << 30,
                          read_gbps=1.0)]
    proposal = propose(state_of(workers, SIZES, ()), workers, SIZES, SKEWED, spare=0.0,
                       deploy=True, top_k=TOP_K)
    placed = {n: sum(SIZE for names in proposal.target.values() if n in names)
              for n in ("fast", "slow")}
    assert set(proposal.target) == set(SIZES)
    assert placed["fast"] > 2 * placed["slow"]


MB = 10**6
DRIVES = {"a": 40 * MB, "b": 80 * MB}  # MB/s, as drives are sold


def cold_share(holders: dict, memory: dict) -> dict:
    reads = cold_reads(holders, memory, SIZES, SKEWED, top_k=TOP_K)
    total = {n: sum(layer[n] for layer in reads.values()) for n in memory}
    return {n: total[n] / sum(total.values()) for n in memory}


def test_each_members_hot_set_fits_its_budget_and_together_they_are_the_hottest():
    memory = {"a": 10 * SIZE, "b": 25 * SIZE}
    holders = plan_streaming(memory, dict.fromkeys(memory, AMPLE), DRIVES, SIZES, SKEWED,
                             top_k=TOP_K)
    hot = member_hot_sets(holders, memory, SIZES, SKEWED, top_k=TOP_K)
    for name in memory:
        assert sum(SIZES[k] for k in hot[name]) <= memory[name]
        assert hot[name] <= held(holders, name)
    odds = selection_odds(SKEWED, TOP_K)
    hottest = set(sorted(SIZES, key=lambda k: (-odds[k], k))[:35])
    assert hot["a"] | hot["b"] == hottest and not hot["a"] & hot["b"]


def test_cold_bytes_go_to_40_and_80_mb_s_drives_in_proportion_to_their_speed():
    memory = {"a": 8 * SIZE, "b": 8 * SIZE}
    holders = plan_streaming(memory, dict.fromkeys(memory, AMPLE), DRIVES, SIZES, SKEWED,
                             top_k=TOP_K)
    share = cold_share(holders, memory)
    assert share["b"] == pytest.approx(2 / 3, abs=0.05)
    assert read_imbalance(holders, memory, DRIVES, SIZES, SKEWED, top_k=TOP_K) < 1.15
    # an even split by bytes leaves the fast drive idle a third of the time
    even = {key: ("a" if key[1] % 2 else "b",) for key in SIZES}
    assert cold_share(even, memory)["b"] == pytest.approx(1 / 2, abs=0.05)
    assert read_imbalance(even, memory, DRIVES, SIZES, SKEWED, top_k=TOP_K) > 1.25


def test_a_rebalance_of_a_streamed_model_reaches_and_then_keeps_the_streamed_placement():
    from engine.migration import check_steps
    from engine.rebalance_plan import LiveWorker, propose, state_of

    even = {key: ("a" if key[1] % 2 else "b",) for key in SIZES}

    def cluster(holders):
        return [LiveWorker(n, frozenset(k for k, h in holders.items() if n in h),
                           memory_budget=8 * SIZE, free_disk=AMPLE, read_gbps=DRIVES[n] / 1e9)
                for n in DRIVES]

    state = state_of(cluster(even), SIZES, ())
    p = propose(state, cluster(even), SIZES, SKEWED, spare=0.0, top_k=TOP_K)
    assert p.measure == "reads" and p.imbalance_now > 1.25 and p.imbalance_after < 1.15
    check_steps(state, p.plan.steps)  # raises at the first unsafe step
    memory = dict.fromkeys(DRIVES, 8 * SIZE)
    hot = member_hot_sets(p.target, memory, SIZES, SKEWED, top_k=TOP_K)
    assert all(sum(SIZES[k] for k in hot[n]) <= memory[n] for n in DRIVES)
    assert cold_share(p.target, memory)["b"] == pytest.approx(2 / 3, abs=0.05)
    # right after it, from the same heat, nothing moves
    again = propose(state_of(cluster(p.target), SIZES, ()), cluster(p.target), SIZES, SKEWED,
                    spare=0.0, top_k=TOP_K)
    assert again.plan.steps == ()


def test_two_drive_copies_put_each_cold_expert_on_two_members_and_leave_hot_sets_alone():
    memory = {"a": 8 * SIZE, "b": 8 * SIZE, "c": 8 * SIZE, "d": 8 * SIZE}
    speeds = {"a": 40 * MB, "b": 40 * MB, "c": 80 * MB, "d": 40 * MB}
    one = plan_streaming(memory, dict.fromkeys(memory, AMPLE), speeds, SIZES, SKEWED,
                         top_k=TOP_K)
    two = plan_streaming(memory, dict.fromkeys(memory, AMPLE), speeds, SIZES, SKEWED,
                         top_k=TOP_K, drive_copies=2)
    hot_one = member_hot_sets(one, memory, SIZES, SKEWED, top_k=TOP_K)
    hot_two = member_hot_sets(two, memory, SIZES, SKEWED, top_k=TOP_K)
    assert hot_two == hot_one  # the same experts in memory, on the same members
    in_memory = set().union(*hot_two.values())
    for name in memory:
        assert sum(SIZES[k] for k in hot_two[name]) <= memory[name]
    for key, names in two.items():
        if key not in in_memory:
            assert len(names) == 2 == len(set(names)), key
    # The 80 MB/s drive is given more of the cold reads than each 40 MB/s one.
    share = cold_share(two, memory)
    assert share["c"] > max(share[n] for n in "abd")
    assert read_imbalance(two, memory, speeds, SIZES, SKEWED, top_k=TOP_K) < 1.15


def test_two_drive_copies_need_two_disks_with_room_and_say_so():
    memory = {"a": SIZE, "b": SIZE}
    cold = len(SIZES) - 2
    room = {"a": AMPLE, "b": 4 * SIZE}  # b's disk holds a few experts, not every cold one
    with pytest.raises(InvalidInput, match="fits on only 1 members' disks, 2 needed.*copies"):
        plan_streaming(memory, room, dict.fromkeys(memory, 1e9), SIZES, SKEWED,
                       top_k=TOP_K, drive_copies=2)
    # The disk limit holds where it fits: every member's files within its disk.
    fits = dict.fromkeys(memory, (cold + 2) * SIZE)
    holders = plan_streaming(memory, fits, dict.fromkeys(memory, 1e9), SIZES, SKEWED,
                             top_k=TOP_K, drive_copies=2)
    for name in memory:
        assert len(held(holders, name)) * SIZE <= fits[name]
    with pytest.raises(InvalidInput, match="drive copies must be 1 or more"):
        plan_streaming(memory, fits, dict.fromkeys(memory, 1e9), SIZES, SKEWED, top_k=TOP_K,
                       drive_copies=0)
    # One member cannot hold two copies: its single copy is the plan.
    alone = plan_streaming({"a": SIZE}, {"a": AMPLE}, {"a": 1e9}, SIZES, SKEWED, top_k=TOP_K,
                           drive_copies=2)
    assert all(names == ("a",) for names in alone.values())


def test_shard_and_rebalance_plans_take_the_drive_copies():
    from engine.placement import store_placement
    from engine.rebalance_plan import LiveWorker, propose, state_of

    members = [WorkerCapacity("a", 4 * SIZE, read_gbps=1.0),
               WorkerCapacity("b", 4 * SIZE, read_gbps=1.0)]
    stores = store_placement(members, SIZES, SKEWED, top_k=TOP_K, spare=0.0, drive_copies=2)
    assert sum(len(held) == 2 for held in stores.values()) >= len(SIZES) - 8
    workers = [LiveWorker(w.name, frozenset(), memory_budget=w.memory, free_disk=1 << 30,
                          read_gbps=1.0) for w in members]
    proposal = propose(state_of(workers, SIZES, ()), workers, SIZES, SKEWED, spare=0.0,
                       deploy=True, top_k=TOP_K, drive_copies=2)
    assert {k: tuple(sorted(v)) for k, v in proposal.target.items()} == {
        k: tuple(members[i].name for i in v) for k, v in stores.items()}


def test_two_drive_copies_join_every_pair_of_drives_not_fixed_pairs():
    memory = dict.fromkeys("abcd", 8 * SIZE)
    holders = plan_streaming(memory, dict.fromkeys(memory, AMPLE), dict.fromkeys(memory, 1e9),
                             SIZES, SKEWED, top_k=TOP_K, drive_copies=2)
    pairs = {names for names in holders.values() if len(names) == 2}
    assert len(pairs) == 6  # any drive can hand a read to any other
