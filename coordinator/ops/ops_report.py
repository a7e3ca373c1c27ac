"""What the commands that operate a cluster report: `shoal workers`, `doctor`, `plan`, `heat`,
`deploy` and `rebalance` (each `--json` object and its table), as plain data; the dashboard
shows the same objects. What a generation reports is coordinator/decoding/report.py's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from coordinator.cluster.member import duplicate_ids
from coordinator.decoding.report import worker_stats_lines
from coordinator.ops.doctor import failed
from engine.errors import InvalidInput
from engine.heat import heat_to_json
from engine.placement import decode_bound, plan_placement

if TYPE_CHECKING:
    from coordinator.cluster.member import Member
    from coordinator.ops.doctor import Check
    from coordinator.ops.rebalancer import Report
    from engine.heat import HeatRecord
    from engine.placement import SpeedAssumptions, WorkerCapacity
    from engine.sizes import ModelSizes


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
        plan = plan_placement(workers, sizes.experts, heat, spare=spare, top_k=sizes.top_k)
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
        "imbalance_of": p.measure,
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
