"""Predicted decode speed of a model that streams its experts from the members' drives: pure
arithmetic over a placement, each member's memory and read bandwidth, and the routing heat."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from engine.errors import InvalidInput
from engine.manifest import ExpertKey
from engine.stream_placement import member_hot_sets


@dataclass(frozen=True)
class StreamingMember:
    """One Mac as streaming sees it: bytes of experts it keeps in memory, its drive's read
    speed in bytes/s."""

    name: str
    memory: int
    read_bps: float


def skewed_heat(layers: Mapping[int, int], skew: float = 0.0) -> dict[ExpertKey, float]:
    """Routing heat when no record exists: expert e of a layer gets 1/(e+1)**skew of the
    tokens (0: uniform; about 1: a trained router's long tail)."""
    if skew < 0:
        raise InvalidInput(f"skew must be 0 or more, got {skew}")
    return {(layer, e): 1.0 / (e + 1) ** skew for layer, count in layers.items()
            for e in range(count)}


def predict_streaming(
    holders: Mapping[ExpertKey, Sequence[str]],
    members: Sequence[StreamingMember],
    sizes: Mapping[ExpertKey, int],
    heat: Mapping[ExpertKey, float],
    *,
    top_k: int,
    compute_seconds: float,
    samples: int = 128,
    seed: int = 0,
    read_factor: float = 1.0,
) -> dict:
    """Tokens/s of batch-1 decode: `compute_seconds` a token for everything but reads (dense
    part, expert matrix work, network), plus, in every MoE layer, the slowest member's reads.

    Routing is drawn `samples` times per layer (top-k without replacement, in proportion to
    heat), so the layer's wait is the expected maximum over members, not the maximum of their
    means: with few experts per member, one unlucky member sets the pace. An expert in a
    holder's hot set (`member_hot_sets`, the placement's rule) costs no read; else it is read
    by the holder with the least to read so far.
    `read_factor`: bytes a drive reads per byte of those misses, as measured (prefetches that
    no token used, a cache not yet warm); 1 reads the misses alone.
    """
    if not members:
        raise InvalidInput("a prediction needs at least one member")
    if any(m.read_bps <= 0 for m in members):
        raise InvalidInput("every member needs a drive read speed above 0")
    if read_factor <= 0:
        raise InvalidInput(f"the read factor must be above 0, got {read_factor}")
    index = {m.name: i for i, m in enumerate(members)}
    bps = np.array([m.read_bps for m in members], dtype=np.float64)
    hot = member_hot_sets(holders, {m.name: m.memory for m in members}, sizes, heat,
                          top_k=top_k)
    rng = np.random.default_rng(seed)
    by_layer: dict[int, list[int]] = {}
    for layer, expert in sizes:
        by_layer.setdefault(layer, []).append(expert)
    read_seconds = np.zeros(samples)
    member_bytes = np.zeros(len(members))
    uses = hits = 0
    for layer in sorted(by_layer):
        experts = sorted(by_layer[layer])
        weights = np.array([heat.get((layer, e), 0.0) for e in experts], dtype=np.float64)
        if weights.sum() <= 0:
            weights = np.ones(len(experts))
        k = min(top_k, len(experts))
        # Gumbel top-k: the same law as drawing k without replacement in proportion to heat.
        with np.errstate(divide="ignore"):
            keys = np.log(weights)[None, :] + rng.gumbel(size=(samples, len(experts)))
        chosen = np.argpartition(-keys, k - 1, axis=1)[:, :k]
        for s in range(samples):
            load = np.zeros(len(members))
            for position in chosen[s]:
                key = (layer, experts[position])
                names = holders.get(key, ())
                if not names:
                    raise InvalidInput(f"expert {key[0]}/{key[1]} has no holder")
                uses += 1
                if any(key in hot[n] for n in names):
                    hits += 1
                    continue
                who = min((index[n] for n in names), key=lambda i: (load[i] / bps[i], i))
                load[who] += sizes[key] * read_factor
            member_bytes += load
            read_seconds[s] += float((load / bps).max())
    reads = float(read_seconds.mean())
    seconds = compute_seconds + reads
    per_member = member_bytes / samples
    return {
        "tokens_per_second": 1.0 / seconds,
        "seconds_per_token": seconds,
        "read_seconds_per_token": reads,
        "hit_rate": hits / uses if uses else 1.0,
        "read_bytes_per_token": float(per_member.sum()),
        "drive_busy": {m.name: float(per_member[i] / bps[i] / seconds)
                       for i, m in enumerate(members)},
    }


def active_compute_seconds(
    dense_bytes: int, sizes: Mapping[ExpertKey, int], *, top_k: int, memory_bps: float,
    round_trip_s: float, members: int,
) -> float:
    """Seconds a token spends off the drives when no measurement exists: the dense weights and
    the chosen experts' bytes read once from memory, and with more than one member a network
    round trip per MoE layer."""
    layers: dict[int, list[int]] = {}
    for (layer, _), size in sizes.items():
        layers.setdefault(layer, []).append(size)
    active = sum(top_k * sum(s) / len(s) for s in layers.values())
    trips = len(layers) * round_trip_s if members > 1 else 0.0
    return (dense_bytes + active) / memory_bps + trips
