"""Pure placement for a model larger than the members' memory: each member's hot set fits its
memory, cold experts go where their expected reads finish soonest, hot experts get replicas
in memory left over."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from engine.errors import InvalidInput
from engine.manifest import ExpertKey


def selection_odds(heat: Mapping[ExpertKey, float], top_k: int) -> dict[ExpertKey, float]:
    """The chance that a token picks each expert: heat over its layer's, times top-k, at
    most 1. Comparable across layers, unlike raw token counts."""
    layer_heat: dict[int, float] = {}
    for (layer, _), h in heat.items():
        layer_heat[layer] = layer_heat.get(layer, 0.0) + h
    return {key: min(1.0, top_k * h / layer_heat[key[0]]) if layer_heat[key[0]] else 0.0
            for key, h in heat.items()}


def plan_streaming(
    memory: Mapping[str, int],
    disk: Mapping[str, int],
    read_bps: Mapping[str, float],
    sizes: Mapping[ExpertKey, int],
    heat: Mapping[ExpertKey, float],
    *,
    top_k: int,
    drive_copies: int = 1,
) -> dict[ExpertKey, tuple[str, ...]]:
    """Holders of each expert when the experts outgrow the members' memory (member -> bytes).

    The experts with the highest selection odds per byte fill the members' memory together:
    each such hot expert goes to the member with room whose layer carries the fewest expected
    uses so far. Every other (cold) expert is read from a drive when chosen: it goes to the
    member whose expected read time in that layer, bytes / read speed, would end lowest, since
    each layer waits for its slowest drive. Memory a member has left that no cold expert
    could fill takes replicas of the hottest experts it lacks. Deterministic: ties go by name.
    `drive_copies`: each cold expert on that many members' drives (at most one per member),
    its reads expected to split evenly over them, so that a layer call can read each miss
    from the copy whose drive is least busy (coordinator/dataplane/call_plan.py: spread_reads).
    """
    names = sorted(memory)
    if not names:
        raise InvalidInput("a placement needs at least one member")
    if drive_copies < 1:
        raise InvalidInput(f"drive copies must be 1 or more, got {drive_copies}")
    copies = min(drive_copies, len(names))
    if any(read_bps.get(n, 0) <= 0 for n in names):
        raise InvalidInput("every member needs a drive read speed above 0 to plan streaming")
    odds = selection_odds({key: heat.get(key, 0.0) for key in sizes}, top_k)
    order = sorted(sizes, key=lambda k: (-odds[k] / max(sizes[k], 1), k))
    room = dict(memory)
    free_disk = dict(disk)
    holders: dict[ExpertKey, list[str]] = {}
    uses: dict[tuple[int, str], float] = {}
    cold: list[ExpertKey] = []
    for key in order:
        fits = [n for n in names if sizes[key] <= min(room[n], free_disk[n])]
        if not fits:
            cold.append(key)
            continue
        chosen = min(fits, key=lambda n: (uses.get((key[0], n), 0.0), -room[n], n))
        holders[key] = [chosen]
        uses[(key[0], chosen)] = uses.get((key[0], chosen), 0.0) + odds[key]
        room[chosen] -= sizes[key]
        free_disk[chosen] -= sizes[key]
    reads: dict[tuple[int, str], float] = {}
    shared: dict[tuple[int, str, str], int] = {}  # (layer, member, member) -> experts both hold
    for key in sorted(cold, key=lambda k: (-odds[k] * sizes[k], k)):
        fits = [n for n in names if sizes[key] <= free_disk[n]]
        if len(fits) < copies:
            room_on = "no member's disk" if not fits else f"only {len(fits)} members' disks"
            raise InvalidInput(
                f"expert {key[0]}/{key[1]} ({sizes[key] / 2**20:.1f} MiB) fits on {room_on}, "
                f"{copies} needed: the cluster's disks cannot hold the model"
                + (" with that many copies of each cold expert" if copies > 1 else ""))
        share = odds[key] * sizes[key] / copies
        chosen: list[str] = []
        for _ in range(copies):
            # soonest to finish; within one read of it, the member sharing fewest of this
            # layer's experts with those chosen, so that every pair of drives can trade reads
            ends = {n: (reads.get((key[0], n), 0.0) + share) / read_bps[n]
                    for n in fits if n not in chosen}
            soonest = min(ends.values())
            chosen.append(min(
                (n for n, end in ends.items() if end <= soonest + share / read_bps[n]),
                key=lambda n, key=key: (sum(shared.get((key[0], *sorted((n, c))), 0)
                                            for c in chosen), ends[n], n)))
        holders[key] = chosen
        for n in chosen:
            reads[(key[0], n)] = reads.get((key[0], n), 0.0) + share
            free_disk[n] -= sizes[key]
        for i, a in enumerate(sorted(chosen)):
            for b in sorted(chosen)[i + 1:]:
                shared[(key[0], a, b)] = shared.get((key[0], a, b), 0) + 1
    for key in order:  # hottest first: replicas where memory is left over
        for n in names:
            if n not in holders[key] and sizes[key] <= min(room[n], free_disk[n]):
                holders[key].append(n)
                room[n] -= sizes[key]
                free_disk[n] -= sizes[key]
    return {key: tuple(sorted(h)) for key, h in sorted(holders.items())}



# ---------------------------------------------------------------------------------------
# What a streamed placement does: each member's hot set and cold reads, its drives' balance


def member_hot_sets(
    holders: Mapping[ExpertKey, Sequence[str]],
    memory: Mapping[str, int],
    sizes: Mapping[ExpertKey, int],
    heat: Mapping[ExpertKey, float],
    *,
    top_k: int,
) -> dict[str, frozenset[ExpertKey]]:
    """What each member keeps in memory once warm: the experts it holds with the highest
    selection odds per byte, while they fit its memory (the rule plan_streaming fills memory
    by, and the steady state of a heat-ranked cache)."""
    odds = selection_odds({key: heat.get(key, 0.0) for key in sizes}, top_k)
    held: dict[str, list[ExpertKey]] = {name: [] for name in memory}
    for key, names in holders.items():
        for name in names:
            held.setdefault(name, []).append(key)
    hot: dict[str, frozenset[ExpertKey]] = {}
    for name, keys in held.items():
        room, chosen = memory.get(name, 0), set()
        for key in sorted(keys, key=lambda k: (-odds[k] / max(sizes[k], 1), k)):
            if sizes[key] <= room:
                chosen.add(key)
                room -= sizes[key]
        hot[name] = frozenset(chosen)
    return hot


def cold_reads(
    holders: Mapping[ExpertKey, Sequence[str]],
    memory: Mapping[str, int],
    sizes: Mapping[ExpertKey, int],
    heat: Mapping[ExpertKey, float],
    *,
    top_k: int,
) -> dict[int, dict[str, float]]:
    """Expected bytes each member reads from its drive per token, by layer: the selection
    odds times the size of every expert no holder keeps in memory, split over its holders."""
    odds = selection_odds({key: heat.get(key, 0.0) for key in sizes}, top_k)
    hot = member_hot_sets(holders, memory, sizes, heat, top_k=top_k)
    reads: dict[int, dict[str, float]] = {}
    for key, names in sorted(holders.items()):
        layer = reads.setdefault(key[0], dict.fromkeys(memory, 0.0))
        if not names or any(key in hot.get(n, ()) for n in names):
            continue
        for name in names:
            layer[name] = layer.get(name, 0.0) + odds[key] * sizes[key] / len(names)
    return reads


def read_imbalance(
    holders: Mapping[ExpertKey, Sequence[str]],
    memory: Mapping[str, int],
    read_bps: Mapping[str, float],
    sizes: Mapping[ExpertKey, int],
    heat: Mapping[ExpertKey, float],
    *,
    top_k: int,
) -> float:
    """The drives' time per token of this placement over the ideal one, summed over layers:
    each layer waits for its busiest drive (expected cold bytes / read speed), where ideally
    the cluster's memory holds the experts with the highest odds per byte and the rest are
    read by all drives at once, each in proportion to its speed. 1.0 is the ideal; placements
    of one model on one cluster compare by it (`shoal rebalance` for a streamed model)."""
    if any(read_bps.get(n, 0) <= 0 for n in memory):
        raise InvalidInput("every member needs a drive read speed above 0")
    odds = selection_odds({key: heat.get(key, 0.0) for key in sizes}, top_k)
    room = sum(memory.values())
    ideal: dict[int, float] = {}
    for key in sorted(sizes, key=lambda k: (-odds[k] / max(sizes[k], 1), k)):
        if sizes[key] <= room:
            room -= sizes[key]
        else:
            ideal[key[0]] = ideal.get(key[0], 0.0) + odds[key] * sizes[key]
    best = sum(ideal.values()) / sum(read_bps[n] for n in memory)
    reads = cold_reads(holders, memory, sizes, heat, top_k=top_k)
    actual = sum(max((b / read_bps[n] for n, b in layer.items()), default=0.0)
                 for layer in reads.values())
    return actual / best if best > 0 else 1.0
