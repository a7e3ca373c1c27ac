"""Pure planning of a live migration: from the copies the workers hold now to a target
placement, as ordered steps that never leave an expert without a verified copy."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from engine.errors import InvalidInput
from engine.manifest import ExpertKey

# A copy of an expert on a worker is `serving` (verified and offered), `draining` (verified,
# still computed if asked for, no longer offered) or, inside a plan, `unverified`. LOCAL stands
# for the coordinator's own expert files (`shoal deploy` sends from them): a source, never a
# target. Per expert the steps are: `copy` to each new holder, `verify` it serves, `keep` a
# draining copy the target wants back, `drain` each copy it no longer wants, then `delete` it.
# Plans derive from the state alone, so a migration stopped after any prefix of its steps is
# finished by planning again from what the workers then report.
SERVING, DRAINING, UNVERIFIED = "serving", "draining", "unverified"
LOCAL = "(local files)"
KINDS = ("copy", "verify", "keep", "drain", "delete")

State = Mapping[ExpertKey, Mapping[str, str]]  # expert -> {holder: SERVING | DRAINING | ...}


@dataclass(frozen=True)
class Step:
    kind: str  # one of KINDS
    key: ExpertKey
    worker: str
    source: str | None = None  # copy: the holder the bytes come from (a worker, or LOCAL)
    bytes: int = 0  # copy: the file's size

    def describe(self) -> str:
        layer, expert = self.key
        what = f"expert {layer}/{expert}"
        if self.kind == "copy":
            return f"copy {what} from {self.source} to {self.worker} ({self.bytes} bytes)"
        return f"{self.kind} {what} on {self.worker}"


@dataclass(frozen=True)
class MigrationPlan:
    steps: tuple[Step, ...]
    blocked: dict[ExpertKey, str]  # experts left as they are, and why

    @property
    def copy_bytes(self) -> int:
        return sum(s.bytes for s in self.steps if s.kind == "copy")

    def count(self, kind: str) -> int:
        return sum(s.kind == kind for s in self.steps)


def serving_workers(copies: Mapping[str, str]) -> set[str]:
    return {w for w, s in copies.items() if s == SERVING and w != LOCAL}


def holders_of(state: State) -> dict[ExpertKey, tuple[str, ...]]:
    """The workers serving each expert: what the generating coordinators route to."""
    return {key: tuple(sorted(serving_workers(c))) for key, c in state.items()}


def apply_step(state: State, step: Step) -> dict[ExpertKey, dict[str, str]]:
    """The state after one step; raises InvalidInput when the step's precondition fails."""
    out = {key: dict(copies) for key, copies in state.items()}
    copies = out.setdefault(step.key, {})
    here = copies.get(step.worker)
    others = serving_workers(copies) - {step.worker}
    what = step.describe()
    if step.worker == LOCAL:
        raise InvalidInput(f"{what}: the local files are a source, never changed")
    if step.kind == "copy":
        if copies.get(step.source) not in (SERVING, DRAINING):
            raise InvalidInput(f"{what}: the source holds no verified copy")
        if here is not None:
            raise InvalidInput(f"{what}: the worker already holds it")
        copies[step.worker] = UNVERIFIED
    elif step.kind == "verify":
        if here not in (UNVERIFIED, SERVING):
            raise InvalidInput(f"{what}: nothing was copied there")
        copies[step.worker] = SERVING
    elif step.kind == "keep":
        if here != DRAINING:
            raise InvalidInput(f"{what}: it is not draining there")
        copies[step.worker] = SERVING
    elif step.kind == "drain":
        if here != SERVING:
            raise InvalidInput(f"{what}: it is not served there")
        if not others:
            raise InvalidInput(f"{what}: no other worker serves a verified copy")
        copies[step.worker] = DRAINING
    elif step.kind == "delete":
        if here != DRAINING:
            raise InvalidInput(f"{what}: only a drained copy may be deleted")
        if not others:
            raise InvalidInput(f"{what}: no other worker serves a verified copy")
        del copies[step.worker]
    else:
        raise InvalidInput(f"unknown step {step.kind!r}")
    return out


def invariant_problems(state: State, served_before: Iterable[ExpertKey] = ()) -> list[str]:
    """What breaks the two rules in `state`: experts without a verified copy anywhere, and
    experts in `served_before` that no worker serves any more."""
    problems = []
    for key, copies in sorted(state.items()):
        if not any(s in (SERVING, DRAINING) for s in copies.values()):
            problems.append(f"expert {key[0]}/{key[1]} has no verified copy")
    for key in sorted(served_before):
        if not serving_workers(state.get(key, {})):
            problems.append(f"expert {key[0]}/{key[1]} is served by no worker")
    return problems


# The two rules every list of steps keeps: every expert keeps a verified copy at each step
# (serving or draining on a worker, or LOCAL), so no failure loses an expert; and a copy is
# drained or deleted only while another worker serves a verified one, so a generating
# coordinator always has an owner to route to.
def check_steps(state: State, steps: Sequence[Step]) -> dict[ExpertKey, dict[str, str]]:
    """Apply `steps` one by one, checking each precondition and both rules after every step;
    returns the final state, raises InvalidInput at the first violation."""
    served = {key for key, copies in state.items() if serving_workers(copies)}
    current = {key: dict(copies) for key, copies in state.items()}
    for index, step in enumerate(steps):
        current = apply_step(current, step)
        problems = invariant_problems(current, served)
        if problems:
            raise InvalidInput(f"after step {index + 1} ({step.describe()}): {problems[0]}")
    return current


def plan_migration(
    state: State,
    target: Mapping[ExpertKey, Sequence[str]],
    sizes: Mapping[ExpertKey, int],
    *,
    room: Mapping[str, int | None] | None = None,
    order: Sequence[ExpertKey] | None = None,
) -> MigrationPlan:
    """The steps that turn `state` into `target` (expert -> the workers that should serve it).

    Experts are taken in `order` (default: by key) and grouped in waves that fit `room`
    (free bytes per worker; absent or None: ample): each wave copies and verifies, then drains,
    then deletes, and its deletions make room for the next. Experts that cannot be moved (no
    verified copy to send, or no room) are left as they are and listed in `blocked`.
    """
    missing = sorted(k for k, names in target.items() if not names)
    if missing:
        raise InvalidInput(f"the target places expert {missing[0][0]}/{missing[0][1]} nowhere")
    if LOCAL in {w for names in target.values() for w in names}:
        raise InvalidInput("the target cannot name the local files as a holder")
    keys = list(order) if order is not None else sorted(target)
    keys += sorted(set(target) - set(keys))
    free = {w: (None if n is None else int(n)) for w, n in (room or {}).items()}
    blocked: dict[ExpertKey, str] = {}
    pending = []
    for key in keys:
        copies = state.get(key, {})
        want = set(target[key])
        if want == serving_workers(copies) and set(copies) - {LOCAL} == want:
            continue
        if want - set(copies) and not _sources(copies):
            blocked[key] = "no verified copy on a live worker or here to copy from"
            continue
        pending.append(key)

    steps: list[Step] = []
    while pending:
        wave, later = [], []
        for key in pending:
            needs = set(target[key]) - set(state.get(key, {}))
            if all(free.get(w) is None or free[w] >= sizes[key] for w in needs):
                for w in needs:
                    if free.get(w) is not None:
                        free[w] -= sizes[key]
                wave.append(key)
            else:
                later.append(key)
        if not wave:
            for key in later:
                short = sorted(w for w in set(target[key]) - set(state.get(key, {}))
                               if free.get(w) is not None and free[w] < sizes[key])
                blocked[key] = f"not enough free disk on {', '.join(short)}"
            break
        for key in wave:
            steps += _arrivals(key, state.get(key, {}), set(target[key]), sizes[key])
        for key in wave:
            copies = state.get(key, {})
            steps += [Step("drain", key, w) for w in sorted(set(copies) - set(target[key]))
                      if w != LOCAL and copies[w] == SERVING]
        for key in wave:
            copies = state.get(key, {})
            for w in sorted(set(copies) - set(target[key]) - {LOCAL}):
                steps.append(Step("delete", key, w))
                if free.get(w) is not None:
                    free[w] += sizes[key]
        pending = later
    return MigrationPlan(tuple(steps), blocked)


def _sources(copies: Mapping[str, str]) -> list[str]:
    """Where a new copy's bytes can come from, best first: the local files (one network hop
    instead of two), a serving worker, then a draining one (its file is still verified)."""
    local = [LOCAL] if copies.get(LOCAL) in (SERVING, DRAINING) else []
    serving = sorted(serving_workers(copies))
    draining = sorted(w for w, s in copies.items() if s == DRAINING and w != LOCAL)
    return local + serving + draining


def _arrivals(key: ExpertKey, copies: Mapping[str, str], want: set[str], size: int) -> list[Step]:
    steps = []
    source = next(iter(_sources(copies)), None)
    for w in sorted(want):
        state = copies.get(w)
        if state is None:
            steps += [Step("copy", key, w, source, size), Step("verify", key, w)]
        elif state == UNVERIFIED:
            steps.append(Step("verify", key, w))
        elif state == DRAINING:
            steps.append(Step("keep", key, w))
    return steps


def limit_moves(
    current: Mapping[ExpertKey, Sequence[str]],
    target: Mapping[ExpertKey, Sequence[str]],
    sizes: Mapping[ExpertKey, int],
    heat: Mapping[ExpertKey, float],
    max_bytes: int,
) -> dict[ExpertKey, tuple[str, ...]]:
    """A target that copies at most `max_bytes`: experts whose holders change are taken
    hottest first, each only if its copies still fit the budget and it does not make its
    layer's busiest worker busier; the others keep their current holders. Experts no worker
    serves yet are always placed."""
    chosen = {key: tuple(sorted(current.get(key) or target[key])) for key in target}
    loads = _layer_loads(chosen, heat)
    left = max_bytes
    changing = [k for k in target if current.get(k) and set(current[k]) != set(target[k])]
    for key in sorted(changing, key=lambda k: (-heat.get(k, 0.0), k)):
        cost = sizes[key] * len(set(target[key]) - set(current[key]))
        if cost > left:
            continue
        layer = key[0]
        trial = dict(loads[layer])
        share_now = heat.get(key, 0.0) / len(chosen[key])
        share_then = heat.get(key, 0.0) / len(target[key])
        for w in chosen[key]:
            trial[w] -= share_now
        for w in target[key]:
            trial[w] = trial.get(w, 0.0) + share_then
        if max(trial.values()) > max(loads[layer].values()) + 1e-9:
            continue
        loads[layer] = trial
        chosen[key] = tuple(sorted(target[key]))
        left -= cost
    return chosen


def _layer_loads(
    holders: Mapping[ExpertKey, Sequence[str]], heat: Mapping[ExpertKey, float]
) -> dict[int, dict[str, float]]:
    workers = sorted({w for names in holders.values() for w in names})
    loads: dict[int, dict[str, float]] = {}
    for key, names in holders.items():
        layer = loads.setdefault(key[0], dict.fromkeys(workers, 0.0))
        for w in names:
            layer[w] += heat.get(key, 0.0) / len(names)
    return loads
