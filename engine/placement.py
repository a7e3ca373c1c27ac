"""Pure planning of which worker holds which expert: no I/O, plain data in and out."""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from engine.errors import InvalidInput, Unavailable

ExpertKey = tuple[int, int]  # (layer, expert)


def split_by_bytes(sizes: Mapping[ExpertKey, int], workers: int) -> list[list[ExpertKey]]:
    """Split experts into `workers` groups whose byte totals are as even as greedy packing gets.

    Largest first, each into the currently lightest group; ties go to the lower group index,
    so the result is deterministic. Each group is returned sorted by (layer, expert).
    """
    if workers < 1:
        raise InvalidInput(f"need at least one worker, got {workers}")
    if workers > len(sizes):
        raise InvalidInput(f"{workers} workers but only {len(sizes)} experts to share between them")
    heap = [(0, index) for index in range(workers)]
    groups: list[list[ExpertKey]] = [[] for _ in range(workers)]
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        total, index = heapq.heappop(heap)
        groups[index].append(key)
        heapq.heappush(heap, (total + sizes[key], index))
    return [sorted(group) for group in groups]


def routing_table(
    layers: Mapping[int, int], holdings: Sequence[Collection[ExpertKey]]
) -> dict[int, np.ndarray]:
    """For each layer (layer -> number of experts), the worker index that serves each expert.

    An expert held by several workers goes to whichever of them has been given the fewest
    experts of that layer so far (lowest index on ties), so copies share the work and the
    table is the same on every run. Raises Unavailable naming every expert nobody holds.
    """
    owners_of: dict[ExpertKey, list[int]] = {}
    for worker, held in enumerate(holdings):
        for key in held:
            owners_of.setdefault(key, []).append(worker)
    table: dict[int, np.ndarray] = {}
    missing: list[str] = []
    for layer, count in sorted(layers.items()):
        owners = np.full(count, -1, dtype=np.int32)
        load = [0] * len(holdings)
        for expert in range(count):
            candidates = owners_of.get((layer, expert))
            if not candidates:
                continue
            chosen = min(candidates, key=lambda w: (load[w], w))
            owners[expert] = chosen
            load[chosen] += 1
        absent = np.flatnonzero(owners < 0)
        if absent.size:
            missing.append(f"layer {layer}: {describe_ids(absent.tolist())}")
        table[layer] = owners
    if missing:
        raise Unavailable("no live worker holds these experts: " + "; ".join(missing))
    return table


def describe_ids(ids: Sequence[int]) -> str:
    """'1-3, 7' for [1, 2, 3, 7]: short enough for an error message."""
    parts, ids = [], sorted(ids)
    start = prev = ids[0]
    for value in [*ids[1:], None]:
        if value is not None and value == prev + 1:
            prev = value
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    return "experts " + ", ".join(parts)
