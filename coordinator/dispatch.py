"""The remote switch: stands in for each MoE block's `switch_mlp(x, inds)`.

Per layer call: group the (token, expert) pairs by the worker that serves the expert (the
pairs of an expert with several copies are dealt over them), send one request to every
involved worker before waiting for any (a prompt pass's share as a few pieces over a few
connections, so that transfer and compute overlap), then place each worker's outputs back into the
(..., k, hidden) result in a fixed order, so the result never depends on which worker
answered first. A worker lost in the middle of a call is routed around when other workers
hold its experts (the call is redone; experts keep no state), else the call fails naming the
experts left without a live owner. A reply whose inventory version is newer than ours, or a
refusal saying an expert moved, makes us fetch that worker's inventory again (live
rebalancing, docs/placement.md). Where the MoE block has a shared expert, it is computed here
between sending and waiting, so it runs while the workers compute the routed experts.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from coordinator.cluster import Cluster
from coordinator.link import FIRST_REPLY_TIMEOUT, MIN_REPLY_TIMEOUT
from coordinator.local_experts import LocalExperts
from coordinator.lookahead import Lookahead
from engine.errors import Moved, ShoalError, Unavailable
from engine.manifest import Manifest
from engine.moe_layers import SWITCH_LINEARS, get_module
from engine.placement import LayerRoutes
from engine.tensors import dtype_name, mlx_dtype, to_mlx, to_numpy
from proto import EXPERT_REPLY, EXPERT_REQUEST, shoal_pb2
from proto.wire import WireView, decode


@dataclass
class LayerStats:
    calls: int = 0
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    requests: int = 0
    worker_compute_seconds: float = 0.0
    slowest_compute_seconds: float = 0.0  # per call, the longest-computing worker's time
    shared_seconds: float = 0.0  # the shared expert, computed while the workers compute
    # The per-layer breakdown (--stats, shoal bench), summed over calls. The worker's parts
    # and the wire are those of the call's critical worker: the longest round trip.
    sync_seconds: float = 0.0  # waiting for this layer's attention and router (mx.eval)
    send_seconds: float = 0.0  # grouping, building and queueing the requests
    wire_seconds: float = 0.0  # critical worker's round trip less its own time
    worker_parse_seconds: float = 0.0
    worker_matrix_seconds: float = 0.0
    worker_bookkeeping_seconds: float = 0.0
    worker_reads_seconds: float = 0.0  # waiting for experts being read from its drives
    worker_reply_seconds: float = 0.0
    # waiting while it computed its other streams' requests (a prompt pass's pieces): overlaps
    # those requests' own parts, so not in the round trip's sum
    worker_waited_seconds: float = 0.0
    parse_scatter_seconds: float = 0.0  # replies -> the (..., k, width) MLX array

    def add(self, other: LayerStats) -> None:
        totals = self.__dict__  # twice per layer call: dict updates, not getattr/setattr
        for name, value in other.__dict__.items():
            totals[name] += value

    def breakdown(self) -> dict[str, float]:
        """Microseconds per call, one number per part (see the fields' comments)."""
        calls = max(self.calls, 1)
        parts = ("sync", "send", "wire", "worker_parse", "worker_matrix",
                 "worker_bookkeeping", "worker_reads", "worker_reply", "worker_waited",
                 "parse_scatter",
                 "shared")
        out = {f"{p}_us": 1e6 * getattr(self, f"{p}_seconds") / calls for p in parts}
        out["round_trip_us"] = 1e6 * self.seconds / calls
        return out


class DispatchStats:
    """Counters for `--stats`; per layer, summed over every call since the last reset.

    A call adds to one slot, its layer's decode or prompt-pass figures (`slot`); the views
    by layer and by kind are sums of slots, made when read."""

    def __init__(self) -> None:
        self.worker_requests: Counter[str] = Counter()  # by worker address
        self._slots: dict[tuple[int, bool], LayerStats] = {}  # (layer, decode) -> totals

    def slot(self, layer: int, decode: bool) -> LayerStats:
        """Where a call of `layer` adds its figures: decode calls (one new token per
        sequence) apart from prompt passes."""
        slot = self._slots.get((layer, decode))
        if slot is None:
            slot = self._slots[(layer, decode)] = LayerStats()
        return slot

    def _sum(self, decode: bool | None = None, layer: int | None = None) -> LayerStats:
        total = LayerStats()
        for (at, kind), s in list(self._slots.items()):
            if (decode is None or kind == decode) and (layer is None or at == layer):
                total.add(s)
        return total

    @property
    def layers(self) -> dict[int, LayerStats]:
        return {layer: self._sum(layer=layer) for layer in sorted({at for at, _ in self._slots})}

    @property
    def decode(self) -> LayerStats:
        """Calls of one new token per sequence, every layer summed (a copy)."""
        return self._sum(decode=True)

    @property
    def prefill(self) -> LayerStats:
        """Calls of several tokens a sequence (prompt passes), every layer summed (a copy)."""
        return self._sum(decode=False)

    def total(self) -> LayerStats:
        return self._sum()

    def reset(self) -> None:
        self._slots.clear()
        self.worker_requests.clear()


def spread(routes: LayerRoutes, experts: np.ndarray, turn: int = 0) -> np.ndarray:
    """The worker that computes each (token, expert) pair of one layer call: the i-th pair of
    an expert goes to its copy (i + turn + expert) mod copies, so within a call an expert's
    pairs split evenly over its copies, and over successive calls (`turn`: the layer's call
    count) a decode step's single pair moves round them. Any copy gives the same result (same
    file, same code), so this changes who computes, not what."""
    experts = np.asarray(experts)
    if not routes.replicated:  # no expert has a second copy: nothing to deal out
        return routes.copies[experts, 0]
    order = np.argsort(experts, kind="stable")
    ranked = experts[order]
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    first = np.repeat(starts, np.diff(np.r_[starts, ranked.size]))
    rank = np.empty(experts.size, dtype=np.int64)
    rank[order] = np.arange(experts.size) - first
    counts = np.maximum(routes.counts[experts], 1)
    return routes.copies[experts, (rank + turn + experts) % counts]


MAX_ATTEMPTS = 3  # per layer call: a lost worker is routed around at most this often
LARGE_CALL = 64  # (token, expert) pairs from which a call's time is mostly per pair
# A worker's share of a prompt pass goes as pieces of about this many pairs, which it computes
# one after the other while the next arrives and the last's reply leaves (the size was chosen
# by measurement: docs/benchmarks.md, "Prompt passes in pieces"). The bits are the same: the
# worker pads and sorts by the whole call's pair count, and each pair's output does not depend
# on its call (checked on CUDA, and in the tests).
PIECE_PAIRS = 512
# and those pieces are dealt over this many lanes per worker, each a connection of its own, so
# that their transfers overlap (docs/benchmarks.md, "A prompt pass's pieces over several
# connections").
LANES = 4


@dataclass
class Pace:
    """How fast one worker answers, measured, for the deadline of its next reply: a worker
    that hangs (stopped, swapping, wedged) is given up after a few times its usual round
    trip, and its experts routed to a copy elsewhere, as for a worker that died."""

    round_trip: float = 0.0  # small calls (decode): moving average, seconds
    per_pair: float = 0.0  # large calls (prompt passes): seconds per pair
    small_seen: int = 0
    large_seen: int = 0

    def deadline(self, pairs: int) -> float:
        if pairs >= LARGE_CALL:
            if self.large_seen == 0:
                return FIRST_REPLY_TIMEOUT
            return MIN_REPLY_TIMEOUT + 20 * self.round_trip + 20 * self.per_pair * pairs
        if self.small_seen < 3:
            return FIRST_REPLY_TIMEOUT
        return MIN_REPLY_TIMEOUT + 20 * self.round_trip

    def observe(self, seconds: float, pairs: int) -> None:
        if pairs >= LARGE_CALL:
            rate = seconds / pairs
            self.per_pair = rate if not self.large_seen else 0.8 * self.per_pair + 0.2 * rate
            self.large_seen += 1
        else:
            self.round_trip = (seconds if not self.small_seen
                               else 0.8 * self.round_trip + 0.2 * seconds)
            self.small_seen += 1


def _rows_of(tokens: np.ndarray) -> slice | np.ndarray:
    """Ascending token indices as a slice where they are a run (a view of the hidden states,
    not a copy), else as they are."""
    if tokens.size and tokens[-1] - tokens[0] + 1 == tokens.size:
        return slice(int(tokens[0]), int(tokens[-1]) + 1)
    return tokens


class _WorkerFailed(Exception):
    def __init__(self, worker: int, error: Unavailable) -> None:
        super().__init__(str(error))
        self.worker = worker
        self.error = error


class _StaleRoute(Exception):
    """A worker no longer holds an expert it was sent (it moved): fetch its inventory again."""

    def __init__(self, worker: int) -> None:
        super().__init__(f"worker {worker} holds other experts now")
        self.worker = worker


@dataclass(frozen=True)
class Piece:
    """One request of a layer call: to `worker`, on its lane `lane`, for the call's pairs
    `pairs` (indices into its flattened (token, slot) pairs, ascending), carrying the hidden
    rows `needed` of the call's tokens and each pair's row among them (`rows`)."""

    worker: int
    lane: int
    pairs: np.ndarray
    needed: slice | np.ndarray
    rows: np.ndarray


def split_share(pairs: np.ndarray, k: int, piece_pairs: int
                ) -> list[tuple[np.ndarray, slice | np.ndarray, np.ndarray]]:
    """One worker's pairs of a call (ascending) as requests: (pairs, the tokens whose hidden
    rows it needs, each pair's row among them). With `piece_pairs` (0: whole) a prompt pass's
    share goes as pieces of about that many pairs, whole tokens each, so that the worker
    computes one piece while the next arrives and the reply of the last leaves; a decode
    step's goes whole."""
    tokens = pairs // k  # ascending, as pairs are
    if tokens[0] == tokens[-1]:  # one token's pairs (a decode step's): its row, once
        token = int(tokens[0])
        return [(pairs, slice(token, token + 1), np.zeros(pairs.size, np.int32))]
    first = np.empty(tokens.size, dtype=bool)
    first[0] = True
    np.not_equal(tokens[1:], tokens[:-1], out=first[1:])
    needed = tokens[first]  # the tokens this worker needs, each sent once
    rows = np.cumsum(first, dtype=np.int32) - 1  # each pair's row among them
    count = min(needed.size, pairs.size // piece_pairs) if piece_pairs else 1
    if count <= 1:
        return [(pairs, _rows_of(needed), rows)]
    cuts = np.searchsorted(rows, np.arange(1, count) * needed.size // count).tolist()
    out = []
    for lo, hi in zip([0, *cuts], [*cuts, pairs.size], strict=True):
        start, stop = int(rows[lo]), int(rows[hi - 1]) + 1
        out.append((pairs[lo:hi], _rows_of(needed[start:stop]), rows[lo:hi] - start))
    return out


def group_pairs(owner: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """Each worker's pairs of a call whose pair i goes to `owner[i]`: (worker, its pair
    indices ascending), workers ascending."""
    if owner.size < LARGE_CALL:  # a decode step's few pairs: Python's lists are quicker here
        groups: dict[int, list[int]] = {}
        for i, worker in enumerate(owner.tolist()):
            groups.setdefault(worker, []).append(i)
        return [(worker, np.array(groups[worker], dtype=np.intp)) for worker in sorted(groups)]
    order = np.argsort(owner, kind="stable")
    ranked = owner[order]
    cuts = (np.flatnonzero(ranked[1:] != ranked[:-1]) + 1).tolist()
    return [(int(ranked[lo]), order[lo:hi])
            for lo, hi in zip([0, *cuts], [*cuts, owner.size], strict=True)]


def plan_call(owner: np.ndarray, k: int, *, piece_pairs: int, lanes: int,
              whole: Callable[[int], bool] = lambda worker: False) -> list[Piece]:
    """The requests of one layer call whose pair i goes to worker `owner[i]`, in the order
    they are sent: every worker's first piece first, workers ascending (the fixed order the
    replies are then read in), a worker's pieces dealt over its `lanes`. A worker for which
    `whole` is true gets its share whole (one that streams experts from its drives: each piece
    would read again what its cache could not keep); it is asked only of a share large enough
    to go in pieces, so a decode step never asks it."""
    shares = {}
    for worker, pairs in group_pairs(owner):
        large = piece_pairs and pairs.size >= 2 * piece_pairs
        shares[worker] = split_share(pairs, k, piece_pairs if large and not whole(worker) else 0)
    plan = []
    for round_ in range(max(len(share) for share in shares.values())):
        for worker, share in shares.items():
            if round_ < len(share):
                plan.append(Piece(worker, round_ % lanes, *share[round_]))
    return plan


class Dispatcher:
    """Sends one MoE layer's expert work to the workers and gathers the results."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.stats = DispatchStats()
        self._seq = 0
        self._turns: Counter[int] = Counter()  # calls per layer: copies take turns
        self.lookahead: Lookahead | None = None  # prefetch hints for workers that stream
        self._pace: dict[str, Pace] = {}  # by worker address
        self.piece_pairs = PIECE_PAIRS  # 0: every call's requests go whole
        self.lanes = LANES  # streams a worker's pieces are dealt over (1: one stream)
        # Hears (worker address, round trip, compute seconds) of each worker in each call:
        # `shoal serve`'s /metrics histograms.
        self.on_worker_timing: Callable[[str, float, float], None] | None = None

    def _pace_of(self, address: str) -> Pace:
        pace = self._pace.get(address)
        if pace is None:
            pace = self._pace[address] = Pace()
        return pace

    def next_owners(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """The worker the next call of `layer` sends each of `experts` to, when each comes
        once (a decode step): where a prefetch hint for them should go."""
        return spread(self.cluster.routes[layer], experts, self._turns[layer] + 1)

    def __call__(
        self, layer: int, x: mx.array, inds: mx.array, shared: SharedAhead | None = None
    ) -> mx.array:
        # The coordinator's own experts hold the whole layer in memory: mlx-lm's own call, lazy,
        # as in one process (coordinator/local_experts.py; the member is first when present).
        local = self.cluster.links[0] if self.cluster.links else None
        if isinstance(local, LocalExperts) and (out := local.whole(layer, x, inds)) is not None:
            return out
        before = time.perf_counter()
        mx.eval(x, inds)  # finish this layer's attention and router first: time only dispatch
        sync = time.perf_counter() - before
        for _ in range(MAX_ATTEMPTS - 1):
            self.cluster.refresh()
            try:
                return self._call(layer, x, inds, shared, sync)
            except _WorkerFailed as failed:
                self.cluster.lost(failed.worker, failed.error)
            except _StaleRoute as stale:
                self.cluster.reload(stale.worker)
        self.cluster.refresh()
        try:
            return self._call(layer, x, inds, shared, sync)
        except _WorkerFailed as failed:
            raise failed.error from None
        except _StaleRoute as stale:
            raise Unavailable(f"worker {self.cluster.links[stale.worker].address} kept "
                              "refusing experts its inventory lists") from None

    def _call(
        self, layer: int, x: mx.array, inds: mx.array, shared: SharedAhead | None, sync: float
    ) -> mx.array:
        started = time.perf_counter()
        *lead, k = inds.shape
        width = x.shape[-1]
        # x and inds are evaluated: reshape their buffers in numpy, not as new MLX graph nodes
        hidden = to_numpy(x).reshape(-1, width)
        experts = np.asarray(inds).reshape(-1).astype(np.int32, copy=False)
        # Experts with copies on several workers have their tokens dealt over the copies.
        turn = self._turns[layer] = self._turns[layer] + 1
        owner = spread(self.cluster.routes[layer], experts, turn)
        hints = {}
        if self.lookahead is not None:
            self.lookahead.score(layer, experts)
            hints = self.lookahead.hints(layer, x, k, self.next_owners, self.cluster.links)

        # where this call's figures are added (a failed attempt's parts stay counted there)
        stats = self.stats.slot(layer, decode=not lead or lead[-1] == 1)
        links = self.cluster.links
        lookahead = self.lookahead
        plan = plan_call(owner, k, piece_pairs=self.piece_pairs, lanes=self.lanes,
                         whole=lambda w: lookahead is not None and lookahead.streams(links[w]))
        pending = self._send(layer, x, hidden, experts, plan, hints, stats)
        stats.send_seconds += time.perf_counter() - started
        if shared is not None:
            before = time.perf_counter()
            shared.start(x)
            stats.shared_seconds += time.perf_counter() - before
        result, changed = self._gather(layer, pending, (*lead, k, width), stats)
        stats.calls += 1
        stats.sync_seconds += sync
        stats.requests += len(pending)
        stats.seconds += time.perf_counter() - started
        workers = {piece.worker for piece in plan}
        if len(plan) == len(workers):  # one request a worker (decode): the pass is over
            for worker in workers:
                links[worker].close_lanes()
        for link in changed:  # route the next call by what the workers hold now
            if link in self.cluster.links:
                self.cluster.reload(self.cluster.links.index(link))
        return result

    def _send(self, layer: int, x: mx.array, hidden: np.ndarray, experts: np.ndarray,
              plan: list[Piece], hints: dict, stats: LayerStats) -> list[tuple]:
        """Send the plan's requests (and the prefetch hints of members not in it); returns
        what is awaited, in the plan's order: (worker, lane, pairs, seq, when sent)."""
        wire_dtype = dtype_name(x.dtype)
        pending = []
        for piece in plan:
            worker, pairs = piece.worker, piece.pairs
            self._seq += 1
            link = self.cluster.links[worker]
            if isinstance(link, LocalExperts):  # the coordinator's own: MLX arrays, no bytes
                link.submit(layer, x, piece.needed, piece.rows, experts[pairs], experts.size,
                            self._seq, hints.pop(worker, None))  # computed when read
                self.stats.worker_requests[link.address] += 1
                pending.append((worker, 0, pairs, self._seq, time.perf_counter()))
                continue
            request = EXPERT_REQUEST.write(
                shoal_pb2.ExpertRequest(seq=self._seq, layer=layer,
                                        prefetch=hints.pop(worker, None),
                                        call_pairs=experts.size),
                hidden=(hidden[piece.needed], wire_dtype), rows=(piece.rows, "int32"),
                experts=(experts[pairs], "int32"),
            )
            pace = self._pace_of(link.address)
            try:
                link.send(request, piece.lane, timeout=pace.deadline(pairs.size))
            except Unavailable as e:  # an expert lane that cannot be opened or written
                for other, *_ in pending:
                    self.cluster.links[other].reset()  # their replies to this call are moot
                raise _WorkerFailed(worker, e) from None
            self.stats.worker_requests[link.address] += 1
            pending.append((worker, piece.lane, pairs, self._seq, time.perf_counter()))
            stats.bytes_sent += len(request)
        for worker, hint in hints.items():  # a hint alone gets no reply
            try:
                self.cluster.links[worker].send(
                    EXPERT_REQUEST.write(shoal_pb2.ExpertRequest(layer=layer, prefetch=hint)),
                    reply=False)
            except Unavailable:
                pass  # only a hint: the worker's next request will say whether it is lost
        return pending

    def _gather(self, layer: int, pending: list[tuple], shape: tuple[int, ...],
                stats: LayerStats) -> tuple[mx.array, list]:
        """Read every reply in `pending`'s order and put each pair's output back in its place:
        the (..., k, width) result, and the links whose worker's inventory changed; this
        call's worker and wire parts go into `stats`."""
        width = shape[-1]
        parts = []  # each reply's outputs, in the order of `pending`
        # by worker, over its pieces: first request sent, last reply read, seconds computing,
        # and each reply's timing
        first_sent: dict[int, float] = {}
        last_read: dict[int, float] = {}
        computing: dict[int, float] = {}
        timings: dict[int, list[shoal_pb2.WorkerTiming]] = {}
        parse_scatter = 0.0
        changed = []  # links whose worker's inventory changed since we fetched it
        for index, (worker, lane, pairs, seq, sent) in enumerate(pending):
            link = self.cluster.links[worker]
            pace = self._pace_of(link.address)
            try:
                if isinstance(link, LocalExperts):  # computed here, now: the others compute too
                    data, (reply, values, out_dtype) = b"", link.result()
                else:
                    data = link.receive(pace.deadline(pairs.size), lane)
            except (Unavailable, Moved) as e:
                for other, *_ in pending[index + 1:]:
                    self.cluster.links[other].reset()  # their replies to this call are moot
                if isinstance(e, Moved):
                    raise _StaleRoute(worker) from None
                raise _WorkerFailed(worker, e) from None
            received = time.perf_counter()
            if data:
                reply, tensors = EXPERT_REPLY.read(data, f"reply of {link.address}")
                output = tensors.get("output", WireView())
                values = decode(output, what=f"output of {link.address}", ndim=2)
                out_dtype = mlx_dtype(output.dtype)
            # a piece waits for its worker's pieces before it: time it from the last one's reply
            pace.observe(received - max(sent, last_read.get(worker, sent)), pairs.size)
            first_sent.setdefault(worker, sent)
            last_read[worker] = received
            timings.setdefault(worker, []).append(reply.timing)
            known = link.inventory.inventory_version if link.inventory is not None else 0
            if reply.inventory_version and known and reply.inventory_version != known:
                changed.append(link)
            if reply.seq != seq:
                raise ShoalError(f"worker {link.address} answered request {reply.seq}, not {seq}")
            if values.shape != (pairs.size, width):
                raise ShoalError(
                    f"worker {link.address} returned shape {values.shape} for layer {layer}, "
                    f"expected {(pairs.size, width)}"
                )
            parts.append(values)
            stats.bytes_received += len(data)
            stats.worker_compute_seconds += reply.compute_seconds
            computing[worker] = computing.get(worker, 0.0) + reply.compute_seconds
            parse_scatter += time.perf_counter() - received
        before = time.perf_counter()
        result = _put_back(parts, [pairs for _, _, pairs, *_ in pending], out_dtype,
                           one_worker=len({worker for worker, *_ in pending}) == 1)
        result = result.reshape(shape)
        done = time.perf_counter()
        stats.parse_scatter_seconds += parse_scatter + done - before
        # The critical worker: the longest from its first request sent to its last reply read.
        critical = max(first_sent, key=lambda w: last_read[w] - first_sent[w])
        stats.wire_seconds += last_read[critical] - first_sent[critical] - computing[critical]
        for timing in timings[critical]:
            stats.worker_parse_seconds += timing.parse
            stats.worker_matrix_seconds += timing.matrix
            stats.worker_bookkeeping_seconds += timing.bookkeeping
            stats.worker_reads_seconds += timing.reads
            stats.worker_reply_seconds += timing.reply
            stats.worker_waited_seconds += timing.waited
        stats.slowest_compute_seconds += max(computing.values())
        if self.on_worker_timing is not None:
            for worker, sent in first_sent.items():
                self.on_worker_timing(self.cluster.links[worker].address,
                                      last_read[worker] - sent, computing[worker])
        return result, changed




class SharedAhead(nn.Module):
    """Takes the place of a MoE block's shared expert so that the dispatcher can compute it
    early, while the workers compute; the block's own call then receives that result.

    Whether that is valid is learned, not assumed: only once the block has been seen to pass
    its shared expert the very array it passed the switch (Kimi K3 passes the switch a latent
    projection instead, and some blocks call the shared expert first) is it computed ahead,
    and each later call still checks `x is` the array computed ahead. The same module runs on
    the same input either way, so the result is bit-identical.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.valid: bool | None = None  # None until the block's first call shows it
        self._switch_input: mx.array | None = None
        self._ahead: tuple[mx.array, mx.array] | None = None

    def start(self, x: mx.array) -> None:
        """The switch was called on `x`: compute the shared expert on it now, if valid."""
        self._switch_input = x
        if not self.valid:
            return
        if self._ahead is not None and self._ahead[0] is x:  # a retried call: already done
            return
        y = self.inner(x)
        # Started, not waited for: the device computes it while this thread goes on to read
        # the replies (docs/benchmarks.md, "Figures behind choices in the code").
        mx.async_eval(y)
        self._ahead = (x, y)

    def __call__(self, x: mx.array) -> mx.array:
        switch_input, self._switch_input = self._switch_input, None
        if self.valid is None:
            self.valid = switch_input is not None and x is switch_input
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] is x:
            return ahead[1]
        return self.inner(x)


SHARED_EXPERT_NAMES = ("shared_experts", "shared_expert")  # as mlx-lm's MoE blocks call it


class RemoteSwitch(nn.Module):
    """Takes the place of one MoE block's `switch_mlp`; holds no weights."""

    def __init__(
        self, layer: int, dispatcher: Dispatcher, shared: SharedAhead | None = None
    ) -> None:
        super().__init__()
        self.layer = layer
        self.dispatcher = dispatcher
        self._shared = [shared]  # in a list: not a child module, its weights stay the block's

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return self.dispatcher(self.layer, x, indices, self._shared[0])


def install(model: nn.Module, manifest: Manifest, dispatcher: Dispatcher) -> None:
    """Replace every routed-expert switch module in `model` with a RemoteSwitch, and the
    block's shared expert, where it has one, with a SharedAhead."""
    for layer in manifest.layers:
        parent_path, name = layer.path.rsplit(".", 1)
        block = get_module(model, parent_path)
        shared = None
        for shared_name in SHARED_EXPERT_NAMES:
            inner = getattr(block, shared_name, None)
            if isinstance(inner, nn.Module):
                shared = SharedAhead(inner)
                setattr(block, shared_name, shared)
                break
        original = getattr(block, name)
        remote = RemoteSwitch(layer.layer, dispatcher, shared)
        for child, module in original.children().items():
            # what the block hung on the switch besides its linears and activation (a norm
            # it applies after the combination) stays here, with its dense weights
            if isinstance(module, nn.Module) and not isinstance(module, SWITCH_LINEARS) \
                    and child != "activation":
                setattr(remote, child, module)
        setattr(block, name, remote)


def _put_back(parts: list[np.ndarray | mx.array], pairs: list[np.ndarray], dtype: mx.Dtype,
              *, one_worker: bool) -> mx.array:
    """A layer call's outputs, (pairs, width), each pair in its place: `parts` are the replies
    in the order they were sent (host arrays from workers, MLX arrays from the coordinator's own
    experts), `pairs` the call's pair indices each reply answers. Workers' replies alone are put
    in place on the host and enter MLX as one array; beside the coordinator's own (MLX arrays,
    which stay where they are) they enter through one buffer with the gather index."""
    host = [part for part in parts if isinstance(part, np.ndarray)]
    if len(host) == len(parts):  # every reply from a worker: put in place on the host
        if one_worker or len(parts) == 1:  # one worker's pieces, in order
            return to_mlx((parts, dtype))[0]
        values = np.empty((sum(part.shape[0] for part in parts), parts[0].shape[1]),
                          parts[0].dtype)
        for part, at in zip(parts, pairs, strict=True):
            values[at] = part
        return to_mlx(([values], dtype))[0]
    places = np.argsort(np.concatenate(pairs)).astype(np.int32)
    if not host:
        values = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        return values if one_worker else values[mx.array(places)]
    arrived, index = to_mlx((host, dtype), ([places], mx.int32))
    if len(host) < len(parts):  # the coordinator's own outputs, in their turn
        at, pieces = 0, []
        for part in parts:
            if isinstance(part, np.ndarray):
                pieces.append(arrived[at:at + part.shape[0]])
                at += part.shape[0]
            else:
                pieces.append(part)
        arrived = mx.concatenate(pieces)
    return arrived if one_worker else arrived[index]

