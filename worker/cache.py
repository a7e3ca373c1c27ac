"""The streaming expert cache: decoded experts in memory under the worker's budget, the reads
that bring the others from the drives, and the checks every read must pass.

A request leases its distinct experts (`ExpertCache.demand` -> `Lease`) and takes each as its
read completes; prefetch hints start reads early. Which experts stay is decided by
`engine/cache_policy.py` (heat and recency; hot experts pinned). A read whose checksum fails
is retried copy by copy (`_find_good_copy`); an expert with no intact copy left is given up
alone (`on_lost`), never the worker.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.cache_policy import PIN_SHARE, Heat, choose_victims, pinned
from engine.errors import Moved, ShoalError, Unavailable
from engine.manifest import ExpertFile, ExpertKey
from worker.reader import Crc32, Digest, ReaderPool, ReadJob
from worker.uncached import read_file

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
    __slots__ = ("index", "state", "tensors", "job", "error")

    def __init__(self, index: int) -> None:
        self.index = index
        self.state = _LOADING
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
    ) -> None:
        self.keys = keys
        self.index = {key: i for i, key in enumerate(keys)}
        self.sizes = sizes
        self.capacity = capacity
        self._copies = copies
        self._reader = reader
        self._decode = decode
        self._checks = checks  # the manifest's entries, whose checksums every read must match
        self._report = report
        self._on_lost = on_lost
        n = len(keys)
        self._state = np.zeros(n, dtype=np.int8)
        self._users = np.zeros(n, dtype=np.int32)
        self._speculative = np.zeros(n, dtype=bool)  # loaded by a prefetch, not yet asked for
        self._last_used = np.zeros(n, dtype=np.int64)
        self._entries: dict[int, _Entry] = {}
        self._used = 0
        self._uses = 0
        self._last_layer = sys.maxsize
        self.heat = Heat(n)
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
            if not all(self._state[i] == _READY for i in idx):
                return None
            return [self._entries[i].tensors for i in idx]

    def add(self, key: ExpertKey, size: int, copies: list[tuple[int, Path]]) -> None:
        """Serve one more expert (a file just received); it starts on the drives."""
        with self._cond:
            if key not in self.index:
                self.index[key] = len(self.keys)
                self.keys.append(key)
                self.sizes = np.concatenate([self.sizes, np.array([size], dtype=np.int64)])
                self._state = np.concatenate([self._state, np.zeros(1, dtype=np.int8)])
                self._users = np.concatenate([self._users, np.zeros(1, dtype=np.int32)])
                self._speculative = np.concatenate([self._speculative, np.zeros(1, dtype=bool)])
                self._last_used = np.concatenate([self._last_used, np.zeros(1, dtype=np.int64)])
                self.heat.grow(1)
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
        idx = np.array([self.index[(layer, int(e))] for e in experts], dtype=np.int64)
        with self._cond:
            if layer <= self._last_layer:
                self.counters.passes += 1
                self.heat.advance()
            self._last_layer = layer
            self.heat.add(idx, tokens)
            self.counters.tokens += int(tokens.sum())
            self._cancel_stale(layer, set(idx.tolist()))
            self._uses += 1
            self._last_used[idx] = self._uses
            lease = Lease(self, idx)
            for pos, i in enumerate(idx.tolist()):
                c = self.counters
                c.demands += 1
                state = self._state[i]
                if state == _ABSENT:
                    c.misses += 1
                    lease.pending.append(pos)
                    continue
                entry = self._entries[i]
                self._users[i] += 1
                lease.held[pos] = entry
                if self._speculative[i]:
                    self._speculative[i] = False
                    c.prefetch_used += 1
                    if state == _READY:
                        c.hits += 1
                        c.prefetch_hits += 1
                    else:
                        c.misses += 1
                        c.prefetch_late += 1
                        self._reader.promote(entry.job)
                elif state == _READY:
                    c.hits += 1
                else:
                    c.misses += 1
            self._start_pending(lease)
        return lease

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

    def take(self, lease: Lease) -> list[tuple[int, dict[str, mx.array]]]:
        """Block until some of the lease's experts are ready; return those not yet taken."""
        with self._cond:
            waited = 0.0
            while True:
                for entry in lease.held.values():
                    if entry.state == _ABSENT and entry.error is not None:
                        raise entry.error
                ready = [(pos, e) for pos, e in lease.held.items() if e.state == _READY and not
                         lease.taken[pos]]
                if ready:
                    for pos, _ in ready:
                        lease.taken[pos] = True
                    return [(pos, e.tensors) for pos, e in ready]
                self._start_pending(lease)
                if not self._cond.wait(timeout=5.0):
                    waited += 5.0
                    if waited >= WAIT_SECONDS:
                        raise Unavailable(
                            f"expert reads made no progress for {WAIT_SECONDS:.0f} s")

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
            evictable = ready & (self._users == 0)
            if not demand:
                evictable &= ~pins & ~self._speculative
            victims = choose_victims(heat, self._last_used, self.sizes, evictable, pins, need)
            if victims is None and demand:
                self._cancel_stale(sys.maxsize, set())  # queued guesses give way to demand
                need = self._used + int(self.sizes[i]) - self.capacity
                victims = choose_victims(heat, self._last_used, self.sizes, evictable, pins, need)
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
        entry = _Entry(i)
        self._entries[i] = entry
        self._state[i] = _LOADING
        key = self.keys[i]
        entry.job = self._reader.submit(
            key, int(self.sizes[i]), self._copies[key], demand=demand, on_done=self._loaded,
            digest=self._digest(key),
        )
        return entry

    def _forget(self, i: int) -> None:
        entry = self._entries.pop(i)
        entry.state = _ABSENT
        entry.tensors = None
        self._state[i] = _ABSENT
        self._speculative[i] = False
        self._users[i] = 0  # leases holding a failed entry see its error, not a count
        self._used -= int(self.sizes[i])

    def _loaded(self, job: ReadJob) -> None:
        """On a reader thread: check and decode a finished read, then publish it."""
        tensors, error = None, None
        try:
            tensors = self._check_and_decode(job)
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

    def _check_and_decode(self, job: ReadJob) -> dict[str, mx.array]:
        if job.error is not None:
            # The reader already tried every other copy of each chunk that failed.
            reason = job.error.strerror or str(job.error)
            copies = self.copies(job.key) or job.copies
            for _, path in copies:
                self.lose_copy(job.key, path, f"cannot be read ({reason})")
            raise self._lost(job.key, f"its files cannot be read ({reason})")
        view = job.buffer[: job.size]
        if job.digest is not None and (job.digested != job.size
                                       or job.digest.hexdigest() != self._expected(job.key)):
            self._find_good_copy(job, view, self._checks[job.key].sha256)
        layer, expert = job.key
        origin = str(next(iter(job.sources))) if len(job.sources) == 1 else (
            f"expert {layer}/{expert} (read from {', '.join(map(str, sorted(job.sources)))})"
        )
        return self._decode(job.key, view, origin)

    def _digest(self, key: ExpertKey) -> Digest | None:
        """A fresh checksum for a read of `key`: the manifest's CRC-32 where it has one (the
        reader feeds it chunk by chunk as they arrive), else its SHA-256; None: not checked."""
        if self._checks is None:
            return None
        return Crc32() if self._checks[key].crc32 else hashlib.sha256()

    def _expected(self, key: ExpertKey) -> str:
        entry = self._checks[key]
        return entry.crc32 or entry.sha256

    def _find_good_copy(self, job: ReadJob, view: memoryview, expected: str) -> None:
        """A read failed its checksum: check each copy alone against the SHA-256, drop the
        bad ones, keep a good one in `view`. With none left the expert alone is given up, not
        the worker."""
        for _, path in self.copies(job.key):
            try:
                read_file(path, job.buffer, job.size)
            except OSError as e:
                self.lose_copy(job.key, path, f"cannot be read ({e.strerror or e})")
                continue
            if hashlib.sha256(view).hexdigest() == expected:
                return
            self.lose_copy(job.key, path, "checksum does not match the manifest")
        raise self._lost(job.key, "no intact copy of its file is left (see the problems)")

    @staticmethod
    def _lost(key: ExpertKey, why: str) -> Moved:
        # ABORTED (Moved), not DATA_LOSS: the coordinator fetches the inventory again, which
        # no longer lists this expert here, and routes it to another copy or names it alone
        # as unowned; the worker's other experts stay in service.
        layer, expert = key
        return Moved(f"layer {layer}: expert {expert} is no longer served by this worker: "
                     f"{why}; fetch the inventory again")


class Lease:
    """One request's hold on its experts: take them as they become ready, then give them back.
    The cache keeps the fields; the request only calls the three methods."""

    def __init__(self, cache: ExpertCache, idx: np.ndarray) -> None:
        self.cache = cache
        self.idx = idx
        self.pending: list[int] = []  # positions whose load could not start yet (no room)
        self.held: dict[int, _Entry] = {}
        self.taken = [False] * len(idx)

    def take(self) -> list[tuple[int, dict[str, mx.array]]]:
        """Block until some of the experts are ready; those not yet taken, by position."""
        return self.cache.take(self)

    def done(self, positions: Iterable[int]) -> None:
        """The experts at `positions` are computed: they may be evicted now."""
        self.cache.give_back(self, positions)

    def close(self) -> None:
        """Give back every expert still held (the request ended, computed or failed)."""
        self.cache.end(self)
