"""What the commands report: the object each `--json` prints and the tables `--stats` adds, as
plain data built from what a run counted (the counting stays where the work is done: the
dispatcher, the lookahead, the draft, the workers). The dashboard shows the same objects.

One section per command that has such a report: generate, workers, doctor, plan, heat,
deploy and rebalance (`shoal bench`'s report is its harness's, benchmarks/bench.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from coordinator.membership import duplicate_ids
from coordinator.ops.doctor import failed
from engine.cache_policy import format_bytes
from engine.errors import InvalidInput
from engine.heat import heat_to_json
from engine.placement import decode_bound, plan_placement
from proto import shoal_pb2

if TYPE_CHECKING:
    from coordinator.dispatch import DispatchStats
    from coordinator.generate import GenerationResult
    from coordinator.lookahead import LookaheadStats
    from coordinator.membership import Member
    from coordinator.ops.doctor import Check
    from coordinator.ops.rebalancer import Report
    from engine.heat import HeatRecord
    from engine.placement import SpeedAssumptions, WorkerCapacity
    from engine.sizes import ModelSizes

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
    }


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
    if hints := report.get("hints"):
        lines.append(
            f"router lookahead: {hints['predictions']} predictions, recall "
            f"{_percent(hints['recall'])}, precision {_percent(hints['precision'])}, "
            f"{hints['hints_sent']} hints sent"
        )
    return lines


# ---------------------------------------------------------------------------------------
# shoal workers (and the workers shoal doctor checks)


def member_rows(members: Sequence[Member]) -> list[dict]:
    """What `shoal workers` shows of each member, as plain data (also its --json)."""
    duplicates = duplicate_ids(members)
    return [
        {
            "node_id": m.node_id,
            "address": m.address,
            "interface": m.route.interface,
            "path": m.route.kind,
            "state": m.state,
            "detail": m.detail,
            "experts": m.experts_held,
            "memory_budget": m.memory_budget,
            "free_disk": m.free_disk,
            "rtt_ms": None if m.rtt_ms is None else round(m.rtt_ms, 3),
            "duplicate_node_id": m.node_id in duplicates,
            "model": m.advert.model if m.advert else None,
        }
        for m in members
    ]


def workers_report(cluster: str, rows: list[dict]) -> dict:
    """`shoal workers --json`: the cluster's name and its members' rows (with --stats, each
    healthy one's `stats` or `stats_error`)."""
    return {"cluster": cluster, "workers": rows}


def workers_stats_lines(rows: Sequence[dict]) -> list[str]:
    """`shoal workers --stats` under the table: each worker's counters since it started."""
    lines = ["\nsince each worker started:"]
    for row in rows:
        if "stats" in row:
            lines.append("\n".join(worker_stats_lines(row["address"], row["stats"])))
        elif "stats_error" in row:
            lines.append(f"  {row['address']}: no stats ({row['stats_error']})")
    return lines


# ---------------------------------------------------------------------------------------
# shoal doctor


def doctor_report(checks: Sequence[Check]) -> dict:
    """`shoal doctor --json`: every check with its verdict, and whether none failed."""
    return {"checks": [asdict(c) for c in checks], "ok": not failed(checks)}


# ---------------------------------------------------------------------------------------
# shoal plan


def plan_report(
    sizes: ModelSizes,
    workers: list[WorkerCapacity],
    heat: dict | None,
    spare: float,
    assume: SpeedAssumptions,
    *,
    heat_origin: str = "",
) -> dict:
    """Everything `shoal plan` says, as plain data (also its --json output): the planner's
    answer for these sizes and workers; `heat_origin` says where the heat came from."""
    report = {
        "model": {"model_type": sizes.model_type, "estimated_from_config": sizes.estimated,
                  "experts": len(sizes.experts), "expert_bytes": sum(sizes.experts.values()),
                  "dense_bytes": sizes.dense_bytes, "top_k": sizes.top_k,
                  "precision": sizes.precision, "expert_bits_per_weight": sizes.expert_bits,
                  "source_bytes": sizes.source_bytes or None,
                  "split_bytes": sum(sizes.experts.values()) + sizes.dense_bytes},
        "heat": "uniform" if heat is None else heat_origin or "from file",
    }
    try:
        plan = plan_placement(workers, sizes.experts, heat, spare=spare)
    except InvalidInput as e:
        return {**report, "fits": False, "verdict": "does not fit", "reason": str(e)}
    per_worker = {w.name: {"memory": w.memory, "disk": w.disk, "experts": 0, "bytes": 0,
                           "replica_copies": 0} for w in workers}
    for key, names in plan.holders.items():
        for name in names:
            per_worker[name]["experts"] += 1
            per_worker[name]["bytes"] += sizes.experts[key]
            per_worker[name]["replica_copies"] += len(names) > 1
    return {
        **report,
        "fits": True,
        "verdict": "fits" if plan.resident else "streams",
        "resident": plan.resident,
        "workers": per_worker,
        "replicas": {f"{layer}/{expert}": n for (layer, expert), n in plan.replicas.items()},
        "imbalance_before": plan.imbalance_before,
        "imbalance_after": plan.imbalance_after,
        "decode_bound": decode_bound(plan, sizes.experts, heat, workers, top_k=sizes.top_k,
                                     dense_bytes=sizes.dense_bytes, assume=assume),
    }


# ---------------------------------------------------------------------------------------
# shoal heat


def heat_report(record: HeatRecord, *, layer: int | None = None) -> dict[str, dict[str, float]]:
    """`shoal heat --json`: the recorded tokens per expert (of one layer, if asked), in the
    form `shoal plan --heat` reads."""
    total = record.total()
    if layer is not None:
        total = {key: count for key, count in total.items() if key[0] == layer}
    return heat_to_json(total)


# ---------------------------------------------------------------------------------------
# shoal deploy and shoal rebalance


def migration_report(report: Report) -> dict:
    """The plan and its result for --json: every step, what was left as is, the target."""
    p = report.proposal
    e = report.execution
    return {
        "mode": report.mode,
        "workers": report.workers,
        "resumed": p.resumed,
        "imbalance_now": p.imbalance_now,
        "imbalance_after": p.imbalance_after,
        "copy_bytes": p.plan.copy_bytes,
        "steps": [{"kind": s.kind, "layer": s.key[0], "expert": s.key[1], "worker": s.worker,
                   "source": s.source, "bytes": s.bytes} for s in p.plan.steps],
        "blocked": {f"{k[0]}/{k[1]}": why for k, why in p.plan.blocked.items()},
        "target": {f"{k[0]}/{k[1]}": list(v) for k, v in sorted(p.target.items())},
        "execution": None if e is None else {"steps": e.steps_done, "seconds": e.seconds,
                                             "copied_bytes": e.copied_bytes,
                                             "resumed_bytes": e.resumed_bytes,
                                             "by_kind": e.counts},
    }
