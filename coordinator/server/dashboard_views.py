"""What the dashboard shows, as plain data: a sample of the speed series, the coordinator's and
each worker's cards, the heat map's grid with every expert's owners; pure functions of the
members, the counters and the heat record, so tests call them without a network."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from coordinator.cluster.member import Member
from coordinator.dataplane.dispatch import LayerStats
from coordinator.decoding.report import summarize_stats
from coordinator.ops.heat_record import name_workers, summarize_heat
from coordinator.ops.ops_report import member_rows
from engine.heat import HeatRecord
from engine.manifest import ExpertKey, Manifest
from proto import shoal_pb2

Holder = tuple[str, str, frozenset[ExpertKey]]  # (node id, address, experts) of a live member

# ---------------------------------------------------------------------------------------
# Speed: one sample a second, from the difference of two readings of the counters


@dataclass(frozen=True)
class Counters:
    """A reading of the coordinator's counters (monotonic time `at`, wall time `wall`)."""

    at: float
    wall: float
    decode_steps: int
    decode_rows: int  # tokens decoded, one per request in each decode step
    decode: LayerStats  # the dispatcher's decode calls, summed (a copy)
    in_flight: int


def copy_layer_stats(stats: LayerStats) -> LayerStats:
    return LayerStats(**{f.name: getattr(stats, f.name) for f in fields(LayerStats)})


def layer_stats_difference(after: LayerStats, before: LayerStats) -> LayerStats:
    return LayerStats(**{f.name: getattr(after, f.name) - getattr(before, f.name)
                         for f in fields(LayerStats)})


def speed_sample(before: Counters, after: Counters) -> dict:
    """Decode tokens/s, the mean batch width (tokens per decode step) and the per-layer
    breakdown (microseconds per MoE layer call, decode calls only) between two readings;
    the breakdown is None when no layer call was made in between."""
    seconds = max(after.at - before.at, 1e-9)
    rows = after.decode_rows - before.decode_rows
    steps = after.decode_steps - before.decode_steps
    calls = layer_stats_difference(after.decode, before.decode)
    return {
        "t": after.wall,
        "decode_tps": rows / seconds,
        "batch_width": rows / steps if steps else 0.0,
        "in_flight": after.in_flight,
        "layer_calls": calls.calls,
        "breakdown": calls.breakdown() if calls.calls else None,
    }


# ---------------------------------------------------------------------------------------
# The cards


def replicas_of(members: Sequence[Member]) -> dict[str, int]:
    """By member key, how many of its experts another healthy worker holds too."""
    healthy = [m for m in members if m.state == "healthy"]
    out = {}
    for m in healthy:
        others: set[ExpertKey] = set()
        for other in healthy:
            if other.key != m.key:
                others |= other.experts
        out[m.key] = len(m.experts & others)
    return out


def drive_reads(stats: shoal_pb2.WorkerStats) -> int:
    return sum(d.reads for d in stats.drives)


def worker_cards(
    members: Sequence[Member],
    stats: Mapping[str, shoal_pb2.WorkerStats],
    reads_per_second: Mapping[str, float],
    since: Mapping[str, float],
) -> list[dict]:
    """One card per member: `shoal workers`' row (node id, address, path, state, experts,
    memory budget, free disk, round trip) with the state's start (wall time, from `since`
    by member key), the replicas it holds, and from its latest stats (by address) memory
    resident, cache hit rate, prefetch recall and drive reads per second."""
    replicas = replicas_of(members)
    cards = []
    for member, row in zip(members, member_rows(members), strict=True):
        card = {**row, "healthy": member.state == "healthy", "since": since.get(member.key),
                "replicas": replicas.get(member.key, 0)}
        reading = stats.get(member.address) if member.state == "healthy" else None
        if reading is not None:
            s = summarize_stats(reading)
            card.update(resident_bytes=s["resident_bytes"], expert_bytes=s["expert_bytes"],
                        memory_budget=s["memory_budget"] or row["memory_budget"],
                        hit_rate=s["hit_rate"],
                        # before any prefetch there is no recall to show, not a 0% one
                        prefetch_recall=s["prefetch_recall"] if s["prefetch_issued"] else None,
                        bytes_read=s["bytes_read"], problems=s["problems"],
                        drive_reads_per_s=reads_per_second.get(member.address))
        cards.append(card)
    return cards


def coordinator_card(*, model: str, manifest: Manifest, context: int, max_batch: int,
                     in_flight: int, problem: str | None, started: int, batching: dict,
                     prompt_cache: dict, latency: dict | None = None,
                     drafting: dict | None = None) -> dict:
    return {
        "model": model,
        "model_type": manifest.model_type,
        "moe_layers": len(manifest.layers),
        "experts": len(manifest.experts),
        "context": context,
        "max_batch": max_batch,
        "in_flight": in_flight,
        "healthy": problem is None,
        "detail": problem or "",
        "started": started,
        "batching": batching,
        "prompt_cache": prompt_cache,
        "latency": latency or {},
        "drafting": drafting,  # None without a draft
        "time": time.time(),
    }


# ---------------------------------------------------------------------------------------
# Heat


def healthy_holders(members: Sequence[Member]) -> list[Holder]:
    """The healthy members as heat_view takes them."""
    return [(m.node_id, m.address, m.experts) for m in members if m.state == "healthy"]


def heat_view(record: HeatRecord, manifest: Manifest, holders: Sequence[Holder]) -> dict:
    """The heat map's data: per MoE layer (rows, in order) the tokens of each expert, the
    live member that serves it first (an index into `workers`, -1: none) and how many serve
    it; with `shoal heat`'s summary (skew per layer, load per worker)."""
    names = name_workers([(node_id, address) for node_id, address, _ in holders])
    held_by: dict[ExpertKey, list[int]] = {}
    for index, (_, _, experts) in enumerate(holders):
        for key in experts:
            held_by.setdefault(key, []).append(index)
    total = record.total()
    counts, owner, copies = [], [], []
    for moe in manifest.layers:
        keys = [(moe.layer, e) for e in range(moe.num_experts)]
        holders = [held_by.get(key, ()) for key in keys]
        counts.append([total.get(key, 0) for key in keys])
        owner.append([h[0] if h else -1 for h in holders])
        copies.append([len(h) for h in holders])
    return {
        "layers": [moe.layer for moe in manifest.layers],
        "experts": [moe.num_experts for moe in manifest.layers],
        "counts": counts,
        "owner": owner,
        "copies": copies,
        "workers": names,
        "max": max((max(row, default=0) for row in counts), default=0),
        "summary": summarize_heat(record, manifest),
    }
