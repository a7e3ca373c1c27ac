"""The streaming expert cache: which experts are in memory under the worker's budget, the reads
that bring the others (checked by `worker/read_checks.py`), and the leases requests hold on them
(`worker/lease.py`); which stay is `engine/cache_policy.py`'s decision."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.cache_policy import (
    ADMIT_HALF_LIFE_PASSES,
    PIN_SHARE,
    Heat,
    admit,
    choose_victims,
    pinned,
)
from engine.errors import ShoalError, Unavailable
from engine.manifest import ExpertFile, ExpertKey
from worker.lease import Lease
from worker.read_checks import ReadChecks
from worker.reader import ReaderPool, ReadJob

WAIT_SECONDS = 600.0  # a demand read that takes longer than this is reported as a failure

_ABSENT, _LOADING, _READY = 0, 1, 2


@dataclass
class CacheCounters:
    """Counts since the worker started; `demands` counts each distinct expert of a request."""

    passes: int = 0  # forward passes seen (a request whose layer is not above the last one's)
    tokens: int = 0  # (token, expert) pairs computed
    demands: int = 0
    hits: int = 0  # resident when asked for
    misses: int = 0  # had to wait for a read
    prefetch_hits: int = 0  # hits thanks to a prefetch
    prefetch_late: int = 0  # misses whose read a prefetch had already started
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_cancelled: int = 0  # stale hints dropped before their read started
    prefetch_wasted: int = 0  # read by a prefetch, evicted without being asked for
    loads: int = 0  # expert files read from a drive
    evictions: int = 0


class _Entry:
    __slots__ = ("index", "state", "tensors", "job", "error", "slot")

    def __init__(self, index: int, slot: int) -> None:
        self.index = index
        self.state = _LOADING
        self.slot = slot  # its place in the SlotPool, -1 without one
        # decoded by the reader; None once copied into its slot
        self.tensors: dict[str, mx.array] | None = None
        self.job: ReadJob | None = None
        self.error: ShoalError | None = None


class ExpertCache:
    """Decoded experts in memory, at most `capacity` bytes; loads go through the reader pool.

    One lock guards the state; numpy arrays indexed by expert number mirror it so that the
    eviction policy runs vectorised. Reader threads finish loads through `_loaded`.
    """

    def __init__(
        self,
        keys: list[ExpertKey],
        sizes: np.ndarray,
        copies: dict[ExpertKey, list[tuple[int, Path]]],
        capacity: int,
        reader: ReaderPool,
        decode: Callable[[ExpertKey, memoryview], dict[str, mx.array]],
        *,
        checks: Mapping[ExpertKey, ExpertFile] | None,
        report: Callable[[str], None],
        on_lost: Callable[[ExpertKey, str], None] = lambda key, why: None,
        slot_bytes: int = 0,
        admission: bool = True,
    ) -> None:
        self.keys = keys
        self.index = {key: i for i, key in enumerate(keys)}
        self._file_sizes = sizes  # what a read reads
        # what an expert takes of the budget: with a SlotPool (`slot_bytes`), one slot each
        self._slot_bytes = slot_bytes
        self.sizes = np.full_like(sizes, slot_bytes) if slot_bytes else sizes
        self.capacity = capacity
        self._copies = copies
        self._reader = reader
        self._checks = ReadChecks(checks, decode, self.copies, self.lose_copy)
        self._report, self._on_lost = report, on_lost
        n = len(keys)
        self._state = np.zeros(n, dtype=np.int8)
        self._users = np.zeros(n, dtype=np.int32)
        self._speculative = np.zeros(n, dtype=bool)  # loaded by a prefetch, not yet asked for
        self._last_used = np.zeros(n, dtype=np.int64)
        self._entries: dict[int, _Entry] = {}
        self._tables: dict[int, np.ndarray] = {}  # layer -> expert number -> index, or -1
        # with a SlotPool (every expert one slot): the slots no entry holds
        slots = capacity // slot_bytes if slot_bytes else 0
        self._free_slots = list(range(slots - 1, -1, -1))
        self._used, self._uses, self._last_layer = 0, 0, sys.maxsize
        self.heat = Heat(n)
        # admission: reads not admitted go first, the kept go by long-window routing (`admit`)
        self.admission, self.frequency = admission, Heat(n, ADMIT_HALF_LIFE_PASSES)
        self._probation = np.zeros(n, dtype=bool)
        self.counters = CacheCounters()
        self._cond = threading.Condition()

    # -- what is resident -------------------------------------------------------------

    def resident_bytes(self) -> tuple[int, int]:
        with self._cond:
            ready = self._state == _READY
            return int(self.sizes[ready].sum()), int(ready.sum())

    def snapshot_counters(self) -> CacheCounters:
        with self._cond:
            return CacheCounters(**vars(self.counters))

    def warm(self, order: Iterable[int]) -> None:
        """Load experts in `order` while they fit, without evicting any; wait for them."""
        with self._cond:
            for i in order:
                if self._used + self.sizes[i] <= self.capacity and self._state[i] == _ABSENT:
                    self._used += int(self.sizes[i])
                    self._load(i, demand=True)
            while (self._state == _LOADING).any():
                self._cond.wait()

    def ready_tensors(self, keys: list[ExpertKey]) -> list[dict[str, mx.array]] | None:
        """The decoded tensors of `keys` if every one is in memory now, else None."""
        with self._cond:
            idx = [self.index[key] for key in keys]
            if not all(self._state[i] == _READY and self._entries[i].tensors is not None
                       for i in idx):
                return None  # not all read, or some only in their slots
            return [self._entries[i].tensors for i in idx]

    def add(self, key: ExpertKey, size: int, copies: list[tuple[int, Path]]) -> None:
        """Serve one more expert (a file just received); it starts on the drives."""
        with self._cond:
            if key not in self.index:
                self._tables.pop(key[0], None)
                self.index[key] = len(self.keys)
                self.keys.append(key)
                self._file_sizes = np.concatenate([self._file_sizes, np.array([size], np.int64)])
                room = self._slot_bytes or size
                self.sizes = np.concatenate([self.sizes, np.array([room], dtype=np.int64)])
                for name in ("_state", "_users", "_speculative", "_probation", "_last_used"):
                    now = getattr(self, name)
                    setattr(self, name, np.concatenate([now, np.zeros(1, dtype=now.dtype)]))
                self.heat.grow(1)
                self.frequency.grow(1)
            self._copies[key] = list(copies)

    def copies(self, key: ExpertKey) -> list[tuple[int, Path]]:
        """The (drive, path) of the expert's files still trusted: what reads and sends use."""
        with self._cond:
            return list(self._copies.get(key, ()))

    def lose_copy(self, key: ExpertKey, path: Path, why: str) -> int:
        """Stop using one file of an expert (it rotted or cannot be read): report it, and when
        no intact file of the expert is left, give the expert up (`on_lost`). Returns the
        number of its files still trusted. Reads, the scrub and transfers all end here."""
        with self._cond:
            before = self._copies.get(key, [])
            left = [c for c in before if c[1] != path]
            self._copies[key] = left
            dropped = len(left) < len(before)
        if dropped:
            self._report(f"{path}: {why}; not served")
            if not left:
                self._on_lost(key, why)
        return len(left)

    def discard(self, key: ExpertKey) -> list[tuple[int, Path]]:
        """Stop serving an expert whose files are about to be deleted: forget its copies and,
        unless a request is using it right now, its memory. Returns the copies it had."""
        with self._cond:
            i = self.index.get(key)
            if i is None:
                return []
            copies, self._copies[key] = self._copies[key], []
            if self._state[i] == _READY and self._users[i] == 0:
                self._forget(i)
            return copies

    # -- demand ---------------------------------------------------------------------

    def count_resident(self, layer: int, distinct: int, pairs: int) -> None:
        """Count a request served from stacked, resident experts: every one a hit."""
        with self._cond:
            c = self.counters
            if layer <= self._last_layer:
                c.passes += 1
            self._last_layer = layer
            c.tokens += pairs
            c.demands += distinct
            c.hits += distinct

    def demand(self, layer: int, experts: np.ndarray, tokens: np.ndarray) -> Lease:
        """Ask for a request's distinct experts; returns a lease to take them as they are ready."""
        with self._cond:
            idx = self._indices(layer, experts)
            if layer <= self._last_layer:
                self.counters.passes += 1
                self.heat.advance()
                self.frequency.advance()
            self._last_layer = layer
            self.heat.add(idx, tokens)
            self.frequency.add(idx, tokens)
            self.counters.tokens += int(tokens.sum())
            self._cancel_stale(layer, set(idx.tolist()))
            self._uses += 1
            self._last_used[idx] = self._uses
            lease = Lease(self, idx)
            self._count_demand(lease, idx)
            self._start_pending(lease)
        return lease

    def _indices(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """The cache's numbers of a layer's experts, by a table per layer built once."""
        table = self._tables.get(layer)
        if table is None:
            mine = [(e, i) for (lay, e), i in self.index.items() if lay == layer]
            table = self._tables[layer] = np.full(max(e for e, _ in mine) + 1, -1, np.int64)
            for e, i in mine:
                table[e] = i
        idx = table[np.minimum(experts, table.size - 1)]
        if (idx < 0).any() or (experts >= table.size).any():
            raise KeyError(f"layer {layer} holds no expert among {experts.tolist()}")
        return idx

    def _count_demand(self, lease: Lease, idx: np.ndarray) -> None:
        """A request's distinct experts, counted as hits or misses over the state arrays at
        once; the lease holds those resident or being read, and waits for room for the rest."""
        state, guessed = self._state[idx], self._speculative[idx]
        ready, absent = state == _READY, state == _ABSENT
        late = guessed & (state == _LOADING)
        c = self.counters
        c.demands += idx.size
        c.hits += int(ready.sum())
        c.misses += idx.size - int(ready.sum())
        c.prefetch_used += int(guessed.sum())
        c.prefetch_hits += int((guessed & ready).sum())
        c.prefetch_late += int(late.sum())
        held = np.flatnonzero(~absent)
        present = idx[held]
        self._speculative[present] = False
        if self.admission:  # on probation and asked for again: judged again
            again = present[self._probation[present]]
            kept = (self._state == _READY) & ~self._probation
            self._probation[again] = ~admit(self.frequency.values(), again, kept)
        self._users[present] += 1
        lease.held = {pos: self._entries[i] for pos, i in
                      zip(held.tolist(), present.tolist(), strict=True)}
        lease.pending = np.flatnonzero(absent).tolist()
        for i in idx[late].tolist():
            self._reader.promote(self._entries[i].job)

    def _start_pending(self, lease: Lease) -> None:
        while lease.pending:
            pos = lease.pending[0]
            i = int(lease.idx[pos])
            if self._state[i] != _ABSENT:  # another request started it meanwhile
                self._users[i] += 1
                lease.held[pos] = self._entries[i]
                lease.pending.pop(0)
                continue
            if not self._reserve(i, demand=True):
                return
            lease.pending.pop(0)
            self._users[i] += 1
            lease.held[pos] = self._load(i, demand=True)

    # -- what a Lease calls --------------------------------------------------------------

    def take(self, lease: Lease) -> list[int]:
        """Block until some of the lease's experts are ready; their positions not yet taken."""
        with self._cond:
            waited = 0.0
            while True:
                failed = [e.error for e in lease.held.values() if e.error is not None]
                # the lease's other reads in flight finish first, so that one retry of the
                # request learns of every expert of it lost meanwhile, not of one at a time
                if failed and not any(e.state == _LOADING for e in lease.held.values()):
                    raise failed[0]
                ready = [] if failed else [pos for pos, e in lease.held.items()
                                           if e.state == _READY and not lease.taken[pos]]
                if ready:
                    for pos in ready:
                        lease.taken[pos] = True
                    return ready
                self._start_pending(lease)
                if not self._cond.wait(timeout=5.0):
                    waited += 5.0
                    if waited >= WAIT_SECONDS:
                        raise Unavailable(
                            f"expert reads made no progress for {WAIT_SECONDS:.0f} s")

    def install(self, put: Callable[[int, dict[str, mx.array]], None],
                lease: Lease | None = None, positions: Iterable[int] = ()) -> None:
        """Copy the lease's experts at `positions` (without a lease: every expert read) that
        are not yet in their slots into them (`put`, the SlotPool's), and let go of their
        decoded tensors; a prefetched expert stays as read until it is asked for. The caller
        holds the MLX lock."""
        with self._cond:
            entries = ([lease.held[pos] for pos in positions] if lease is not None
                       else list(self._entries.values()))
            for entry in entries:
                if entry.tensors is not None and self._entries.get(entry.index) is entry:
                    put(entry.slot, entry.tensors)
                    entry.tensors = None

    def give_back(self, lease: Lease, positions: Iterable[int]) -> None:
        """The lease is done with the experts at `positions`; start loads it still waits for."""
        with self._cond:
            for pos in positions:
                self._done(lease, pos)
            self._start_pending(lease)

    def end(self, lease: Lease) -> None:
        """The lease lets go of everything it holds, and of the loads it waits for."""
        with self._cond:
            for pos in list(lease.held):
                self._done(lease, pos)
            lease.pending.clear()

    def _done(self, lease: Lease, pos: int) -> None:
        entry = lease.held.pop(pos, None)
        if entry is not None and self._entries.get(entry.index) is entry:
            self._users[entry.index] -= 1
        self._cond.notify_all()

    # -- prefetch -------------------------------------------------------------------

    def prefetch(self, layer: int, experts: Iterable[int]) -> None:
        """Start reading experts that a hint says will be asked for soon, if there is room
        that no pinned, in-use or earlier-prefetched expert occupies. Never blocks."""
        with self._cond:
            for expert in experts:
                i = self.index.get((layer, expert))
                if i is None or self._state[i] != _ABSENT:
                    continue
                if not self._reserve(i, demand=False):
                    return
                self._speculative[i] = True
                self._probation[i] = self.admission  # a guess is judged when asked for
                self.counters.prefetch_issued += 1
                self._load(i, demand=False)

    def _cancel_stale(self, layer: int, demanded: set[int]) -> None:
        """Drop queued prefetches of this layer that it did not ask for, and of earlier layers."""
        for i in np.flatnonzero(self._speculative & (self._state == _LOADING)).tolist():
            if self.keys[i][0] > layer or i in demanded:
                continue
            entry = self._entries[i]
            if self._reader.cancel(entry.job):
                self._forget(i)
                self.counters.prefetch_cancelled += 1

    # -- loading and evicting (with the lock held) ------------------------------------------

    def _reserve(self, i: int, *, demand: bool) -> bool:
        need = self._used + int(self.sizes[i]) - self.capacity
        if need > 0:
            heat = self.heat.values()
            ready = self._state == _READY
            pins = pinned(heat, self.sizes, ready, int(PIN_SHARE * self.capacity))
            rank = self.frequency.values() if self.admission else heat
            evictable = ready & (self._users == 0)
            if not demand:
                evictable &= ~pins & ~self._speculative
            if demand and self.admission:
                self._probation[i] = not admit(rank, [i], ready & ~self._probation & ~pins)[0]
            order = (rank, self._last_used, self.sizes, evictable, pins)
            victims = choose_victims(*order, need, self._probation)
            if victims is None and demand:
                self._cancel_stale(sys.maxsize, set())  # queued guesses give way to demand
                need = self._used + int(self.sizes[i]) - self.capacity
                victims = choose_victims(*order, need, self._probation)
            if victims is None:
                return False
            for v in victims.tolist():
                if self._speculative[v]:
                    self.counters.prefetch_wasted += 1
                self._forget(v)
                self.counters.evictions += 1
        self._used += int(self.sizes[i])
        return True

    def _load(self, i: int, *, demand: bool) -> _Entry:
        entry = _Entry(i, self._free_slots.pop() if self._free_slots else -1)
        self._entries[i] = entry
        self._state[i] = _LOADING
        key = self.keys[i]
        entry.job = self._reader.submit(
            key, int(self._file_sizes[i]), self._copies[key], demand=demand, on_done=self._loaded,
            digest=self._checks.digest(key),
        )
        return entry

    def _forget(self, i: int) -> None:
        entry = self._entries.pop(i)
        if entry.slot >= 0:
            self._free_slots.append(entry.slot)
        entry.state = _ABSENT
        entry.tensors = None
        self._state[i] = _ABSENT
        self._speculative[i] = False
        self._probation[i] = False
        self._users[i] = 0  # leases holding a failed entry see its error, not a count
        self._used -= int(self.sizes[i])

    def _loaded(self, job: ReadJob) -> None:
        """On a reader thread: check and decode a finished read, then publish it."""
        tensors, error = None, None
        try:
            tensors = self._checks.check_and_decode(job)
        except ShoalError as e:
            error = e
        finally:
            self._reader.release(job)
        with self._cond:
            i = self.index[job.key]
            entry = self._entries.get(i)
            if entry is None or entry.job is not job:
                return  # cancelled meanwhile
            self.counters.loads += error is None
            if error is None:
                entry.tensors = tensors
                entry.state = _READY
                self._state[i] = _READY
            else:
                entry.error = error
                self._forget(i)
            self._cond.notify_all()
        if error is not None:
            self._report(str(error))
