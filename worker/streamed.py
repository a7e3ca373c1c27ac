"""A streamed request's compute: its experts taken from a lease as their reads complete and
run by the layer's mlx-lm switch module, over the cache's slots in one gathered call a round
(`over_slots`), or, where the experts differ in shape, one expert at a time (`one_by_one`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import mlx.core as mx
import numpy as np

from engine.experts import ExpertRunner
from worker.cache import ExpertCache
from worker.lease import Lease
from worker.slots import SlotPool


class Turn:
    """Holds the lock for one request's MLX work, its wait for the lock added to `waited`."""

    def __init__(self, lock: threading.Lock, timing) -> None:
        self._lock, self._timing = lock, timing

    def __enter__(self) -> None:
        before = time.perf_counter()
        self._lock.acquire()
        self._timing.waited += time.perf_counter() - before

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _take(lease: Lease, timing) -> list[int]:
    before = time.perf_counter()
    ready = lease.take()
    timing.reads += time.perf_counter() - before
    return ready


def over_slots(
    runner: ExpertRunner, pool: SlotPool, cache: ExpertCache, lease: Lease,
    hidden: np.ndarray | mx.array, dtype: mx.Dtype, rows: np.ndarray, inverse: np.ndarray,
    call_pairs: int, turn: Callable[[], AbstractContextManager], timing,
) -> mx.array:
    """Each round: the experts whose reads are done are copied into their slots,
    then every pair of theirs runs in one gathered call, with slot numbers for expert numbers.
    A request whose experts are all resident is one round: the resident path's call."""
    distinct = int(inverse.max()) + 1
    slots = np.full(distinct, -1, dtype=np.int32)
    parts: list[mx.array] = []
    picked: list[np.ndarray] = []
    while True:
        ready = np.array(_take(lease, timing), dtype=np.int64)
        with turn():
            cache.install(pool.put, lease, ready.tolist())
            slots[ready] = lease.slots(ready)
            every = not parts and ready.size == distinct
            pairs = None if every else np.flatnonzero(np.isin(inverse, ready))
            out = runner.gathered(pool.params, hidden, dtype,
                                  rows if every else rows[pairs],
                                  slots[inverse] if every else slots[inverse[pairs]],
                                  call_pairs)
            before = time.perf_counter()
            mx.eval(out)
            timing.matrix += time.perf_counter() - before
        lease.done(ready.tolist())
        if every:
            return out
        parts.append(out)
        picked.append(pairs)
        if (slots >= 0).all():
            order = np.argsort(np.concatenate(picked)).astype(np.int32)
            with turn():
                return mx.concatenate(parts)[mx.array(order)]


def all_in_slots(lease: Lease, cache: ExpertCache, pool: SlotPool, lock: threading.Lock,
                 distinct: int, timing) -> np.ndarray:
    """Wait for every expert of the lease (`timing.reads`) and copy each into its slot as it
    arrives (under the MLX lock); their slots, by position."""
    slots = np.full(distinct, -1, dtype=np.int32)
    while (slots < 0).any():
        ready = np.array(_take(lease, timing), dtype=np.int64)
        with lock:
            cache.install(pool.put, lease, ready.tolist())
            slots[ready] = lease.slots(ready)
    return slots


def one_by_one(
    runner: ExpertRunner, lease: Lease, hidden: mx.array, rows: np.ndarray,
    inverse: np.ndarray, counts: np.ndarray, turn: Callable[[], AbstractContextManager], timing,
) -> mx.array:
    """Run each distinct expert on its rows as its tensors become ready, then put the outputs
    back in request order. When every expert is ready at once, the request is evaluated once."""
    order = np.argsort(inverse, kind="stable")
    grouped = rows[order]  # each expert's rows, experts in ascending order
    sizes = counts.tolist()
    ends = np.cumsum(counts).tolist()
    one_row = hidden.shape[0] == 1  # a decode step: every pair's row is row 0
    parts: list[mx.array | None] = [None] * counts.size
    remaining = counts.size
    ready = _take(lease, timing)
    while True:
        last = len(ready) == remaining
        with turn():
            for pos in ready:
                x = hidden if one_row and sizes[pos] == 1 else \
                    hidden[mx.array(grouped[ends[pos] - sizes[pos]:ends[pos]])]
                parts[pos] = runner(lease.tensors(pos), x)
            if last:  # the outputs back in request order
                out = mx.concatenate(parts)[mx.array(np.argsort(order).astype(np.int32))]
            before = time.perf_counter()
            mx.eval(out if last else [parts[pos] for pos in ready])
            timing.matrix += time.perf_counter() - before
        lease.done(ready)
        remaining -= len(ready)
        if not remaining:
            return out
        ready = _take(lease, timing)
