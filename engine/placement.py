"""Pure planning of which worker holds which expert: no I/O, plain data in and out."""

from __future__ import annotations

import functools
import heapq
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from engine.errors import InvalidInput, Unavailable
from engine.manifest import ExpertKey
from engine.stream_placement import plan_streaming


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


@dataclass(frozen=True)
class LayerRoutes:
    """Who serves each expert of one layer: `copies[e, :counts[e]]` are the worker indices
    holding expert e, the first being its primary owner (the rest ascending, -1 padded)."""

    copies: np.ndarray  # (experts, most copies) int32
    counts: np.ndarray  # (experts,) int32, 0 for an expert nobody holds

    @functools.cached_property
    def replicated(self) -> bool:
        """Whether any expert has a second copy (asked at every layer call: decided once)."""
        return bool((self.counts > 1).any())


def replica_routes(
    layers: Mapping[int, int], holdings: Sequence[Collection[ExpertKey]]
) -> dict[int, LayerRoutes]:
    """For each layer (layer -> number of experts), every worker index that holds each expert.

    The primary owner of an expert held by several workers is whichever of them has been given
    the fewest experts of that layer so far (lowest index on ties), so the table is the same on
    every run. Raises Unavailable naming every expert nobody holds.
    """
    owners_of: dict[ExpertKey, list[int]] = {}
    for worker, held in enumerate(holdings):
        for key in held:
            owners_of.setdefault(key, []).append(worker)
    routes: dict[int, LayerRoutes] = {}
    missing: dict[int, list[int]] = {}
    for layer, count in sorted(layers.items()):
        widest = max((len(owners_of.get((layer, e), ())) for e in range(count)), default=0)
        copies = np.full((count, max(widest, 1)), -1, dtype=np.int32)
        counts = np.zeros(count, dtype=np.int32)
        load = [0] * len(holdings)
        for expert in range(count):
            candidates = owners_of.get((layer, expert))
            if not candidates:
                continue
            chosen = min(candidates, key=lambda w: (load[w], w))
            load[chosen] += 1
            ordered = [chosen, *sorted(w for w in candidates if w != chosen)]
            copies[expert, : len(ordered)] = ordered
            counts[expert] = len(ordered)
        absent = np.flatnonzero(counts == 0)
        if absent.size:
            missing[layer] = absent.tolist()
        routes[layer] = LayerRoutes(copies, counts)
    if missing:
        raise Unavailable("no live worker holds these experts: " + describe_experts(missing))
    return routes


def describe_experts(
    by_layer: Mapping[int, Sequence[int]], *, layers_shown: int = 3, ids_shown: int = 4
) -> str:
    """Expert ids per layer, summarised for a message a person reads: counts per layer and
    the first few ids ('layer 3: 128 experts (0, 2, 4, 6, ...)'), the first few layers only.
    A DeepSeek-V3 split over two workers once made this list 35 KB."""
    layers = sorted(layer for layer, ids in by_layer.items() if ids)
    parts = []
    for layer in layers[:layers_shown]:
        ids = sorted(by_layer[layer])
        short = describe_ids(ids)
        if len(ids) <= ids_shown or len(short) <= 40:
            parts.append(f"layer {layer}: {short}")
        else:
            first = ", ".join(map(str, ids[:ids_shown]))
            parts.append(f"layer {layer}: {len(ids)} experts ({first}, ...)")
    text = "; ".join(parts)
    if len(layers) > layers_shown:
        total = sum(len(by_layer[layer]) for layer in layers)
        text = (f"{total} experts in {len(layers)} layers ({ranges(layers)}): "
                f"{text}; and {len(layers) - layers_shown} more layers")
    return text


def describe_ids(ids: Sequence[int]) -> str:
    """'experts 1-3, 7' for [1, 2, 3, 7]: short enough for an error message."""
    return "experts " + ranges(ids)


def ranges(ids: Sequence[int]) -> str:
    """'1-3, 7' for [1, 2, 3, 7]."""
    parts, ids = [], sorted(ids)
    start = prev = ids[0]
    for value in [*ids[1:], None]:
        if value is not None and value == prev + 1:
            prev = value
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------
# Planning a placement from capacities and heat


@dataclass(frozen=True)
class WorkerCapacity:
    """What one worker can hold: bytes of memory for experts, and of free disk (None: ample);
    its drive's read speed in GB/s where known (placement for streaming weighs it)."""

    name: str
    memory: int
    disk: int | None = None
    read_gbps: float | None = None


@dataclass(frozen=True)
class Placement:
    holders: dict[ExpertKey, tuple[str, ...]]  # expert -> the workers holding a copy
    bytes_per_worker: dict[str, int]
    resident: bool  # every worker's share fits in its memory (else experts stream from disk)
    imbalance_before: float
    imbalance_after: float

    @property
    def replicas(self) -> dict[ExpertKey, int]:
        return {key: len(h) for key, h in self.holders.items() if len(h) > 1}


def imbalance(
    holders: Mapping[ExpertKey, Sequence[str]],
    heat: Mapping[ExpertKey, float],
    workers: Collection[str] = (),
) -> float:
    """Expected tokens of the busiest worker over the mean, summed over layers.

    Each layer waits for its slowest worker, so per layer the cost is the busiest worker's
    load; the ratio of the layers' summed maxima to their summed means is 1.0 when perfectly
    even. An expert's tokens are assumed to split evenly over its copies. The mean is over
    the holders and `workers`: a worker that could take load but holds nothing (one just
    added) is idle, load 0, and makes the others' share uneven; left out, one worker holding
    everything would score a perfect 1.0.
    """
    loads: dict[str, dict[ExpertKey, float]] = {name: {} for name in workers}
    for key, names in holders.items():
        for name in names:
            loads.setdefault(name, {})[key] = heat.get(key, 0.0) / len(names)
    return load_imbalance(loads)


def load_imbalance(loads: Mapping[str, Mapping[ExpertKey, float]]) -> float:
    """The same ratio for loads already split by worker (worker -> (layer, expert) -> tokens),
    e.g. the tokens each worker really computed: summed per layer busiest over summed means."""
    per_layer: dict[int, dict[str, float]] = {}
    for name, counts in loads.items():
        for (layer, _), count in counts.items():
            per_layer.setdefault(layer, dict.fromkeys(loads, 0.0))[name] += count
    if not loads:
        return 1.0
    peak = sum(max(layer.values()) for layer in per_layer.values())
    mean = sum(sum(layer.values()) / len(loads) for layer in per_layer.values())
    return peak / mean if mean > 0 else 1.0


def _capacities(workers: Sequence[WorkerCapacity], total: int, spare: float) -> tuple[dict, bool]:
    disk = {w.name: w.disk if w.disk is not None else 1 << 62 for w in workers}
    # A resident share is also a file on the worker's disk: a small disk bounds it too.
    memory = {w.name: min(int(w.memory * (1.0 - spare)), disk[w.name]) for w in workers}
    if sum(memory.values()) >= total:
        return memory, True
    if sum(disk.values()) >= total:
        return disk, False
    raise InvalidInput(
        f"the cluster cannot hold the model: its experts need {total / 2**30:.1f} GiB, the "
        f"workers have {sum(memory.values()) / 2**30:.1f} GiB of memory (after {spare:.0%} "
        f"spare) and {sum(disk.values()) / 2**30:.1f} GiB of disk"
    )


def _copies(
    sizes: Mapping[ExpertKey, int], heat: Mapping[ExpertKey, float], workers: int, room: int
) -> dict[ExpertKey, int]:
    """How many copies of each expert: replicate the expert with the highest load per copy
    while it alone outweighs half a worker's fair share of its layer's load (beyond that a
    copy no longer lowers the busiest worker) and the spare bytes allow."""
    copies = dict.fromkeys(sizes, 1)
    layer_load: dict[int, float] = {}
    for (layer, _), load in heat.items():
        layer_load[layer] = layer_load.get(layer, 0.0) + load
    heap = [(-heat[key], key) for key in sizes if heat[key] > 0]
    heapq.heapify(heap)
    while heap:
        negative_load, key = heapq.heappop(heap)
        share = layer_load[key[0]] / workers
        if -negative_load <= share / 2 or copies[key] >= workers or sizes[key] > room:
            continue
        copies[key] += 1
        room -= sizes[key]
        heapq.heappush(heap, (-heat[key] / copies[key], key))
    return copies


def _pack(
    sizes: Mapping[ExpertKey, int],
    heat: Mapping[ExpertKey, float],
    copies: Mapping[ExpertKey, int],
    names: list[str],
    capacity: Mapping[str, int],
    prefer: Mapping[ExpertKey, Collection[str]] | None = None,
    stickiness: float = 0.0,
) -> tuple[dict[ExpertKey, tuple[str, ...]], dict[str, int]]:
    """Layer by layer, each copy (heaviest first) to the least loaded worker with room; a
    worker in `prefer[key]` counts as `stickiness` x the layer's fair share less loaded."""
    by_layer: dict[int, list[ExpertKey]] = {}
    for key in sizes:
        by_layer.setdefault(key[0], []).append(key)
    holders: dict[ExpertKey, list[str]] = {key: [] for key in sizes}
    used = dict.fromkeys(names, 0)
    for layer in sorted(by_layer):
        load = dict.fromkeys(names, 0.0)
        bonus = stickiness * sum(heat[key] for key in by_layer[layer]) / len(names)
        items = [(heat[key] / copies[key], key) for key in by_layer[layer]
                 for _ in range(copies[key])]
        for share, key in sorted(items, key=lambda item: (-item[0], -sizes[item[1]], item[1])):
            fits = [n for n in names
                    if n not in holders[key] and used[n] + sizes[key] <= capacity[n]]
            if not fits:
                if holders[key]:
                    continue  # a replica that no longer fits is simply not made
                raise InvalidInput(
                    f"expert {key[0]}/{key[1]} ({sizes[key] / 2**20:.1f} MiB) fits on no "
                    "worker: the capacities are too uneven for one-expert-per-file placement"
                )
            kept = (prefer or {}).get(key, ())
            chosen = min(fits, key=lambda n: (load[n] - (bonus if n in kept else 0.0),
                                              used[n] / max(capacity[n], 1), n))
            holders[key].append(chosen)
            load[chosen] += share
            used[chosen] += sizes[key]
    return {key: tuple(sorted(h)) for key, h in holders.items()}, used


def plan_placement(
    workers: Sequence[WorkerCapacity],
    sizes: Mapping[ExpertKey, int],
    heat: Mapping[ExpertKey, float] | None = None,
    *,
    spare: float = 0.1,
    current: Mapping[ExpertKey, Sequence[str]] | None = None,
    stickiness: float = 0.0,
    top_k: int | None = None,
    drive_copies: int = 1,
) -> Placement:
    """Place every expert on at least one worker, hot ones on several, within capacity, so the
    busiest worker's expected load per layer is as low as greedy packing makes it.

    In the spirit of DeepSeek's EPLB: first decide copy counts (replicas for the experts with
    the highest load per copy), then, layer by layer, put copies heaviest first on the least
    loaded worker that has room and no copy yet. Heat defaults to uniform. `imbalance_before`
    is that of `current` (default: the same packing without replicas). With `current` and a
    `stickiness` > 0 (live rebalancing), a copy stays where it is unless another worker would
    carry less load by more than stickiness x the layer's fair share: fewer bytes to move.
    When the experts outgrow the workers' memory and every worker's read speed and `top_k`
    are known, engine/stream_placement.py places them instead (hot sets in memory, cold
    reads spread by read speed, each cold expert on `drive_copies` drives; `current` and
    `stickiness` then play no part).
    """
    if not workers:
        raise InvalidInput("a placement needs at least one worker")
    if len({w.name for w in workers}) != len(workers):
        raise InvalidInput("worker names must be unique")
    if not 0.0 <= spare < 1.0:
        raise InvalidInput(f"spare must be between 0 and 100%, got {spare:.0%}")
    heat = {key: float((heat or {}).get(key, 0.0 if heat else 1.0)) for key in sizes}
    if not any(heat.values()):
        heat = dict.fromkeys(sizes, 1.0)
    total = sum(sizes.values())
    capacity, resident = _capacities(workers, total, spare)
    names = [w.name for w in workers]
    if not resident and top_k and all(w.read_gbps for w in workers):
        memory, disk = _capacities(workers, 0, spare)[0], capacity
        speeds = {w.name: w.read_gbps * 1e9 for w in workers}
        holders = plan_streaming(memory, disk, speeds, sizes, heat, top_k=top_k,
                                 drive_copies=drive_copies)
        used = {n: sum(sizes[k] for k, h in holders.items() if n in h) for n in names}
        before = current or _pack(sizes, heat, dict.fromkeys(sizes, 1), names, capacity)[0]
        return Placement(holders, used, False, imbalance(before, heat, names),
                         imbalance(holders, heat, names))
    copies = _copies(sizes, heat, len(workers), sum(capacity.values()) - total)

    holders, used = _pack(sizes, heat, copies, names, capacity, current, stickiness)
    single = dict.fromkeys(sizes, 1)
    if copies != single:
        # Greedy packing of the extra copies can land worse than none at all: keep the better.
        alone, alone_used = _pack(sizes, heat, single, names, capacity, current, stickiness)
        if imbalance(alone, heat, names) < imbalance(holders, heat, names):
            holders, used = alone, alone_used
    if current is None:
        current = _pack(sizes, heat, single, names, capacity)[0]
    return Placement(holders, used, resident, imbalance(current, heat, names),
                     imbalance(holders, heat, names))


def store_placement(
    members: Sequence[WorkerCapacity],
    sizes: Mapping[ExpertKey, int],
    heat: Mapping[ExpertKey, float] | None,
    *,
    top_k: int,
    spare: float = 0.1,
    drive_copies: int = 1,
) -> dict[ExpertKey, tuple[int, ...]]:
    """Which members (indices into `members`) hold each expert when `shoal shard` writes a
    store folder per member, their memory the budget each worker will be given: a model
    beyond it is placed for streaming where every read speed is known (hot sets in memory
    less `spare`, as `shoal rebalance` plans, cold reads by drive speed), else as
    plan_placement places it."""
    plan = plan_placement(members, sizes, heat, spare=spare, top_k=top_k,
                          drive_copies=drive_copies)
    index = {w.name: i for i, w in enumerate(members)}
    return {key: tuple(sorted(index[n] for n in names)) for key, names in plan.holders.items()}


@dataclass(frozen=True)
class SpeedAssumptions:
    """The figures a decode-speed bound rests on; printed with every estimate."""

    memory_gbps: float = 400.0  # unified memory bandwidth of each Mac, GB/s
    disk_gbps: float = 5.0  # SSD read bandwidth, GB/s
    round_trip_ms: float = 0.3  # one MoE layer's request and reply over Thunderbolt


def decode_bound(
    placement: Placement,
    sizes: Mapping[ExpertKey, int],
    heat: Mapping[ExpertKey, float] | None,
    capacities: Sequence[WorkerCapacity],
    *,
    top_k: int,
    dense_bytes: int,
    assume: SpeedAssumptions = SpeedAssumptions(),
) -> dict:
    """An upper bound on decode tokens/s: each token reads the dense weights once on the
    coordinator, and in every MoE layer waits for the busiest worker to read its chosen
    experts (from memory, or from disk for the share of its bytes beyond its memory) plus one
    network round trip. Compute is assumed to keep up with memory, so real speed is lower."""
    heat = {key: float((heat or {}).get(key, 1.0)) for key in sizes}
    memory = {w.name: w.memory for w in capacities}
    layer_heat: dict[int, float] = {}
    for (layer, _), h in heat.items():
        layer_heat[layer] = layer_heat.get(layer, 0.0) + h
    seconds = dense_bytes / (assume.memory_gbps * 1e9)
    for layer in sorted(layer_heat):
        read: dict[str, float] = {}
        for (lay, expert), names in placement.holders.items():
            if lay != layer or not layer_heat[layer]:
                continue
            chosen = min(1.0, top_k * heat[(lay, expert)] / layer_heat[layer])
            for name in names:
                read[name] = read.get(name, 0.0) + chosen * sizes[(lay, expert)] / len(names)
        worst = 0.0
        for name, nbytes in read.items():
            held = placement.bytes_per_worker[name]
            on_disk = 0.0 if held <= memory[name] else 1.0 - memory[name] / held
            worst = max(worst, nbytes * (1 - on_disk) / (assume.memory_gbps * 1e9)
                        + nbytes * on_disk / (assume.disk_gbps * 1e9))
        seconds += worst + assume.round_trip_ms / 1e3
    return {"tokens_per_second": 1.0 / seconds, "seconds_per_token": seconds,
            "assumptions": asdict(assume)}
