"""Heat, the tokens routed to each (layer, expert) across the cluster, which placement weighs
experts by: its JSON form (`shoal heat --json`, `shoal plan --heat`) and the heat record that
folds each worker's readings across runs (not the cache's eviction score, cache_policy.Heat)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import CorruptData, InvalidInput, NotFound
from engine.manifest import ExpertKey


def heat_to_json(heat: Mapping[ExpertKey, float]) -> dict[str, dict[str, float]]:
    body: dict[str, dict[str, float]] = {}
    for (layer, expert), count in sorted(heat.items()):
        body.setdefault(str(layer), {})[str(expert)] = count
    return body


def heat_from_json(body: object, *, origin: str) -> dict[ExpertKey, float]:
    if not isinstance(body, dict):
        raise InvalidInput(f"{origin}: expected {{\"<layer>\": {{\"<expert>\": count}}}}")
    heat: dict[ExpertKey, float] = {}
    for layer, experts in body.items():
        if not isinstance(experts, dict):
            raise InvalidInput(f"{origin}: layer {layer!r} must map expert ids to counts")
        for expert, count in experts.items():
            try:
                key = (int(layer), int(expert))
            except ValueError:
                bad = f"{layer!r}/{expert!r}"
                raise InvalidInput(f"{origin}: {bad} is not a layer/expert id") from None
            if not isinstance(count, int | float) or count < 0:
                raise InvalidInput(f"{origin}: count of {key[0]}/{key[1]} must be a number >= 0")
            heat[key] = float(count)
    return heat


def read_heat(path: Path) -> dict[ExpertKey, float]:
    try:
        body = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise NotFound(f"heat file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise CorruptData(f"heat file {path} is not valid JSON ({e})") from None
    return heat_from_json(body, origin=str(path))


def check_heat_matches(heat: Mapping[ExpertKey, float], experts: Mapping[ExpertKey, int]) -> None:
    unknown = sorted(set(heat) - set(experts))
    if unknown:
        layer, expert = unknown[0]
        raise InvalidInput(
            f"the heat names {len(unknown)} expert(s) this model does not have, e.g. "
            f"layer {layer} expert {expert}: is it from another model?"
        )


# ---------------------------------------------------------------------------------------
# Heat recorded across runs: each worker counts since it started, the coordinator folds
# successive readings into totals that survive restarts of either side.


@dataclass(frozen=True)
class WorkerCounts:
    """What one worker has contributed: its counts at the last reading (since its start,
    identified by `boot_id`) and every token it computed that a reading has seen."""

    boot_id: str
    seen: dict[ExpertKey, int]
    total: dict[ExpertKey, int]


@dataclass(frozen=True)
class HeatRecord:
    fingerprint: str
    workers: dict[str, WorkerCounts] = field(default_factory=dict)

    def total(self) -> dict[ExpertKey, int]:
        """Cluster-wide tokens per expert."""
        out: dict[ExpertKey, int] = {}
        for worker in self.workers.values():
            for key, count in worker.total.items():
                out[key] = out.get(key, 0) + count
        return out

    def per_worker(self) -> dict[str, dict[ExpertKey, int]]:
        return {name: dict(w.total) for name, w in sorted(self.workers.items())}


def fold_reading(
    record: HeatRecord, worker: str, boot_id: str, counts: Mapping[ExpertKey, int]
) -> HeatRecord:
    """Add what a worker computed since the previous reading. A new boot id (or a count that
    went down) means the worker restarted: all its counts are new."""
    before = record.workers.get(worker)
    seen = before.seen if before is not None and before.boot_id == boot_id else {}
    if any(counts.get(key, 0) < count for key, count in seen.items()):
        seen = {}
    total = dict(before.total) if before is not None else {}
    for key, count in counts.items():
        new = count - seen.get(key, 0)
        if new > 0:
            total[key] = total.get(key, 0) + new
    workers = {**record.workers, worker: WorkerCounts(boot_id, dict(counts), total)}
    return HeatRecord(record.fingerprint, workers)


def difference(
    after: Mapping[ExpertKey, int], before: Mapping[ExpertKey, int]
) -> dict[ExpertKey, int]:
    """Counts of `after` less those of `before` (one run's share of cumulative counts)."""
    out = {key: count - before.get(key, 0) for key, count in after.items()}
    return {key: count for key, count in out.items() if count > 0}
