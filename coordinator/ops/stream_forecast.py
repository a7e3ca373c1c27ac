"""`shoal plan`'s streaming forecast: decode speed on the first 1, 2, 4, ... of the given Macs
when experts stream from their SSDs (placement: engine/stream_placement.py; speed:
engine/stream_speed.py)."""

from __future__ import annotations

from dataclasses import replace

from coordinator.ops.planning import forecast_words, machines
from engine.cache_policy import format_bytes
from engine.errors import InvalidInput
from engine.placement import SpeedAssumptions, WorkerCapacity, plan_placement
from engine.sizes import ModelSizes
from engine.stream_speed import (
    StreamingMember,
    active_compute_seconds,
    predict_streaming,
    skewed_heat,
)


def member_counts(total: int, scaling: bool) -> list[int]:
    """1, 2, 4, ... up to `total` (and `total` itself) with `scaling`; else just `total`."""
    if not scaling:
        return [total]
    counts, n = [], 1
    while n < total:
        counts.append(n)
        n *= 2
    return [*counts, total]


def streaming_forecast(
    sizes: ModelSizes,
    workers: list[WorkerCapacity],
    heat: dict | None,
    spare: float,
    assume: SpeedAssumptions,
    *,
    skew: float = 0.0,
    scaling: bool = False,
    read_factor: float = 1.0,
) -> dict:
    """Predicted decode per member count: the streaming placement of the experts over those
    Macs, each keeping its hot set in memory, reading the rest at `assume.disk_gbps` (or its
    own read speed), and off the drives the dense weights, the chosen experts from memory and
    a round trip per MoE layer. With no heat, `skew` shapes the routing (0: uniform).
    `read_factor`: bytes a drive reads per byte of demand misses, as the scaling benchmark
    measured it (its `read_factor`; 1: the misses alone)."""
    layers: dict[int, int] = {}
    for layer, _ in sizes.experts:
        layers[layer] = layers.get(layer, 0) + 1
    origin = "as given" if heat else f"assumed, skew {skew:g}"
    heat = heat or skewed_heat(layers, skew)
    rows = []
    for n in member_counts(len(workers), scaling):
        macs = [replace(w, read_gbps=w.read_gbps or assume.disk_gbps) for w in workers[:n]]
        try:
            plan = plan_placement(macs, sizes.experts, heat, spare=spare, top_k=sizes.top_k)
        except InvalidInput as e:
            rows.append({"macs": n, "fits": False, "reason": str(e)})
            continue
        members = [StreamingMember(w.name, int(w.memory * (1 - spare)), w.read_gbps * 1e9)
                   for w in macs]
        compute = active_compute_seconds(
            sizes.dense_bytes, sizes.experts, top_k=sizes.top_k,
            memory_bps=assume.memory_gbps * 1e9, round_trip_s=assume.round_trip_ms / 1e3,
            members=n)
        speed = predict_streaming(plan.holders, members, sizes.experts, heat, top_k=sizes.top_k,
                                  compute_seconds=compute, samples=64,
                                  read_factor=read_factor)
        rows.append({"macs": n, "fits": True, "resident": plan.resident, **speed,
                     "ceiling_tokens_per_second": ceiling(speed)})
    return {"heat": origin, "read_factor": read_factor, "rows": rows}


def ceiling(speed: dict) -> float:
    """The same forecast with no drive reads (every expert in memory): the bound its figure
    never exceeds, from the one model rather than a second estimate beside it."""
    return 1.0 / (speed["seconds_per_token"] - speed["read_seconds_per_token"])


def print_forecast(forecast: dict, assume: SpeedAssumptions) -> None:
    print(f"streaming forecast (heat {forecast['heat']}; {assume.disk_gbps:g} GB/s SSD unless "
          f"a {machines(1, word_only=True)} gives its own, {assume.memory_gbps:g} GB/s memory, "
          f"{assume.round_trip_ms:g} ms round trip per MoE layer, "
          f"{forecast.get('read_factor', 1.0):g}x the demand misses' bytes read):")
    for row in forecast["rows"]:
        if not row["fits"]:
            print(f"  {machines(row['macs'])}: does not fit: {row['reason']}")
            continue
        busy = max(row["drive_busy"].values())
        print(f"  {machines(row['macs'])}: {forecast_words(row)}, hit rate "
              f"{100 * row['hit_rate']:.0f}%, {format_bytes(row['read_bytes_per_token'])} read "
              f"per token, busiest drive {100 * busy:.0f}% of the time")

