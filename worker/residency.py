"""The worker's experts: which it holds and offers, the request's validation, and the compute:
every expert in memory stacked once per layer, or under a smaller budget the streaming cache's
slots (`worker/cache.py`, `worker/streamed.py`); the budget changes the speed, never a result."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.errors import InvalidInput, Moved, NotFound
from engine.experts import ExpertRunner, build_skeleton
from engine.manifest import ExpertKey
from engine.safetensors_view import placeholders, tensors_from_buffer
from engine.tensors import from_numpy, mlx_dtype
from worker.cache import CacheCounters, ExpertCache
from worker.holdings import Holdings
from worker.reader import READERS_PER_DRIVE, DriveStats, ReaderPool
from worker.slots import pool_for
from worker.store import StoreScan
from worker.streamed import Turn, all_in_slots, one_by_one, over_slots

MAX_ROWS = 1 << 20  # far above any prefill chunk; refuses absurd requests before allocating
# (token, expert) pairs in one request: a 2048-token prompt chunk with top-16 routing is 32768;
# far more is refused before any work (an absurd request costs minutes and gigabytes).
MAX_PAIRS = 1 << 18


@dataclass(frozen=True)
class Request:
    """One decoded ExpertRequest: numpy views of the wire bytes."""

    layer: int
    # (n, the switch module's input width), wire byte layout of `dtype`; an MLX array when
    # the caller is in this process (the coordinator's own experts: local_experts.py)
    hidden: np.ndarray | mx.array
    dtype: str
    rows: np.ndarray  # (m,) int32
    experts: np.ndarray  # (m,) int32
    call_pairs: int = 0  # the caller's whole call's pairs (ExpertRunner.gathered pads to it)


@dataclass
class Timing:
    """Seconds of one request spent in MLX evaluation of the experts (the matrix work),
    waiting while another request's ran (a prompt pass's pieces come over several streams), and
    waiting for experts still being read from the drives (streaming)."""

    matrix: float = 0.0
    waited: float = 0.0
    reads: float = 0.0
    sync: float = 0.0  # a whole layer's call (`whole_streamed`): evaluating the router's picks


SMALL = 64  # values from which numpy's calls are quicker than Python's over a list


def bounds(values: np.ndarray) -> tuple[int, int]:
    """The least and the largest of a non-empty integer array."""
    if values.size < SMALL:
        listed = values.tolist()
        return min(listed), max(listed)
    return int(values.min()), int(values.max())


def distinct(values: np.ndarray) -> int:
    """How many distinct values a non-negative integer array holds."""
    if values.size < SMALL:
        return len(set(values.tolist()))
    return int(np.count_nonzero(np.bincount(values)))


@dataclass(frozen=True)
class LayerStack:
    """One layer's held experts stacked per parameter, for a single gathered call."""

    positions: np.ndarray  # (num_experts,) int32: expert number -> index in the stack, or -1
    params: dict[str, mx.array]


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
        samples: dict[int, dict[str, mx.array]] = {}
        for layer, expert in keys:
            moe = manifest.layer(layer)
            if layer not in self.runners:
                sample = samples[layer] = placeholders(scan.copies[(layer, expert)][0][1])
                self.runners[layer] = ExpertRunner(skeleton, config, moe, sample)
                self._held_mask[layer] = np.zeros(moe.num_experts, dtype=bool)
            self._held_mask[layer][expert] = True
        # Under a budget smaller than the experts, the resident ones are slots of stacked
        # arrays when every layer's experts have the same tensors (they differ only by a few
        # header bytes: a slot takes the largest file's room).
        self.pool = pool_for(list(samples.values()), self.budget // int(sizes.max())) \
            if self.streaming and keys else None
        self.slot_bytes = int(sizes.max()) if self.pool is not None else 0
        self.cache = ExpertCache(
            keys, sizes, {k: list(v) for k, v in scan.copies.items()}, self.budget,
            self.reader, self._decode,
            checks=files if verify_reads else None,
            report=self._problem, on_lost=self.withdraw,
            slot_bytes=self.slot_bytes,
        )
        self._lock = threading.Lock()
        self._stacks: dict[int, LayerStack] = {}
        if warm:
            self.cache.warm(range(len(keys)))
            self._install()
            for layer in self.runners:
                self._stack(layer)

    def _install(self) -> None:
        """Copy the experts read at start into their slots (MLX work: under the lock)."""
        if self.pool is not None:
            with self._lock:
                self.cache.install(self.pool.put)
                mx.eval(list(self.pool.params.values()))

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
        if self.pool is not None and not self.pool.fits(placeholders(path)):
            raise InvalidInput(f"expert {layer}/{expert}'s tensors differ in shape from the "
                               "experts this worker holds; restart it to serve both")
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
        low, high = bounds(request.rows)
        if low < 0 or high >= n:
            raise InvalidInput(f"a row index is outside the {n} hidden states sent")
        held = self._held_mask[request.layer]
        experts = request.experts
        low, high = bounds(experts)
        if low < 0 or high >= held.size or not held[experts].all():
            inside = np.clip(experts, 0, held.size - 1)
            bad = experts[(experts < 0) | (experts >= held.size) | ~held[inside]]
            shown = ", ".join(str(e) for e in sorted(set(bad.tolist()))[:8])
            if all(self.holdings.was_deleted((request.layer, e)) for e in bad.tolist()):
                raise Moved(f"layer {request.layer}: expert(s) {shown} moved to another "
                            "worker; fetch the inventory again")
            raise InvalidInput(
                f"layer {request.layer}: this worker does not hold expert(s) {shown}"
            )
        return runner

    def compute(self, request: Request, timing: Timing | None = None, *,
                started: bool = False) -> mx.array:
        """Validate, then run the experts; returns (m, output width) in the activation dtype.
        `timing`, if given, receives the seconds of MLX evaluation. With `started` (a caller
        in this process, which goes on while the device computes) experts held in memory are
        only started (`mx.async_eval`), not waited for; streamed ones are always evaluated."""
        timing = timing if timing is not None else Timing()
        runner = self.validate(request)
        stack = self._stack(request.layer)
        if stack is not None:
            out = self._gathered(runner, stack, request, timing, started)
        else:
            out = self._streamed(runner, request, timing)
        self.holdings.asked(request.layer, request.experts)
        return out

    def whole(self, layer: int, x: mx.array, inds: mx.array) -> mx.array | None:
        """mlx-lm's own call `switch(x, inds)` over the layer's stack, lazily, when every
        expert of the layer is held here and in memory; else None. For a caller in this
        process (the coordinator's own experts), which has no request to validate (the
        router picked `inds`) and reports the heat with `counted` once `inds` is evaluated."""
        held = self._held_mask.get(layer)
        if held is None or not held.all():
            return None
        stack = self._stack(layer)
        if stack is None:
            return None
        with self._lock:
            return self.runners[layer].whole(stack.params, x, inds)

    def whole_streamed(self, layer: int, x: mx.array, inds: mx.array,
                       then: Callable[[], None] = lambda: None, along: list[mx.array] = (),
                       timing: Timing | None = None) -> mx.array | None:
        """`whole` while the budget cannot hold every expert: mlx-lm's call over the slots
        with the router's picks (evaluated now) turned into slot numbers, lazily, once the
        missing experts are read; their heat and hits counted now. None when the layer is not
        all held here or its picks need more slots than there are. `then` runs once the
        missing experts' reads are queued (the caller's prefetch hints go behind them), and
        `along` is evaluated with the picks (the caller's guess of the next layer's); `timing`
        gets that evaluation's time (sync) and the waits for reads."""
        held = self._held_mask.get(layer)
        if self.pool is None or held is None or not held.all():
            return None
        timing = timing or Timing()
        before = time.perf_counter()
        mx.eval(inds, *along)
        timing.sync += time.perf_counter() - before
        experts = np.asarray(inds).reshape(-1)
        unique, inverse, counts = np.unique(experts, return_inverse=True, return_counts=True)
        if unique.size > self.pool.slots:
            return None
        lease = self.cache.demand(layer, unique, counts)
        try:
            then()
            picks = mx.array(all_in_slots(lease, self.cache, self.pool, self._lock,
                                          unique.size, timing)[inverse.reshape(inds.shape)])
            with self._lock:
                # the lease ends before this is evaluated: a slot taken over meanwhile is
                # copied, not overwritten, as MLX keeps an array the graph still refers to
                out = self.runners[layer].whole(self.pool.params, x, picks)
        finally:
            lease.close()
        self.holdings.asked(layer, experts)
        return out

    def counted(self, layer: int, experts: np.ndarray) -> None:
        """Count the heat and the cache's resident hits of a `whole` call's pairs."""
        self.cache.count_resident(layer, distinct(experts), experts.size)
        self.holdings.asked(layer, experts)

    def _turn(self, timing: Timing) -> Turn:
        """This request's turn at MLX: one at a time (MLX work is not thread-safe here)."""
        return Turn(self._lock, timing)

    def _gathered(
        self, runner: ExpertRunner, stack: LayerStack, request: Request, timing: Timing,
        started: bool = False,
    ) -> mx.array:
        """Every expert of the layer is in memory, stacked: one call, no cache lease (nothing
        is evicted while the budget holds them all; a removed expert takes its stack along)."""
        self.cache.count_resident(request.layer, distinct(request.experts), request.experts.size)
        positions = stack.positions[request.experts]
        with self._turn(timing):
            out = runner.gathered(stack.params, request.hidden, mlx_dtype(request.dtype),
                                  request.rows, positions, request.call_pairs)
            before = time.perf_counter()
            (mx.async_eval if started else mx.eval)(out)
            timing.matrix += time.perf_counter() - before
        return out

    def _streamed(self, runner: ExpertRunner, request: Request, timing: Timing) -> mx.array:
        """Some experts may be on the drives: lease them from the cache, compute them as they
        arrive (`worker/streamed.py`)."""
        unique, inverse, counts = np.unique(request.experts, return_inverse=True,
                                            return_counts=True)
        inverse = inverse.reshape(-1)
        lease = self.cache.demand(request.layer, unique, counts)
        try:
            if self.pool is not None:
                return over_slots(runner, self.pool, self.cache, lease, request.hidden,
                                  mlx_dtype(request.dtype), request.rows, inverse,
                                  request.call_pairs, lambda: self._turn(timing), timing)
            hidden = request.hidden
            if not isinstance(hidden, mx.array):
                hidden = from_numpy(hidden, request.dtype)
            return one_by_one(runner, lease, hidden, request.rows, inverse, counts,
                              lambda: self._turn(timing), timing)
        except NotFound:
            gone = [int(e) for e in unique if self.holdings.was_deleted((request.layer, int(e)))]
            if gone:  # deleted while this request was on its way (shoal rebalance)
                raise Moved(f"layer {request.layer}: expert(s) {gone} moved to another worker; "
                            "fetch the inventory again") from None
            raise
        finally:
            lease.close()

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
            budget=self.budget, expert_bytes=self.expert_bytes,
            resident_bytes=resident, resident_experts=count,
            held_experts=int(sum(int(mask.sum()) for mask in self._held_mask.values())),
            buffer_bytes=self.reader.buffer_bytes * self.reader.buffer_count,
            counters=self.cache.snapshot_counters(),
            drives=self.reader.drive_stats(),
            problems=problems,
        )

    def close(self) -> None:
        self.reader.close()
