import pytest

from engine.errors import InvalidInput
from engine.stream_placement import member_hot_sets
from engine.stream_speed import (
    StreamingMember,
    active_compute_seconds,
    predict_streaming,
    skewed_heat,
)

LAYERS, EXPERTS, TOP_K, SIZE = 4, 16, 2, 1000
SIZES = {(layer, e): SIZE for layer in range(LAYERS) for e in range(EXPERTS)}
UNIFORM = skewed_heat(dict.fromkeys(range(LAYERS), EXPERTS))


def split(members: int) -> dict:
    return {(layer, e): (f"m{e % members}",) for layer, e in SIZES}


def test_one_member_with_no_memory_reads_every_chosen_expert_from_its_drive():
    member = StreamingMember("m0", memory=0, read_bps=SIZE * 10)
    got = predict_streaming(split(1), [member], SIZES, UNIFORM, top_k=TOP_K,
                            compute_seconds=0.5)
    reads = LAYERS * TOP_K * SIZE
    assert got["read_bytes_per_token"] == reads
    assert got["hit_rate"] == 0
    assert got["seconds_per_token"] == pytest.approx(0.5 + reads / (SIZE * 10))
    assert got["drive_busy"]["m0"] == pytest.approx((reads / (SIZE * 10)) / (0.5 + 0.8))


def test_every_expert_in_memory_leaves_only_the_compute():
    member = StreamingMember("m0", memory=len(SIZES) * SIZE, read_bps=1.0)
    got = predict_streaming(split(1), [member], SIZES, UNIFORM, top_k=TOP_K,
                            compute_seconds=0.25)
    assert got["hit_rate"] == 1.0
    assert got["read_bytes_per_token"] == 0
    assert got["tokens_per_second"] == pytest.approx(4.0)


def test_more_members_read_less_each_but_the_slowest_sets_the_pace():
    def speed(members: int) -> dict:
        group = [StreamingMember(f"m{i}", SIZE * 8, SIZE * 10.0) for i in range(members)]
        return predict_streaming(split(members), group, SIZES, UNIFORM, top_k=TOP_K,
                                 compute_seconds=0.0, samples=2000)

    one, two, four = speed(1), speed(2), speed(4)
    # Memory grows with members: one holds 8 of 64, four hold 32 of 64.
    assert one["hit_rate"] == pytest.approx(8 / 64, abs=0.03)
    assert four["hit_rate"] == pytest.approx(32 / 64, abs=0.03)
    assert one["tokens_per_second"] < two["tokens_per_second"] < four["tokens_per_second"]
    # The layer waits for its busiest member: worse than perfect division of the bytes.
    ideal = one["read_seconds_per_token"] * four["read_bytes_per_token"] / (
        one["read_bytes_per_token"] * 4)
    assert four["read_seconds_per_token"] > ideal


def test_a_replicated_expert_is_read_where_it_is_resident():
    holders = {key: ("m0", "m1") for key in SIZES}
    members = [StreamingMember("m0", 0, 1000.0), StreamingMember("m1", len(SIZES) * SIZE, 1.0)]
    got = predict_streaming(holders, members, SIZES, UNIFORM, top_k=TOP_K, compute_seconds=1.0)
    assert got["hit_rate"] == 1.0 and got["tokens_per_second"] == pytest.approx(1.0)


def test_the_forecast_keeps_in_memory_what_the_placement_calls_hot():
    heat = skewed_heat({0: 4}, skew=1.0)
    sizes = {(0, e): 10 for e in range(4)}
    holders = {k: ("a",) for k in sizes}
    assert member_hot_sets(holders, {"a": 25}, sizes, heat, top_k=1) == {
        "a": frozenset({(0, 0), (0, 1)})}
    got = predict_streaming(holders, [StreamingMember("a", 25, 1.0)], sizes, heat, top_k=1,
                            compute_seconds=0.0, samples=4096)
    assert got["hit_rate"] == pytest.approx((1 + 1 / 2) / (1 + 1 / 2 + 1 / 3 + 1 / 4), abs=0.03)


def test_bad_inputs_are_named():
    with pytest.raises(InvalidInput, match="at least one member"):
        predict_streaming(split(1), [], SIZES, UNIFORM, top_k=2, compute_seconds=0)
    with pytest.raises(InvalidInput, match="read speed"):
        predict_streaming(split(1), [StreamingMember("m0", 0, 0.0)], SIZES, UNIFORM, top_k=2,
                          compute_seconds=0)
    with pytest.raises(InvalidInput, match="has no holder"):
        predict_streaming({}, [StreamingMember("m0", 0, 1.0)], SIZES, UNIFORM, top_k=2,
                          compute_seconds=0)
    with pytest.raises(InvalidInput, match="skew"):
        skewed_heat({0: 4}, skew=-1)


def test_compute_without_a_measurement_counts_memory_reads_and_round_trips():
    alone = active_compute_seconds(1000, SIZES, top_k=TOP_K, memory_bps=1000.0,
                                   round_trip_s=0.01, members=1)
    assert alone == pytest.approx((1000 + LAYERS * TOP_K * SIZE) / 1000.0)
    two = active_compute_seconds(1000, SIZES, top_k=TOP_K, memory_bps=1000.0,
                                 round_trip_s=0.01, members=2)
    assert two == pytest.approx(alone + LAYERS * 0.01)


def test_a_measured_read_factor_scales_every_members_reads_not_the_compute():
    members = [StreamingMember(f"m{i}", memory=0, read_bps=SIZE * 10) for i in range(2)]
    plain = predict_streaming(split(2), members, SIZES, UNIFORM, top_k=TOP_K,
                              compute_seconds=0.5)
    more = predict_streaming(split(2), members, SIZES, UNIFORM, top_k=TOP_K,
                             compute_seconds=0.5, read_factor=1.5)
    assert more["read_bytes_per_token"] == pytest.approx(1.5 * plain["read_bytes_per_token"])
    assert more["read_seconds_per_token"] == pytest.approx(1.5 * plain["read_seconds_per_token"])
    assert more["hit_rate"] == plain["hit_rate"]
    with pytest.raises(InvalidInput, match="read factor"):
        predict_streaming(split(2), members, SIZES, UNIFORM, top_k=TOP_K, compute_seconds=0.5,
                          read_factor=0)
