"""The dashboard's views as pure functions of plain data: speed samples, worker cards with
their replicas, and the heat map's grid with each expert's owners."""

from coordinator.cluster.member import Member
from coordinator.dataplane.dispatch import LayerStats
from coordinator.server.dashboard_views import (
    Counters,
    healthy_holders,
    heat_view,
    replicas_of,
    speed_sample,
    worker_cards,
)
from engine.heat import HeatRecord, WorkerCounts
from engine.interfaces import Route
from engine.manifest import Manifest, MoeLayer
from proto import shoal_pb2


def member(name: str, state: str, experts: set) -> Member:
    return Member(key=name, node_id=name, address=f"10.0.0.{len(name)}:1", state=state,
                  route=Route("10.0.0.1", "en0", "wired"), experts=frozenset(experts))


def test_a_speed_sample_is_the_difference_of_two_readings_per_second():
    before = Counters(10.0, 1000.0, 5, 5, LayerStats(calls=10, seconds=0.01), 1)
    after = Counters(12.0, 1002.0, 9, 17, LayerStats(calls=30, seconds=0.05,
                                                     wire_seconds=0.02), 3)
    s = speed_sample(before, after)
    assert s["t"] == 1002.0 and s["in_flight"] == 3
    assert s["decode_tps"] == 6.0  # 12 tokens in 2 s
    assert s["batch_width"] == 3.0  # 12 tokens in 4 steps
    assert s["layer_calls"] == 20
    assert abs(s["breakdown"]["round_trip_us"] - 2000.0) < 1e-6  # 0.04 s over 20 calls
    assert abs(s["breakdown"]["wire_us"] - 1000.0) < 1e-6


def test_an_idle_second_has_no_breakdown_and_no_batch():
    reading = Counters(1.0, 1.0, 3, 3, LayerStats(calls=4), 0)
    later = Counters(2.0, 2.0, 3, 3, LayerStats(calls=4), 0)
    s = speed_sample(reading, later)
    assert s["decode_tps"] == 0 and s["batch_width"] == 0 and s["breakdown"] is None


def test_replicas_count_experts_another_healthy_worker_holds_too():
    a = member("a", "healthy", {(0, 0), (0, 1), (0, 2)})
    b = member("bb", "healthy", {(0, 2), (0, 3)})
    gone = member("ccc", "unreachable", {(0, 0)})
    assert replicas_of([a, b, gone]) == {"a": 1, "bb": 1}


def test_a_card_takes_its_figures_from_the_workers_latest_stats():
    a = member("a", "healthy", {(0, 0)})
    gone = member("bb", "unreachable", set())
    stats = shoal_pb2.WorkerStats(node_id="a", memory_budget=1000, resident_bytes=250,
                                  demands=10, hits=9)
    cards = worker_cards([a, gone], {a.address: stats, gone.address: stats},
                         {a.address: 2.5}, {"a": 123.0})
    assert cards[0]["healthy"] and cards[0]["since"] == 123.0
    assert cards[0]["resident_bytes"] == 250 and cards[0]["hit_rate"] == 0.9
    assert cards[0]["drive_reads_per_s"] == 2.5 and cards[0]["path"] == "wired"
    assert not cards[1]["healthy"] and "hit_rate" not in cards[1]  # no stale figures


def test_prefetch_recall_is_none_until_a_prefetch_was_issued():
    a = member("a", "healthy", {(0, 0)})
    cold = shoal_pb2.WorkerStats(node_id="a", demands=10, hits=4, misses=6)
    assert worker_cards([a], {a.address: cold}, {}, {})[0]["prefetch_recall"] is None
    warm = shoal_pb2.WorkerStats(node_id="a", demands=10, hits=4, misses=6,
                                 prefetch_issued=3, prefetch_hits=2, prefetch_used=2)
    assert worker_cards([a], {a.address: warm}, {}, {})[0]["prefetch_recall"] == 0.25


def test_the_heat_grid_has_every_expert_with_its_first_owner_and_copies():
    manifest = Manifest("f", "s", "qwen3_moe", {}, (MoeLayer(1, "p", 3, ()),
                                                    MoeLayer(3, "q", 2, ())), (), ())
    a = member("a", "healthy", {(1, 0), (1, 1), (3, 0)})
    b = member("bb", "healthy", {(1, 1), (1, 2), (3, 1)})
    gone = member("ccc", "unreachable", {(3, 1)})
    record = HeatRecord("f", {"a": WorkerCounts("x", {}, {(1, 0): 4, (3, 0): 1}),
                              "bb": WorkerCounts("y", {}, {(1, 2): 9})})
    h = heat_view(record, manifest, healthy_holders([a, b, gone]))
    assert h["layers"] == [1, 3] and h["experts"] == [3, 2]
    assert h["counts"] == [[4, 0, 9], [1, 0]]
    assert h["workers"] == ["a", "bb"]
    assert h["owner"] == [[0, 0, 1], [0, 1]]
    assert h["copies"] == [[1, 2, 1], [1, 1]]
    assert h["max"] == 9 and h["summary"]["tokens"] == 14
