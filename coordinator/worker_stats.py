"""Workers' cache, prefetch and drive figures (the `GetStats` RPC), as numbers and as text.

`shoal generate --stats` reads every worker before and after a run and reports the
difference; `shoal workers` can show one reading (`fetch_worker_stats` + `summarize_stats`).
"""

from __future__ import annotations

from collections.abc import Iterable

from coordinator.link import WorkerLink
from coordinator.lookahead import LookaheadStats
from engine.cache_policy import format_bytes
from engine.errors import ShoalError
from proto import shoal_pb2

_COUNTERS = (
    "passes", "tokens", "demands", "hits", "misses", "prefetch_hits", "prefetch_late",
    "prefetch_issued", "prefetch_used", "prefetch_cancelled", "prefetch_wasted", "loads",
    "evictions",
)


def fetch_worker_stats(address: str, secret: bytes) -> shoal_pb2.WorkerStats:
    """One worker's counters since it started (raises Unavailable if it does not answer)."""
    link = WorkerLink(address, secret)
    try:
        return link.fetch_stats()
    finally:
        link.close()


def read_stats(links: Iterable[WorkerLink]) -> dict[str, shoal_pb2.WorkerStats]:
    """A reading of every worker that answers, by address."""
    out = {}
    for link in links:
        try:
            out[link.address] = link.fetch_stats()
        except ShoalError:
            continue
    return out


def difference(
    before: shoal_pb2.WorkerStats | None, after: shoal_pb2.WorkerStats
) -> shoal_pb2.WorkerStats:
    """The counters of `after` less those of `before` (gauges such as the budget kept)."""
    if before is None:
        return after
    out = shoal_pb2.WorkerStats()
    out.CopyFrom(after)
    for name in _COUNTERS:
        setattr(out, name, getattr(after, name) - getattr(before, name))
    earlier = {d.folder: d for d in before.drives}
    for drive in out.drives:
        if (old := earlier.get(drive.folder)) is not None:
            drive.bytes_read -= old.bytes_read
            drive.reads -= old.reads
            drive.active_seconds -= old.active_seconds
    return out


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def summarize_stats(stats: shoal_pb2.WorkerStats, tokens: int | None = None) -> dict:
    """The figures a person reads: hit rate, prefetch recall, bytes per token, bandwidth.

    Prefetch recall: of the experts that were not resident when their hint came, the share
    a prefetch had read (or was reading) by the time they were asked for.
    """
    per = tokens if tokens else stats.passes
    would_miss = stats.prefetch_hits + stats.misses  # misses include the late prefetches
    bytes_read = sum(d.bytes_read for d in stats.drives)
    return {
        "node_id": stats.node_id,
        "memory_budget": stats.memory_budget,
        "expert_bytes": stats.expert_bytes,
        "resident_bytes": stats.resident_bytes,
        "passes": stats.passes,
        "demands": stats.demands,
        "hit_rate": _ratio(stats.hits, stats.demands),
        "hit_rate_without_prefetch": _ratio(stats.hits - stats.prefetch_hits, stats.demands),
        "prefetch_recall": _ratio(stats.prefetch_hits + stats.prefetch_late, would_miss),
        "prefetch_precision": _ratio(stats.prefetch_used, stats.prefetch_issued),
        "prefetch_issued": stats.prefetch_issued,
        "loads": stats.loads,
        "bytes_read": bytes_read,
        "bytes_read_per_token": _ratio(bytes_read, per),
        "drives": [
            {
                "folder": d.folder,
                "bytes_read": d.bytes_read,
                "active_seconds": d.active_seconds,
                "bandwidth": _ratio(d.bytes_read, d.active_seconds),
                "failed": d.failed or None,
            }
            for d in stats.drives
        ],
        "problems": list(stats.problems),
    }


def run_report(
    before: dict[str, shoal_pb2.WorkerStats],
    after: dict[str, shoal_pb2.WorkerStats],
    tokens: int,
    lookahead: LookaheadStats | None,
) -> dict:
    """Per worker, what one run cost; and how good the coordinator's prefetch hints were."""
    report = {
        "workers": {
            address: summarize_stats(difference(before.get(address), stats), tokens)
            for address, stats in sorted(after.items())
        }
    }
    if lookahead is not None:
        report["hints"] = {
            "predictions": lookahead.predictions,
            "recall": lookahead.recall,
            "precision": lookahead.precision,
            "hints_sent": lookahead.hints_sent,
        }
    return report


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def format_stats_summary(address: str, s: dict) -> list[str]:
    """A few lines for one worker's summary."""
    lines = [
        f"  {address} ({s['node_id']}): budget {format_bytes(s['memory_budget'])} for "
        f"{format_bytes(s['expert_bytes'])} of experts, {format_bytes(s['resident_bytes'])} "
        "resident",
        f"    hit rate {_percent(s['hit_rate'])} of {s['demands']} expert uses, prefetch recall "
        f"{_percent(s['prefetch_recall'])}, precision {_percent(s['prefetch_precision'])}, "
        f"read {format_bytes(s['bytes_read'])}"
        + ("" if s["bytes_read_per_token"] is None else
           f" ({format_bytes(s['bytes_read_per_token'])} per token)"),
    ]
    for d in s["drives"]:
        speed = "-" if d["bandwidth"] is None else f"{format_bytes(d['bandwidth'])}/s"
        state = f"; FAILED: {d['failed']}" if d["failed"] else ""
        lines.append(f"    drive {d['folder']}: {format_bytes(d['bytes_read'])} at {speed}{state}")
    lines += [f"    problem: {p}" for p in s["problems"]]
    return lines


def format_report(report: dict) -> list[str]:
    lines = ["workers (this run):"]
    for address, summary in report["workers"].items():
        lines += format_stats_summary(address, summary)
    if hints := report.get("hints"):
        lines.append(
            f"router lookahead: {hints['predictions']} predictions, recall "
            f"{_percent(hints['recall'])}, precision {_percent(hints['precision'])}, "
            f"{hints['hints_sent']} hints sent"
        )
    return lines
