"""What a generation reports: the object `shoal generate --json` prints, the tables `--stats`
adds and the workers' counters, as plain data built from what a run counted; the commands
that operate a cluster report through coordinator/ops/ops_report.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.cache_policy import format_bytes
from proto import shoal_pb2

if TYPE_CHECKING:
    from coordinator.dataplane.dispatch import DispatchStats
    from coordinator.dataplane.lookahead import LookaheadStats
    from coordinator.decoding.generate import GenerationResult

# ---------------------------------------------------------------------------------------
# shoal generate: --json, and what --stats adds


def generation_report(result: GenerationResult, stats: dict | None = None) -> dict:
    """What --json prints: the tokens and speeds, the draft's acceptance when there was one,
    and the --stats figures when asked for."""
    report = {
        "prompt_token_ids": result.prompt_token_ids,
        "token_ids": result.token_ids,
        "text": result.text,
        "prefill_tps": result.prefill_tps,
        "decode_tps": result.decode_tps,
        "finish_reason": result.finish_reason,
    }
    if result.speculative is not None:
        report["speculative"] = speculative_report(result)
    if stats is not None:
        report["stats"] = stats
    return report


def generation_stats(
    result: GenerationResult,
    dispatch: DispatchStats,
    lookahead: LookaheadStats | None,
    before: dict[str, shoal_pb2.WorkerStats],
    after: dict[str, shoal_pb2.WorkerStats],
) -> dict:
    """--stats: the dispatcher's per-layer and per-token figures, and under "streaming" what
    the workers' caches and drives did between the `before` and `after` counters."""
    stats = stats_report(dispatch, result)
    stats["streaming"] = streaming_report(before, after, len(result.token_ids), lookahead)
    return stats


def stats_report(stats: DispatchStats, result: GenerationResult) -> dict:
    """Per-layer dispatch figures and per-token timing, for --stats and --json."""
    generated = max(len(result.token_seconds), 1)
    layers = {
        str(layer): {
            "calls": s.calls,
            "requests": s.requests,
            "ms_per_call": 1e3 * s.seconds / max(s.calls, 1),
            "worker_compute_ms_per_call": 1e3 * s.worker_compute_seconds / max(s.calls, 1),
            "slowest_worker_ms_per_call": 1e3 * s.slowest_compute_seconds / max(s.calls, 1),
            "shared_expert_ms_per_call": 1e3 * s.shared_seconds / max(s.calls, 1),
            "bytes_sent": s.bytes_sent,
            "bytes_received": s.bytes_received,
        }
        for layer, s in sorted(stats.layers.items())
    }
    total = stats.total()
    return {
        "token_ms": [round(1e3 * t, 3) for t in result.token_seconds],
        "layers": layers,
        "bytes_sent_per_token": total.bytes_sent / generated,
        "bytes_received_per_token": total.bytes_received / generated,
        "dispatch_seconds": total.seconds,
        "requests": total.requests,
        "breakdown": stats.decode.breakdown(),  # decode calls only, us per MoE layer call
        "members": members_report(stats),
    }


def members_report(stats: DispatchStats) -> dict[str, dict]:
    """How each member's experts were reached, by address: its path (in process, lane, grpc),
    layer calls, requests and round trip; layers computed whole in process have no round trip."""
    members = {address: m.report() for address, m in stats.members.items()}
    if stats.whole_calls:
        members["local (whole layers)"] = {"path": "in process, mlx-lm's call",
                                           "calls": stats.whole_calls, "requests": 0,
                                           "round_trip_us": 0.0}
    return members


def speculative_report(result: GenerationResult) -> dict:
    """What the draft proposed and the target accepted, with the decode speed it gave."""
    assert result.speculative is not None
    # token_seconds has one entry per target token, the stopping EOS included
    report = result.speculative.report(len(result.token_seconds))
    report["decode_tps"] = result.decode_tps
    return report


BREAKDOWN_PARTS = (
    ("sync", "coordinator: wait for attention and router"),
    ("send", "coordinator: group, build and send requests"),
    ("wire", "wire: critical worker's round trip less its own time"),
    ("worker_parse", "worker: parse the request"),
    ("worker_matrix", "worker: matrix work (MLX evaluation alone)"),
    ("worker_bookkeeping", "worker: validation, cache, heat, graph building"),
    ("worker_reads", "worker: waiting for experts read from its drives"),
    ("worker_reply", "worker: build the reply"),
    ("worker_waited", "worker: waiting for its other streams' pieces (overlaps them)"),
    ("parse_scatter", "coordinator: parse replies, scatter into the result"),
    ("shared", "coordinator: shared expert (overlaps the workers)"),
    ("round_trip", "round trip: send to result, all of the above but sync"),
)


def breakdown_table(breakdown: dict[str, float]) -> str:
    """The per-layer breakdown as aligned lines, one part a line."""
    return "\n".join(f"  {breakdown[f'{part}_us']:>9.1f}  {label}"
                     for part, label in BREAKDOWN_PARTS if f"{part}_us" in breakdown)


def summary_lines(report: dict) -> list[str]:
    """What `shoal generate` says on stderr after the text (stdout holds only the text): the
    run's speeds, then the draft's acceptance and the --stats tables when the report has
    them."""
    lines = [
        f"prefill {len(report['prompt_token_ids'])} tokens at {report['prefill_tps']:.1f} "
        f"tok/s, decode {len(report['token_ids'])} tokens at {report['decode_tps']:.1f} tok/s"
    ]
    if "speculative" in report:
        lines += draft_lines(report["speculative"], report["decode_tps"],
                             changes="stats" in report)
    if "stats" in report:
        lines += stats_lines(report["stats"])
        lines += streaming_lines(report["stats"]["streaming"])
    return lines


def stats_lines(stats: dict) -> list[str]:
    """The dispatcher's figures: per MoE layer, per token, bytes, the decode breakdown."""
    lines = ["per layer (all calls):",
             f"  {'layer':>5} {'calls':>6} {'ms/call':>8} {'slowest worker ms':>17} "
             f"{'shared ms':>9} {'sent':>10} {'recv':>10}"]
    for layer, s in stats["layers"].items():
        lines.append(
            f"  {layer:>5} {s['calls']:>6} {s['ms_per_call']:>8.2f} "
            f"{s['slowest_worker_ms_per_call']:>17.2f} {s['shared_expert_ms_per_call']:>9.2f} "
            f"{s['bytes_sent']:>10} {s['bytes_received']:>10}"
        )
    ms = stats["token_ms"]
    lines.append(f"per token ms: first {ms[0]:.1f} (includes prefill), then "
                 + " ".join(f"{t:.1f}" for t in ms[1:20]) + (" ..." if len(ms) > 20 else ""))
    lines.append(f"bytes per token: sent {stats['bytes_sent_per_token']:.0f}, "
                 f"received {stats['bytes_received_per_token']:.0f}")
    lines.append("per-layer decode breakdown (us per MoE layer call):")
    lines.append(breakdown_table(stats["breakdown"]))
    lines.append("members (path, layer calls, round trip us per call):")
    lines += [f"  {address:<22} {m['path']:<12} {m['calls']:>6} {m['round_trip_us']:>9.1f}"
              for address, m in stats["members"].items()]
    return lines


def draft_lines(report: dict, decode_tps: float, *, changes: bool = False) -> list[str]:
    """What the draft proposed and the target accepted; with `changes`, when adaptive
    drafting changed the number of drafted tokens."""
    lines = [
        f"draft: proposed {report['proposed']}, accepted {report['accepted']} "
        f"({100 * report['acceptance_rate']:.0f}%), {report['tokens_per_step']:.2f} tokens per "
        f"target forward ({report['verify_steps']} verifying, {report['plain_steps']} plain), "
        f"decode {decode_tps:.1f} tok/s"
    ]
    if report.get("draft") == "mtp":  # each of the module's forwards: one expert round trip
        lines[0] = f"MTP {lines[0]}; the module's own forwards: {report['draft_forwards']}"
    if changes:
        steps = []
        for change in report["draft_changes"]:
            n = change["num_draft_tokens"]
            steps.append(f"from token {change['token']}: "
                         + (f"{n} drafted" if n else "drafting stopped (it did not pay)"))
        lines.append("adaptive drafting: " + "; ".join(steps))
    return lines


# ---------------------------------------------------------------------------------------
# The workers' cache, prefetch and drive counters (`GetStats`): generate --stats, workers


_COUNTERS = (
    "passes", "tokens", "demands", "hits", "misses", "prefetch_hits", "prefetch_late",
    "prefetch_issued", "prefetch_used", "prefetch_cancelled", "prefetch_wasted", "loads",
    "evictions",
)


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


def streaming_report(
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


def worker_stats_lines(address: str, s: dict) -> list[str]:
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


def streaming_lines(report: dict) -> list[str]:
    """The workers' part of a run's --stats, and the router lookahead's hints."""
    lines = ["workers (this run):"]
    for address, summary in report["workers"].items():
        lines += worker_stats_lines(address, summary)
    if (hints := report.get("hints")) and not hints["predictions"]:
        lines.append("router lookahead: -")  # nothing predicted: no recall to speak of
    elif hints:
        lines.append(
            f"router lookahead: {hints['predictions']} predictions, recall "
            f"{_percent(hints['recall'])}, precision {_percent(hints['precision'])}, "
            f"{hints['hints_sent']} hints sent"
        )
    return lines
