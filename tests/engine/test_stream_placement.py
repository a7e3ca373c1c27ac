import pytest

from engine.errors import InvalidInput
from engine.placement import WorkerCapacity, plan_placement
from engine.stream_placement import plan_streaming, selection_odds
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
