"""Pure placement for a model larger than the members' memory: each member's hot set fits its
memory, cold experts go where their expected reads finish soonest, hot experts get replicas
in memory left over."""

from __future__ import annotations

from collections.abc import Mapping

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
) -> dict[ExpertKey, tuple[str, ...]]:
    """Holders of each expert when the experts outgrow the members' memory (member -> bytes).

    The experts with the highest selection odds per byte fill the members' memory together:
    each such hot expert goes to the member with room whose layer carries the fewest expected
    uses so far. Every other (cold) expert is read from a drive when chosen: it goes to the
    member whose expected read time in that layer, bytes / read speed, would end lowest, since
    each layer waits for its slowest drive. Memory a member has left that no cold expert
    could fill takes replicas of the hottest experts it lacks. Deterministic: ties go by name.
    """
    names = sorted(memory)
    if not names:
        raise InvalidInput("a placement needs at least one member")
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
    for key in sorted(cold, key=lambda k: (-odds[k] * sizes[k], k)):
        fits = [n for n in names if sizes[key] <= free_disk[n]]
        if not fits:
            raise InvalidInput(
                f"expert {key[0]}/{key[1]} ({sizes[key] / 2**20:.1f} MiB) fits on no member's "
                "disk: the cluster's disks cannot hold the model")

        def finish(n: str, key: ExpertKey = key) -> tuple[float, str]:
            return (reads.get((key[0], n), 0.0) + odds[key] * sizes[key]) / read_bps[n], n

        chosen = min(fits, key=finish)
        holders[key] = [chosen]
        reads[(key[0], chosen)] = reads.get((key[0], chosen), 0.0) + odds[key] * sizes[key]
        free_disk[chosen] -= sizes[key]
    for key in order:  # hottest first: replicas where memory is left over
        for n in names:
            if n not in holders[key] and sizes[key] <= min(room[n], free_disk[n]):
                holders[key].append(n)
                room[n] -= sizes[key]
                free_disk[n] -= sizes[key]
    return {key: tuple(sorted(h)) for key, h in sorted(holders.items())}

