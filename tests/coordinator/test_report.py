from coordinator.dataplane.lookahead import LookaheadStats
from coordinator.decoding.report import (
    difference,
    streaming_lines,
    streaming_report,
    summarize_stats,
)
from proto import shoal_pb2


def reading(scale: int) -> shoal_pb2.WorkerStats:
    return shoal_pb2.WorkerStats(
        node_id="mac-a", memory_budget=100, expert_bytes=400, resident_bytes=90,
        passes=10 * scale, demands=100 * scale, hits=60 * scale, misses=40 * scale,
        prefetch_hits=20 * scale, prefetch_late=5 * scale, prefetch_issued=50 * scale,
        prefetch_used=25 * scale,
        drives=[shoal_pb2.DriveStats(folder="/a", bytes_read=1000 * scale, reads=10 * scale,
                                     active_seconds=0.5 * scale)],
    )


def test_a_run_is_the_difference_of_two_readings_and_reads_as_rates():
    run = difference(reading(1), reading(3))
    assert run.demands == 200 and run.memory_budget == 100 and run.drives[0].bytes_read == 2000
    s = summarize_stats(run, tokens=20)
    assert s["hit_rate"] == 0.6 and s["hit_rate_without_prefetch"] == 0.4
    # Would have missed without prefetch: 40 prefetch hits + 80 misses; covered: 40 + 10 late.
    assert s["prefetch_recall"] == 50 / 120 and s["prefetch_precision"] == 0.5
    assert s["bytes_read_per_token"] == 100 and s["drives"][0]["bandwidth"] == 2000
    stats = LookaheadStats(predictions=4, predicted=16, used=16, correct=12, hints_sent=4)
    report = streaming_report({"a:1": reading(1)}, {"a:1": reading(3)}, 20, stats)
    text = "\n".join(streaming_lines(report))
    assert "hit rate 60.0%" in text and "recall 75.0%" in text and "drive /a" in text


def test_a_lookahead_that_predicted_nothing_reads_as_a_dash():
    report = streaming_report({"a:1": reading(1)}, {"a:1": reading(3)}, 20, LookaheadStats())
    lines = streaming_lines(report)
    assert "router lookahead: -" in lines and "recall 0.0%" not in "\n".join(lines)
