"""Pure planning of `shoal deploy` and `shoal rebalance`: from what the live workers report to
the target placement (engine/placement.py), the steps that reach it (engine/migration.py) and
the executor's small decisions between steps, so tests call them without a network."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from engine.errors import InvalidInput
from engine.manifest import ExpertKey
from engine.migration import (
    DRAINING,
    LOCAL,
    SERVING,
    MigrationPlan,
    State,
    Step,
    holders_of,
    limit_moves,
    plan_migration,
)
from engine.placement import WorkerCapacity, imbalance, plan_placement
from engine.stream_placement import read_imbalance

STICKINESS = 0.1  # keep an expert where it is unless that costs 10% of a fair share of load
MIN_GAIN = 0.02  # a rebalance that lowers the predicted imbalance by less than 2% is not run
# Nor one whose gain does not pay for its bytes: the relative drop in imbalance must exceed
# MIN_GAIN by this times the share of the experts' bytes copied (copying 30% of them needs a
# 12% drop), so a plan made just after a rebalance, from a little more heat, does not move
# experts back and forth for noise.
GAIN_PER_MOVED = 1 / 3
NO_BUDGET = 1 << 62  # the memory of a worker that reports no budget: ample


@dataclass(frozen=True)
class LiveWorker:
    """What one live worker reported: the copies it serves and drains, its memory budget for
    experts (0: none set) and its free disk, in bytes; its drive's read speed (GB/s) where
    measured, which placement for streaming weighs."""

    name: str
    serving: frozenset[ExpertKey]
    draining: frozenset[ExpertKey] = frozenset()
    memory_budget: int = 0
    free_disk: int = 0
    read_gbps: float | None = None


def state_of(
    workers: Sequence[LiveWorker], experts: Iterable[ExpertKey], local: Iterable[ExpertKey]
) -> dict[ExpertKey, dict[str, str]]:
    """Which worker serves or drains each of the model's `experts`, and which of them are in
    the coordinator's own files (`local`, as LOCAL)."""
    state: dict[ExpertKey, dict[str, str]] = {key: {} for key in experts}
    for w in workers:
        for key in w.serving:
            state[key][w.name] = SERVING
        for key in w.draining:
            state[key][w.name] = DRAINING
    for key in local:
        state[key][LOCAL] = SERVING
    return state


# A drive's measured rate counts once it has been busy this long (a few reads say little).
MEASURED_SECONDS = 1.0


def drive_rate(drives: Iterable[tuple[int, float]]) -> float | None:
    """A worker's read speed in GB/s from its drives' counters (bytes read, seconds busy):
    the sum of each drive's rate while busy; None before MEASURED_SECONDS of reading."""
    rates = [nbytes / busy for nbytes, busy in drives if busy >= MEASURED_SECONDS]
    return sum(rates) / 1e9 if rates else None


def with_members(
    workers: Sequence[LiveWorker], members: Sequence[WorkerCapacity],
    aliases: Mapping[str, str] | None = None,
) -> list[LiveWorker]:
    """The live workers with what the user says of them (`--member`, a cluster config's
    memory_budget and read_speed), matched by name or by an alias (its address): a given
    memory budget or read speed takes the place of the reported or measured one."""
    given = {m.name: m for m in members}
    known = {w.name for w in workers} | set((aliases or {}).values())
    unknown = sorted(set(given) - known - set(aliases or {}))
    if unknown:
        raise InvalidInput(f"no live worker is named {', '.join(unknown)} (members are named "
                           "by node id or address: `shoal workers` lists them)")
    by_worker = {(aliases or {}).get(name, name): m for name, m in given.items()}
    return [replace(w, memory_budget=by_worker[w.name].memory or w.memory_budget,
                    read_gbps=by_worker[w.name].read_gbps or w.read_gbps)
            if w.name in by_worker else w for w in workers]


def capacities(
    workers: Sequence[LiveWorker], sizes: Mapping[ExpertKey, int]
) -> list[WorkerCapacity]:
    """Memory budget as reported; disk is what is free plus what the worker holds now (a
    copy it gives up frees its room)."""
    out = []
    for w in workers:
        held = sum(sizes[key] for key in w.serving | w.draining)
        out.append(WorkerCapacity(w.name, w.memory_budget or NO_BUDGET, w.free_disk + held,
                                  w.read_gbps))
    return out


@dataclass(frozen=True)
class Proposal:
    target: dict[ExpertKey, tuple[str, ...]]
    plan: MigrationPlan
    imbalance_now: float | None  # None: some expert is served by no worker yet (a deploy)
    imbalance_after: float
    resumed: bool  # the target of an interrupted run
    # What the imbalance measures: "load" (busiest worker's tokens / mean, per layer) or, for a
    # streamed model, "reads" (busiest drive's time / the ideal's, per layer)
    measure: str = "load"


def propose(
    state: State,
    workers: Sequence[LiveWorker],
    sizes: Mapping[ExpertKey, int],
    heat: Mapping[ExpertKey, float] | None,
    *,
    stored: Mapping[ExpertKey, Sequence[str]] | None = None,
    spare: float = 0.1,
    max_bytes: int | None = None,
    deploy: bool = False,
    top_k: int | None = None,
    drive_copies: int = 1,
) -> Proposal:
    """The target placement and the steps to it. An interrupted run's `stored` target is taken
    up again while every worker it names is live. A deploy leaves a cluster that already
    serves every expert as it is; a rebalance whose whole move is not worth the bytes it
    copies (`worth_moving`) runs its most useful part that is (`cheaper_target`), else none.
    Without heat (or with none counted yet) every expert weighs the same.

    Every worker with room for an expert counts, the ones holding nothing too (just added:
    idle, so the others carry more than their share); one with no room (a full disk) is
    neither a target nor counted. With `top_k` and every worker's read speed, a model larger
    than their memory is placed for streaming (engine/stream_placement.py), each cold expert
    on `drive_copies` drives."""
    live = {w.name for w in workers}
    current = holders_of(state)
    placed = all(current.values())
    weights = dict(heat) if heat and any(heat.values()) else dict.fromkeys(sizes, 1.0)
    smallest = min(sizes.values(), default=0)
    able = [c for c in capacities(workers, sizes) if (c.disk or 0) >= smallest]
    counted = [c.name for c in able]
    resumed = bool(stored) and set(stored) == set(sizes) and all(
        set(names) <= live for names in stored.values())
    if resumed:
        target = {key: tuple(names) for key, names in stored.items()}
    else:
        if not able:
            raise InvalidInput("no live worker has free disk for even one expert")
        placement = plan_placement(able, sizes, weights, spare=spare, current=current,
                                   stickiness=STICKINESS, top_k=top_k,
                                   drive_copies=drive_copies)
        target = dict(placement.holders)
        if max_bytes is not None and placed:
            target = limit_moves(current, target, sizes, weights, max_bytes)
    streamed = streaming_measure(able, sizes, weights, spare=spare, top_k=top_k)
    measure = streamed or (lambda holders: imbalance(holders, weights, counted))
    now = measure(current) if placed else None
    after = measure(target)
    # A worker just added (holding nothing) was added to be used: its share is worth any bytes.
    joined = any(not (w.serving | w.draining) for w in workers if w.name in counted)
    moved = 0 if joined else copied_bytes(current, target, sizes)
    total = sum(sizes.values())
    if not resumed and now is not None and not deploy and not worth_moving(now, after, moved,
                                                                           total):
        # The whole move is not worth its bytes: its most useful part may be.
        target, after = cheaper_target(current, target, sizes, weights, measure, now, moved)
    elif not resumed and now is not None and deploy:
        target, after = dict(current), now
    order = sorted(target, key=lambda k: (-weights.get(k, 0.0), k))
    room = {w.name: w.free_disk for w in workers}
    plan = plan_migration(state, target, sizes, room=room, order=order)
    return Proposal(target, plan, now, after, resumed, "reads" if streamed else "load")


def streaming_measure(
    able: Sequence[WorkerCapacity], sizes: Mapping[ExpertKey, int],
    weights: Mapping[ExpertKey, float], *, spare: float, top_k: int | None,
) -> Callable[[Mapping[ExpertKey, Sequence[str]]], float] | None:
    """How a placement is judged when the model streams (top_k and every read speed known,
    the experts beyond the workers' memory): by its drives' time per token over the ideal
    (engine/stream_placement.py: read_imbalance), not by tokens per worker, since a faster
    drive is meant to carry more. None when the model is resident or a speed is unknown."""
    if not top_k or not able or not all(c.read_gbps for c in able):
        return None
    memory = {c.name: min(int(c.memory * (1 - spare)), c.disk or NO_BUDGET) for c in able}
    if sum(memory.values()) >= sum(sizes.values()):
        return None
    speeds = {c.name: c.read_gbps * 1e9 for c in able}
    return lambda holders: read_imbalance(holders, memory, speeds, sizes, weights, top_k=top_k)


def cheaper_target(
    current: Mapping[ExpertKey, Sequence[str]], target: Mapping[ExpertKey, Sequence[str]],
    sizes: Mapping[ExpertKey, int], weights: Mapping[ExpertKey, float],
    measure: Callable[[Mapping[ExpertKey, Sequence[str]]], float], now: float, moved: int,
) -> tuple[dict[ExpertKey, tuple[str, ...]], float]:
    """The hottest moves of `target` within half its bytes, then a quarter, and so on
    (engine/migration.py: limit_moves), the first worth its bytes with its predicted
    imbalance; else `current` as it is."""
    total, smallest = sum(sizes.values()), min(sizes.values(), default=0)
    budget = moved // 2
    while smallest and budget >= smallest:
        trial = limit_moves(current, target, sizes, weights, budget)
        after = measure(trial)
        if worth_moving(now, after, copied_bytes(current, trial, sizes), total):
            return trial, after
        budget //= 2
    return {key: tuple(names) for key, names in current.items()}, now


def copied_bytes(
    current: Mapping[ExpertKey, Sequence[str]], target: Mapping[ExpertKey, Sequence[str]],
    sizes: Mapping[ExpertKey, int],
) -> int:
    """Bytes a move from `current` to `target` copies: each new holder gets the whole file."""
    return sum(sizes[key] * len(set(names) - set(current.get(key, ())))
               for key, names in target.items())


def worth_moving(now: float, after: float, moved: int, total: int) -> bool:
    """Whether a rebalance's predicted gain is worth the bytes it copies: the imbalance drops
    by at least MIN_GAIN + GAIN_PER_MOVED x the share of `total` (the experts' bytes) copied."""
    if now <= 0:
        return False
    return (now - after) / now >= MIN_GAIN + GAIN_PER_MOVED * moved / max(total, 1)


# ---------------------------------------------------------------------------------------
# Decisions taken while the steps run


def copy_sources(step: Step, workers: Iterable[str], *, local: bool) -> list[str]:
    """Where to try sending a copy from, in order: the local files when they have the expert
    (`local`), the planned source, then every other worker (one that turns out not to hold the
    expert just says so); never the receiver itself."""
    names = set(workers)
    order = [LOCAL] if local else []
    order += [step.source] if step.source in names else []
    order += sorted(names)
    return [s for s in dict.fromkeys(order) if s != step.worker]


def wait_before_delete(
    quiet: float, idle_seconds: float, drained_at: float | None, now: float, limit: float
) -> float:
    """Seconds to wait before deleting a drained copy: until nobody has asked for it for
    `quiet` seconds (`idle_seconds`: since its worker last computed it) and, if this run
    drained it (at `drained_at`, on the clock of `now`), `quiet` seconds since then; at most
    `limit`. Waiting first means the kept copy is hashed once, just before the deletion,
    rather than at every refused attempt."""
    since_drained = drained_at + quiet - now if drained_at is not None else 0.0
    return min(max(quiet - idle_seconds, since_drained, 0.0), limit)
