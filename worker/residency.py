"""What this worker keeps in memory under its budget, and the expert compute that serves a request.

Experts live in a cache of decoded tensors holding at most `budget` bytes of expert files.
A request's experts that are not resident are read from the drives (`worker/reader.py`) with
demand priority and computed as they arrive; prefetch hints from the coordinator start reads
of the experts it expects next. Which experts stay is decided by `engine/cache_policy.py`
(heat and recency; hot experts pinned). When the budget holds every expert, each layer's
experts are also stacked (views, not a second copy) so a request runs in one gathered call.
Whatever the budget, every requested expert is computed from its own tensors: the budget
changes the speed, never the result.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.cache_policy import PIN_SHARE, Heat, choose_victims, pinned
from engine.errors import InvalidInput, Moved, NotFound, ShoalError, Unavailable
from engine.experts import ExpertRunner, build_skeleton
from engine.manifest import ExpertFile, ExpertKey
from engine.safetensors_view import placeholders, tensors_from_buffer
from engine.tensors import from_numpy, mlx_dtype
from worker.holdings import Holdings
from worker.reader import (
    READERS_PER_DRIVE,
    Crc32,
    Digest,
    DriveStats,
    ReaderPool,
    ReadJob,
    read_file,
)
from worker.store import StoreScan

MAX_ROWS = 1 << 20  # far above any prefill chunk; refuses absurd requests before allocating
# (token, expert) pairs in one request: a 2048-token prompt chunk with top-16 routing is 32768;
# far more is refused before any work (4M pairs once took 80 s and 4.4 GB).
MAX_PAIRS = 1 << 18
WAIT_SECONDS = 600.0  # a demand read that takes longer than this is reported as a failure

_ABSENT, _LOADING, _READY = 0, 1, 2


@dataclass(frozen=True)
class Request:
    """One decoded ExpertRequest: numpy views of the wire bytes."""

    layer: int
    hidden: np.ndarray  # (n, the switch module's input width), wire byte layout of `dtype`
    dtype: str
    rows: np.ndarray  # (m,) int32
    experts: np.ndarray  # (m,) int32
    call_pairs: int = 0  # the caller's whole call's pairs (ExpertRunner.gathered pads to it)


@dataclass
class Timing:
    """Seconds of one request spent in MLX evaluation of the experts (the matrix work)."""

    matrix: float = 0.0


@dataclass(frozen=True)
class LayerStack:
    """One layer's held experts stacked per parameter, for a single gathered call."""

    positions: np.ndarray  # (num_experts,) int32: expert number -> index in the stack, or -1
    params: dict[str, mx.array]


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


@dataclass
class WorkerSnapshot:
    """Everything `GetStats` reports, taken under the cache's lock."""

    budget: int
    expert_bytes: int
    resident_bytes: int
    resident_experts: int
    held_experts: int
    buffer_bytes: int
    counters: CacheCounters
    drives: list[DriveStats]
    problems: list[str] = field(default_factory=list)


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

    def _take(self, lease: Lease) -> list[tuple[int, dict[str, mx.array]]]:
        """Block until some of the lease's experts are ready; return those not yet taken."""
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
                    raise Unavailable(f"expert reads made no progress for {WAIT_SECONDS:.0f} s")

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
    """One request's hold on its experts: take them as they become ready, then give them back."""

    def __init__(self, cache: ExpertCache, idx: np.ndarray) -> None:
        self.cache = cache
        self.idx = idx
        self.pending: list[int] = []  # positions whose load could not start yet (no room)
        self.held: dict[int, _Entry] = {}
        self.taken = [False] * len(idx)

    def take(self) -> list[tuple[int, dict[str, mx.array]]]:
        with self.cache._cond:
            return self.cache._take(self)

    def done(self, positions: Iterable[int]) -> None:
        with self.cache._cond:
            for pos in positions:
                self.cache._done(self, pos)
            self.cache._start_pending(self)

    def close(self) -> None:
        with self.cache._cond:
            for pos in list(self.held):
                self.cache._done(self, pos)
            self.pending.clear()


class Residency:
    """The worker's experts: which are in memory, reads of the others, and the compute.

    MLX work runs under one lock (MLX evaluation is not meant to run from several threads
    at once); reads and decoding run on the reader threads.
    """

    def __init__(
        self,
        scan: StoreScan,
        *,
        budget: int | None = None,
        readers_per_drive: int = READERS_PER_DRIVE,
        verify_reads: bool = True,
        warm: bool = True,
        report: Callable[[str], None] | None = None,
    ) -> None:
        self.scan = scan
        manifest = scan.manifest
        config = manifest.config
        self.problems: list[str] = list(scan.problems)
        self._problems_lock = threading.Lock()
        self._echo = report
        files = {(e.layer, e.expert): e for e in manifest.experts}
        self._files = files
        keys = sorted(scan.copies)
        self.holdings = Holdings(keys)
        sizes = np.array([files[k].bytes for k in keys], dtype=np.int64)
        self.expert_bytes = int(sizes.sum())
        self.budget = self.expert_bytes if budget is None else int(budget)
        # Experts received later (shoal deploy/rebalance) may be larger than any held now.
        largest = int(sizes.max()) if keys else max(e.bytes for e in manifest.experts)
        if self.budget < largest:
            raise InvalidInput(
                f"a memory budget of {self.budget} bytes cannot hold even one expert "
                f"({largest} bytes); give at least that much"
            )
        drives = len(scan.folders)
        self.reader = ReaderPool(
            scan.folders, max(e.bytes for e in manifest.experts), readers_per_drive * drives + 2,
            readers_per_drive=readers_per_drive, on_problem=self._problem,
        )
        skeleton = self._skeleton = build_skeleton(config)
        self.runners: dict[int, ExpertRunner] = {}
        self._held_mask: dict[int, np.ndarray] = {}
        for layer, expert in keys:
            moe = manifest.layer(layer)
            if layer not in self.runners:
                sample = placeholders(scan.copies[(layer, expert)][0][1])
                self.runners[layer] = ExpertRunner(skeleton, config, moe, sample)
                self._held_mask[layer] = np.zeros(moe.num_experts, dtype=bool)
            self._held_mask[layer][expert] = True
        self.cache = ExpertCache(
            keys, sizes, {k: list(v) for k, v in scan.copies.items()}, self.budget,
            self.reader, self._decode,
            checks=files if verify_reads else None,
            report=self._problem, on_lost=self.withdraw,
        )
        self._lock = threading.Lock()
        self._stacks: dict[int, LayerStack] = {}
        if warm:
            self.cache.warm(range(len(keys)))
            for layer in self.runners:
                self._stack(layer)

    @property
    def layers(self) -> dict[int, ExpertRunner]:
        return self.runners

    @property
    def streaming(self) -> bool:
        """True when the budget cannot hold every expert at once."""
        return self.budget < self.expert_bytes

    def held(self) -> list[ExpertKey]:
        """The experts offered (verified, not draining): what the inventory lists."""
        return self.holdings.offered()

    def add_expert(self, key: ExpertKey, drive: int, path: Path) -> None:
        """Serve an expert whose verified file was just put into store folder `drive`."""
        layer, expert = key
        entry = self._files[key]
        with self._lock:  # building a layer's module runs MLX
            if layer not in self.runners:
                moe = self.scan.manifest.layer(layer)
                self.runners[layer] = ExpertRunner(
                    self._skeleton, self.scan.manifest.config, moe, placeholders(path)
                )
                self._held_mask[layer] = np.zeros(moe.num_experts, dtype=bool)
        if not self._held_mask[layer][expert]:
            self.cache.add(key, entry.bytes, [(drive, path)])
            self.expert_bytes += entry.bytes
            self._held_mask[layer][expert] = True
            self._stacks.pop(layer, None)  # restacked once the new expert is in memory
        self.holdings.add(key)

    def remove_expert(self, key: ExpertKey) -> list[Path]:
        """Stop serving an expert for good (its files are to be deleted): later requests for
        it are told it moved. Returns the paths of its files."""
        layer, expert = key
        mask = self._held_mask.get(layer)
        if mask is None or not mask[expert]:
            return []
        mask[expert] = False
        self._stacks.pop(layer, None)
        self.holdings.deleted(key)
        self.expert_bytes -= self._files[key].bytes
        return [path for _, path in self.cache.discard(key)]

    def withdraw(self, key: ExpertKey, why: str) -> None:
        """Stop offering an expert none of whose files here is intact any more (rot, a file
        gone): like a deleted one, a request for it is told it moved, and a push (`shoal
        deploy`, `shoal rebalance`) may bring a fresh copy. The bad files stay where they are
        for inspection; a push replaces them."""
        mask = self._held_mask.get(key[0])
        if mask is not None and mask[key[1]]:
            self.remove_expert(key)
            self._problem(f"expert {key[0]}/{key[1]} is no longer served by this worker: {why}")

    def _problem(self, message: str) -> None:
        with self._problems_lock:
            if message in self.problems:
                return
            self.problems.append(message)
        if self._echo is not None:
            self._echo(message)

    def _decode(self, key: ExpertKey, view: memoryview, origin: str) -> dict[str, mx.array]:
        return self.runners[key[0]].check(tensors_from_buffer(view, origin=origin), origin)

    def stacked_layers(self) -> list[int]:
        """The layers whose requests run as one gathered call right now."""
        return sorted(self._stacks)

    def _stack(self, layer: int) -> LayerStack | None:
        """The layer's held experts stacked for one gathered call; None while the budget
        cannot hold every expert, or until all of this layer's are in memory."""
        if self.streaming:
            self._stacks.clear()
            return None
        stack = self._stacks.get(layer)
        if stack is not None:
            return stack
        held = self._held_mask[layer]
        experts = np.flatnonzero(held)
        tensors = self.cache.ready_tensors([(layer, int(e)) for e in experts])
        if tensors is None:
            return None
        with self._lock:
            positions = np.full(held.size, -1, dtype=np.int32)
            positions[experts] = np.arange(experts.size, dtype=np.int32)
            stack = LayerStack(positions, self.runners[layer].stack(tensors))
            self._stacks[layer] = stack
        return stack

    def validate(self, request: Request) -> ExpertRunner:
        runner = self.runners.get(request.layer)
        if runner is None:
            raise InvalidInput(f"this worker holds no experts of layer {request.layer}")
        n, width = request.hidden.shape
        if width != runner.input_width:
            raise InvalidInput(
                f"hidden states have width {width}, layer {request.layer}'s experts take "
                f"{runner.input_width}"
            )
        if not 0 < n <= MAX_ROWS:
            raise InvalidInput(f"request carries {n} hidden states; allowed 1 to {MAX_ROWS}")
        if request.rows.shape != request.experts.shape or request.rows.size == 0:
            raise InvalidInput("rows and experts must be non-empty and of the same length")
        if request.rows.size > MAX_PAIRS:
            raise InvalidInput(f"request carries {request.rows.size} (token, expert) pairs; "
                               f"allowed at most {MAX_PAIRS}")
        if request.rows.min() < 0 or request.rows.max() >= n:
            raise InvalidInput(f"a row index is outside the {n} hidden states sent")
        held = self._held_mask[request.layer]
        experts = request.experts
        inside = np.clip(experts, 0, held.size - 1)
        bad = experts[(experts < 0) | (experts >= held.size) | ~held[inside]]
        if bad.size:
            shown = ", ".join(str(e) for e in sorted(set(bad.tolist()))[:8])
            if all(self.holdings.was_deleted((request.layer, e)) for e in bad.tolist()):
                raise Moved(f"layer {request.layer}: expert(s) {shown} moved to another "
                               "worker; fetch the inventory again")
            raise InvalidInput(
                f"layer {request.layer}: this worker does not hold expert(s) {shown}"
            )
        return runner

    def compute(self, request: Request, timing: Timing | None = None) -> mx.array:
        """Validate, then run the experts; returns (m, output width) in the activation dtype.
        `timing`, if given, receives the seconds of MLX evaluation."""
        timing = timing if timing is not None else Timing()
        runner = self.validate(request)
        stack = self._stack(request.layer)
        if stack is not None:
            out = self._gathered(runner, stack, request, timing)
        else:
            out = self._streamed(runner, request, timing)
        self.holdings.asked(request.layer, request.experts)
        return out

    def _gathered(
        self, runner: ExpertRunner, stack: LayerStack, request: Request, timing: Timing
    ) -> mx.array:
        """Every expert of the layer is in memory, stacked: one call, no cache lease (nothing
        is evicted while the budget holds them all; a removed expert takes its stack along)."""
        distinct = int(np.count_nonzero(np.bincount(request.experts)))
        self.cache.count_resident(request.layer, distinct, request.experts.size)
        positions = stack.positions[request.experts]
        with self._lock:
            out = runner.gathered(stack.params, request.hidden, mlx_dtype(request.dtype),
                                  request.rows, positions, request.call_pairs)
            before = time.perf_counter()
            mx.eval(out)
            timing.matrix += time.perf_counter() - before
        return out

    def _streamed(self, runner: ExpertRunner, request: Request, timing: Timing) -> mx.array:
        """Some experts may be on the drives: lease them from the cache, compute each as it
        arrives."""
        unique, inverse, counts = np.unique(request.experts, return_inverse=True,
                                            return_counts=True)
        hidden = from_numpy(request.hidden, request.dtype)
        lease = self.cache.demand(request.layer, unique, counts)
        try:
            ready = lease.take()
            return self._each_as_it_arrives(runner, lease, ready, hidden, request.rows,
                                            inverse.reshape(-1), counts, timing)
        except NotFound:
            gone = [int(e) for e in unique if self.holdings.was_deleted((request.layer, int(e)))]
            if gone:  # deleted while this request was on its way (shoal rebalance)
                raise Moved(f"layer {request.layer}: expert(s) {gone} moved to another worker; "
                            "fetch the inventory again") from None
            raise
        finally:
            lease.close()

    def _each_as_it_arrives(
        self, runner: ExpertRunner, lease: Lease, ready: list[tuple[int, dict[str, mx.array]]],
        hidden: mx.array, rows: np.ndarray, inverse: np.ndarray, counts: np.ndarray,
        timing: Timing,
    ) -> mx.array:
        """Run each distinct expert on its rows as its tensors become ready (streaming), then
        put the outputs back in request order."""
        order = np.argsort(inverse, kind="stable")
        rows_of = np.split(rows[order], np.cumsum(counts)[:-1])
        parts: list[mx.array | None] = [None] * counts.size
        remaining = counts.size
        while True:
            with self._lock:
                outs = [runner(tensors, hidden[mx.array(rows_of[pos])]) for pos, tensors in ready]
                before = time.perf_counter()
                mx.eval(outs)
                timing.matrix += time.perf_counter() - before
            for (pos, _), out in zip(ready, outs, strict=True):
                parts[pos] = out
            lease.done(pos for pos, _ in ready)
            remaining -= len(ready)
            if not remaining:
                break
            ready = lease.take()
        with self._lock:
            out = mx.concatenate(parts)[mx.array(np.argsort(order).astype(np.int32))]
            before = time.perf_counter()
            mx.eval(out)
            timing.matrix += time.perf_counter() - before
        return out

    def prefetch(self, layer: int, experts: Iterable[int]) -> None:
        """A hint: these experts of `layer` will probably be asked for next. Never fails."""
        held = self._held_mask.get(layer)
        if held is None:
            return
        wanted = [e for e in experts if 0 <= e < held.size and held[e]]
        if wanted and self.streaming:
            self.cache.prefetch(layer, wanted)

    def snapshot(self) -> WorkerSnapshot:
        resident, count = self.cache.resident_bytes()
        with self._problems_lock:
            problems = list(self.problems)
        return WorkerSnapshot(
            budget=self.budget,
            expert_bytes=self.expert_bytes,
            resident_bytes=resident,
            resident_experts=count,
            held_experts=int(sum(int(mask.sum()) for mask in self._held_mask.values())),
            buffer_bytes=self.reader.buffer_bytes * self.reader.buffer_count,
            counters=self.cache.snapshot_counters(),
            drives=self.reader.drive_stats(),
            problems=problems,
        )

    def close(self) -> None:
        self.reader.close()
