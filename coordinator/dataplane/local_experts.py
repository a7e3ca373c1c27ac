"""The coordinator's own experts, served in its own process (`LocalExperts`, an ExpertHost)
around the worker's `Residency`: a layer whose every expert is held here runs as mlx-lm runs
it (`whole`), over the stack or, under a budget, the slots; the rest as shares of a call."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from coordinator.dataplane.hosts import IN_PROCESS, Answer, Share
from coordinator.dataplane.lookahead import Lookahead
from engine.errors import InvalidInput, ShoalError
from engine.manifest import ExpertKey, Manifest, not_written_by_shard
from engine.store_lock import COORDINATOR, hold_for_serving
from proto import error_class_for, shoal_pb2
from worker.advertise import load_node_id, node_id_path
from worker.open_stores import open_residency
from worker.residency import Request, Residency, Timing
from worker.service import ExpertServicer

ADDRESS = "local"  # how the coordinator's own member is named where a worker shows its address
PASSES_KEPT = 2  # `whole` calls' picks left uncounted until evaluated (LocalExperts._count)


class _Context:
    """The servicer's context for a call made in process: a refusal raises the ShoalError the
    worker would have sent (the same table read back, proto.ERROR_CODES)."""

    def abort(self, code, details: str):
        raise (error_class_for(code) or ShoalError)(details)


_CONTEXT = _Context()


class _Streamed:
    """A streamed answer as gRPC's caller holds it: iterated, and cancelled to stop early."""

    def __init__(self, answer: Generator) -> None:
        self._answer = answer

    def __iter__(self) -> Iterator:
        return self._answer

    def cancel(self) -> None:
        self._answer.close()


class LocalExperts:
    """The coordinator's Mac as a member, an ExpertHost (hosts.py): its experts
    computed here, its holdings, heat and files answered as a worker's link answers them. One
    thread computes at a time (the dispatcher's); the residency's lock guards MLX against
    transfers meanwhile."""

    address = ADDRESS
    connections = 1
    open_streams = 1
    in_process = True
    path = IN_PROCESS

    def __init__(self, residency: Residency, node_id: str, locks: Sequence[int] = ()) -> None:
        self._locks = list(locks)
        self.residency = residency
        self.node_id = node_id
        self._servicer = ExpertServicer(residency, node_id, residency.budget)
        self._answers: deque[Answer] = deque()
        self._noted: list[tuple[int, mx.array]] = []
        self._noted_lock = threading.Lock()
        self._computer: threading.Thread | None = None  # the thread whose graph the picks are
        self._kept = PASSES_KEPT * max(len(residency.scan.manifest.layers), 1)
        # the router lookahead (coordinator/dataplane/lookahead.py) for the layers run by `whole`,
        # which the dispatcher does not see; set by whoever builds the model's dispatcher
        self.lookahead: Lookahead | None = None
        self.inventory = self.fetch_inventory()

    # -- the compute path ------------------------------------------------------------------

    def whole(self, layer: int, x: mx.array, inds: mx.array,
              timing: Timing | None = None) -> mx.array | None:
        """mlx-lm's own switch call over this layer's experts, when every one is held here in
        memory (lazy, like the single-process model's), or read into memory now when the
        budget cannot hold them all (`timing`: its picks' evaluation and reads); else None."""
        if self.residency.streaming:
            ahead = None if self.lookahead is None else \
                self.lookahead.ahead(layer, x, inds.shape[-1])
            return self.residency.whole_streamed(
                layer, x, inds, lambda: self._prefetch(ahead),
                [ahead[1]] if ahead is not None else [], timing)
        out = self.residency.whole(layer, x, inds)
        if out is not None:
            self._computer = threading.current_thread()
            with self._noted_lock:
                self._noted.append((layer, inds))
                noted = len(self._noted)
            if noted >= 2 * self._kept:  # counted in batches, not a call at a time
                self._count(noted - self._kept)
        return out

    def _prefetch(self, ahead: tuple[int, mx.array] | None) -> None:
        """Start reading the experts the router lookahead expects the next layer to use (its
        guess, evaluated with this layer's picks)."""
        if ahead is not None:
            layer, guess = self.lookahead.guessed(*ahead)
            self.residency.prefetch(layer, guess.tolist())

    def submit(self, share: Share, timeout: float) -> int:
        """Start computing a share of a layer call: its outputs are started on the device and
        left where MLX holds them (no copy through host memory); the dispatcher submits this
        after the workers' shares, so it computes while theirs travel. Raises what the
        residency raises (Moved for an expert that left this machine)."""
        if share.hint is not None:
            self.residency.prefetch(share.hint.layer, share.hint.experts)
        started = time.perf_counter()
        x = share.call.x
        hidden = x.reshape(-1, x.shape[-1])
        hidden = hidden[share.needed if isinstance(share.needed, slice)
                        else mx.array(share.needed)]
        timing = Timing()
        request = Request(share.call.layer, hidden, share.call.wire_dtype, share.rows,
                          share.experts, share.call.experts.size)
        out = self.residency.compute(request, timing, started=True)
        done = time.perf_counter()
        reply = shoal_pb2.ExpertReply(
            seq=share.seq, compute_seconds=done - started - timing.waited,
            inventory_version=self.residency.holdings.version,
            timing=shoal_pb2.WorkerTiming(
                matrix=timing.matrix, waited=timing.waited, reads=timing.reads,
                bookkeeping=done - started - timing.matrix - timing.waited - timing.reads),
        )
        self._answers.append(Answer(reply, out, out.dtype))
        return 0

    def collect(self, share: Share, timeout: float) -> Answer:
        return self._answers.popleft()

    def hint(self, layer: int, hint: shoal_pb2.PrefetchHint) -> None:
        self.residency.prefetch(hint.layer, hint.experts)

    def _count(self, count: int) -> None:
        """Count the heat of the oldest `count` picks noted, a layer at a time: a pick is
        read once evaluated, and mlx-lm builds one forward pass while the one before it runs,
        so picks `PASSES_KEPT` passes old are done."""
        with self._noted_lock:
            picks = self._noted[:count]
            del self._noted[:count]
        by_layer: dict[int, list[np.ndarray]] = {}
        for layer, inds in picks:
            by_layer.setdefault(layer, []).append(np.asarray(inds).reshape(-1))
        for layer, picks in by_layer.items():
            self.residency.counted(layer, np.concatenate(picks).astype(np.int64))

    def settle(self) -> None:
        """Count the picks noted (read before the heat or the counters are): every one from
        the thread that computes them (or once it has ended); from another thread (the
        dashboard's, while `shoal serve` decodes) only those `PASSES_KEPT` passes old, which
        are evaluated: reading a newer one would run MLX in two threads at once."""
        computer = self._computer
        with self._noted_lock:
            noted = len(self._noted)
        if computer is None or computer is threading.current_thread() or \
                not computer.is_alive():
            self._count(noted)
        else:
            self._count(noted - self._kept)

    # -- what a link answers ---------------------------------------------------------------

    def fetch_inventory(self, timeout: float | None = None) -> shoal_pb2.Inventory:
        self.inventory = self._servicer.GetInventory(shoal_pb2.InventoryRequest(), _CONTEXT)
        return self.inventory

    def fetch_stats(self, timeout: float | None = None) -> shoal_pb2.WorkerStats:
        self.settle()
        return self._servicer.GetStats(shoal_pb2.StatsRequest(), _CONTEXT)

    def call(self, method: str, request, *, timeout: float | None = None):
        """Another call of the expert service (heat, expert files), answered by the worker's
        own servicer method; a refusal raises the ShoalError a worker's link would."""
        if method == "GetHeat":
            self.settle()
        answer = getattr(self._servicer, method)(request, _CONTEXT)
        return _Streamed(answer) if isinstance(answer, Generator) else answer

    def check_health(self, timeout: float) -> float:
        return 0.0

    def held(self) -> frozenset[ExpertKey]:
        return frozenset((h.layer, h.expert) for h in self.inventory.experts)

    def reset(self) -> None:
        """Forget the shares submitted for a call that is being redone."""
        self._answers.clear()

    def end_pass(self) -> None:
        pass

    def close(self) -> None:
        self.settle()
        self.residency.close()
        for fd in self._locks:
            os.close(fd)  # the lock goes with it
        self._locks = []


def open_local_experts(
    stores: list[Path], manifest: Manifest, *, memory_budget: str | None = None,
    verify: bool = True, node_id: str | None = None, warm: bool = True, admission: bool = True,
    read_limit: int | None = None,
) -> LocalExperts:
    """This Mac's store folders (one per drive) as the coordinator's own member, under a
    memory budget in the worker's forms (bytes, 40G, 25%; default as for a worker); `warm`
    False for a command that only moves or counts them (`shoal heat`, `rebalance`); `admission`
    as a worker's --cache-admission (True: heat), `read_limit` as its --read-limit."""
    for store in stores:
        if problem := not_written_by_shard(store):
            raise InvalidInput(f"--local-store: {problem}")
    locks = hold_for_serving(stores, COORDINATOR)  # a worker's lock: one server per store
    try:
        residency = open_residency(list(stores), memory_budget, verify=verify, name="shoal",
                                   out=sys.stderr,  # stdout is the generated text's
                                   warm=warm, admission=admission, read_limit=read_limit)
    except BaseException:
        for fd in locks:
            os.close(fd)
        raise
    try:
        if residency.scan.manifest.fingerprint != manifest.fingerprint:
            raise InvalidInput(
                f"--local-store {', '.join(map(str, stores))} holds another model "
                f"({residency.scan.manifest.fingerprint[:12]}, expected "
                f"{manifest.fingerprint[:12]})"
            )
        node = node_id or load_node_id(node_id_path(),
                                       log=lambda m: print(f"shoal: {m}", file=sys.stderr))
        return LocalExperts(residency, node, locks)
    except BaseException:
        residency.close()
        for fd in locks:
            os.close(fd)
        raise


class WithLocal:
    """Members: the coordinator's own experts first, then the workers of `remote` (none for
    one Mac alone). First, so that in a layer call its share is computed right after every
    remote request is sent, before any reply is read (the dispatcher reads in member order)."""

    def __init__(self, local: LocalExperts, remote=None) -> None:
        self.local = local
        self.remote = remote
        self._own = 1  # bumped when the local holdings change; both counters only grow
        self._held = local.held()
        self._watchers: list[Callable[[], None]] = []
        if remote is not None:
            remote.watch(self._changed)

    def watch(self, changed: Callable[[], None]) -> None:
        self._watchers.append(changed)

    def absent(self) -> list[str]:
        own = [] if self._held or not self.local.held() else [
            "this machine's own experts (--local-store) failed"]
        return own + (self.remote.absent() if self.remote is not None else [])

    def _changed(self) -> None:
        for changed in self._watchers:
            changed()

    @property
    def version(self) -> int:
        return self._own + (self.remote.version if self.remote is not None else 0)

    def live(self) -> tuple[int, list, list[frozenset[ExpertKey]]]:
        if self.remote is None:
            return self.version, [self.local], [self._held]
        version, links, holdings = self.remote.live()
        return self._own + version, [self.local, *links], [self._held, *holdings]

    # what `shoal serve`'s health and dashboard read of a Membership: the workers alone (the
    # coordinator's own experts are the coordinator's card)
    def snapshot(self) -> list:
        return self.remote.snapshot() if self.remote is not None else []

    @property
    def cluster(self) -> str:
        return getattr(self.remote, "cluster", "")

    def update_inventory(self, link, inventory: shoal_pb2.Inventory) -> None:
        if link is self.local:
            self._held = self.local.held()
            self._own += 1
            self._changed()
        elif self.remote is not None:
            self.remote.update_inventory(link, inventory)

    def report_failure(self, link, detail: str) -> None:
        if link is self.local:  # its experts are routed around, like a lost worker's
            self._held = frozenset()
            self._own += 1
            self._changed()
        elif self.remote is not None:
            self.remote.report_failure(link, detail)
