"""The remote switch: stands in for each MoE block's `switch_mlp(x, inds)` and runs one layer
call over the members' experts: plan it, submit every share (workers first), collect in a
fixed order; a member lost mid-call is routed around, a moved expert re-read (placement.md)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from coordinator.cluster.snapshot import Cluster, Snapshot
from coordinator.dataplane.cache_guess import CacheGuess
from coordinator.dataplane.call_plan import (
    CHANNELS,
    LARGE_CALL,
    PIECE_PAIRS,
    plan_call,
    put_back,
    spread,
)
from coordinator.dataplane.dispatch_stats import DispatchStats, LayerStats
from coordinator.dataplane.hosts import ExpertHost, LayerCall, Share
from coordinator.dataplane.link import FIRST_REPLY_TIMEOUT, MIN_REPLY_TIMEOUT
from coordinator.dataplane.lookahead import Lookahead
from coordinator.dataplane.merged_calls import MergedCalls
from engine.errors import Moved, ShoalError, Unavailable
from engine.manifest import Manifest
from engine.moe_layers import SWITCH_LINEARS, get_module
from worker.residency import Timing

MAX_ATTEMPTS = 3  # per layer call: a lost worker is routed around at most this often


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


class Dispatcher:
    """Sends one MoE layer's expert work to the members and gathers the results."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.stats = DispatchStats()
        self._seq = 0
        self._turns: Counter[int] = Counter()  # calls per layer: copies take turns
        self.lookahead: Lookahead | None = None  # prefetch hints for members that stream
        # what streaming members probably hold in memory; with it, each expert goes to the
        # copy that holds it, else whose drive ends soonest (cache_guess.py)
        self.guess: CacheGuess | None = None
        self._pace: dict[str, Pace] = {}  # by member address
        self.piece_pairs = PIECE_PAIRS  # 0: every call's requests go whole
        self.channels = CHANNELS  # channels a worker's pieces are dealt over (1: one)
        # Hears (member address, round trip, compute seconds) of each member in each call:
        # `shoal serve`'s /metrics histograms.
        self.on_worker_timing: Callable[[str, float, float], None] | None = None
        self._members: Snapshot | None = None  # the snapshot the last call used
        self._whole: Callable | None = None  # the first member's in-graph call, if any
        # Called between a call's requests and its replies (a pipelined prompt pass hands
        # over to its next chunk there: coordinator/decoding/pipelined_prefill.py).
        self.between: Callable[[], None] | None = None
        # Forwards on several threads whose layer calls go together (serve's decode step
        # and a prompt piece: coordinator/server/prefill_overlap.py).
        self.merged: MergedCalls | None = None

    def _pace_of(self, address: str) -> Pace:
        pace = self._pace.get(address)
        if pace is None:
            pace = self._pace[address] = Pace()
        return pace

    def next_owners(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """The member the next call of `layer` sends each of `experts` to, when each comes
        once (a decode step): where a prefetch hint for them should go."""
        return self._owners(self.cluster.current, layer, experts, self._turns[layer] + 1)

    def _owners(self, members: Snapshot, layer: int, experts: np.ndarray,
                turn: int) -> np.ndarray:
        if self.guess is None:
            return spread(members.routes[layer], experts, turn)
        return self.guess.owners(members, layer, experts, turn)

    def _members_now(self) -> Snapshot:
        """The members' snapshot for this call: the Cluster's current one, adopted between
        calls when it changed (every channel reopens at its next use: a worker that stopped
        and came back is in both sets, and its old channel still holds its stop's error)."""
        members = self.cluster.current
        if members is not self._members:
            old = self._members.links if self._members is not None else ()
            for host in {*old, *members.links}:
                host.reset()
            first = members.links[0] if members.links else None
            self._whole = first.whole if first is not None and first.in_process else None
            self._members = members
        if members.missing:
            raise Unavailable(members.missing)
        return members

    def __call__(
        self, layer: int, x: mx.array, inds: mx.array, shared: SharedAhead | None = None
    ) -> mx.array:
        members = self._members_now()
        # The coordinator's own experts hold the whole layer in memory: mlx-lm's own call, lazy,
        # as in one process (dataplane/local_experts.py; the member is first when present).
        if self._whole is not None and not (self.guess and self.guess.deals(members, layer)) \
                and (out := self._whole_call(layer, x, inds)) is not None:
            return out
        before = time.perf_counter()
        mx.eval(x, inds)  # finish this layer's attention and router first: time only dispatch
        sync = time.perf_counter() - before
        if self.merged is not None and self.merged.taking_part_now():
            return self.merged.call(layer, x, inds, lambda at, rows, picks: self._remote(
                self._members_now(), at, rows, picks, None, sync))
        return self._remote(members, layer, x, inds, shared, sync)

    def _remote(self, members: Snapshot, layer: int, x: mx.array, inds: mx.array,
                shared: SharedAhead | None, sync: float) -> mx.array:
        """One layer call to the members; a lost member routed around, a moved expert re-read."""
        attempts = 1
        while True:  # a lost member is routed around, a moved expert re-read: MAX_ATTEMPTS
            try:
                return self._call(members, layer, x, inds, shared, sync)
            except _WorkerFailed as failed:
                if attempts == MAX_ATTEMPTS:
                    raise failed.error from None
                self.cluster.lost(failed.worker, failed.error)
            except _StaleRoute as stale:
                if attempts == MAX_ATTEMPTS:
                    raise Unavailable(f"worker {members.links[stale.worker].address} kept "
                                      "refusing experts its inventory lists") from None
                self.cluster.reload(stale.worker)
            attempts += 1
            members = self._members_now()

    def _whole_call(self, layer: int, x: mx.array, inds: mx.array) -> mx.array | None:
        """The own experts' whole-layer call; one under a memory budget (its picks evaluated,
        its misses read) is timed as a dispatched call is: sync, reads, the rest bookkeeping."""
        before, timing = time.perf_counter(), Timing()
        out = self._whole(layer, x, inds, timing)
        if out is None:
            return None
        self.stats.whole_calls += 1
        if timing.sync > 0:  # a resident layer's call stays lazy: nothing of it to time
            seconds = time.perf_counter() - before - timing.sync
            stats = self.stats.slot(layer, decode=inds.ndim < 2 or inds.shape[-2] == 1)
            stats.calls += 1
            stats.sync_seconds += timing.sync
            stats.seconds += seconds
            stats.worker_reads_seconds += timing.reads
            stats.worker_bookkeeping_seconds += seconds - timing.reads
        return out

    def _call(self, members: Snapshot, layer: int, x: mx.array, inds: mx.array,
              shared: SharedAhead | None, sync: float) -> mx.array:
        started = time.perf_counter()
        *lead, k = inds.shape
        width = x.shape[-1]
        experts = np.asarray(inds).reshape(-1).astype(np.int32, copy=False)
        # Experts with copies on several members have their tokens dealt over the copies
        # (where members stream, each expert to one copy: cache_guess.py).
        turn = self._turns[layer] = self._turns[layer] + 1
        owner = self._owners(members, layer, experts, turn)
        hosts = members.links
        if self.guess is not None:
            self.guess.given(hosts, layer, experts, owner)
        hints = {}
        if self.lookahead is not None:
            self.lookahead.score(layer, experts)
            hints = self.lookahead.hints(layer, x, k, self.next_owners, hosts)
            if self.guess is not None:  # a hinted member reads them into memory
                for worker, hint in hints.items():
                    self.guess.sent(hosts[worker], hint.layer, hint.experts)

        # where this call's figures are added (a failed attempt's parts stay counted there)
        stats = self.stats.slot(layer, decode=not lead or lead[-1] == 1)
        lookahead = self.lookahead
        plan = plan_call(owner, k, piece_pairs=self.piece_pairs, channels=self.channels,
                         whole=lambda w: lookahead is not None and lookahead.streams(hosts[w]))
        call = LayerCall(layer, x, experts)
        shares = []
        for piece in plan:
            self._seq += 1
            shares.append((piece.worker, Share(call, self._seq, piece.channel, piece.pairs,
                                               piece.needed, piece.rows,
                                               hints.pop(piece.worker, None))))
        sent = self._submit(hosts, shares, hints, stats)
        stats.send_seconds += time.perf_counter() - started
        if shared is not None:
            before = time.perf_counter()
            shared.start(x)
            stats.shared_seconds += time.perf_counter() - before
        if self.between is not None:
            self.between()
        result, changed = self._gather(hosts, shares, sent, (*lead, k, width), stats)
        stats.calls += 1
        stats.sync_seconds += sync
        stats.requests += len(shares)
        stats.seconds += time.perf_counter() - started
        workers = {worker for worker, _ in shares}
        # one request a member (decode): the pass is over, unless a pipelined pass's next
        # chunk has requests out on the other channels
        if len(shares) == len(workers) and self.between is None:
            for worker in workers:
                hosts[worker].end_pass()
        for host in changed:  # route the next call by what the members hold now
            if host in self.cluster.current.links:
                self.cluster.reload(self.cluster.current.links.index(host))
        return result

    def _submit(self, hosts: tuple[ExpertHost, ...], shares: list[tuple[int, Share]],
                hints: dict, stats: LayerStats) -> dict[int, float]:
        """Submit every share, the workers' before the in-process ones (theirs travel while
        ours computes), and the prefetch hints of members not in the call; returns when each
        share went, by seq."""
        sent = {}
        order = sorted(range(len(shares)), key=lambda i: hosts[shares[i][0]].in_process)
        for index in order:
            worker, share = shares[index]
            host = hosts[worker]
            try:
                stats.bytes_sent += host.submit(
                    share, self._pace_of(host.address).deadline(share.pairs.size))
            except (Unavailable, Moved) as e:
                for other, _ in shares:
                    hosts[other].reset()  # their replies to this call are moot
                if isinstance(e, Moved):
                    raise _StaleRoute(worker) from None
                raise _WorkerFailed(worker, e) from None
            self.stats.worker_requests[host.address] += 1
            sent[share.seq] = time.perf_counter()
        for worker, hint in hints.items():  # a hint alone gets no reply
            try:
                hosts[worker].hint(hint.layer, hint)
            except Unavailable:
                pass  # only a hint: the member's next request will say whether it is lost
        return sent

    def _gather(self, hosts: tuple[ExpertHost, ...], shares: list[tuple[int, Share]],
                sent: dict[int, float], shape: tuple[int, ...], stats: LayerStats
                ) -> tuple[mx.array, list[ExpertHost]]:
        """Collect every share's outputs in `shares`' order and put each pair's back in its
        place: the (..., k, width) result, and the members whose inventory changed; this
        call's member and wire parts go into `stats`."""
        width = shape[-1]
        parts = []
        # by member, over its shares: first sent, last read, seconds computing, timings
        first_sent: dict[int, float] = {}
        last_read: dict[int, float] = {}
        computing: dict[int, float] = {}
        timings: dict[int, list] = {}
        parse_scatter = 0.0
        changed = []
        for index, (worker, share) in enumerate(shares):
            host = hosts[worker]
            pace = self._pace_of(host.address)
            try:
                answer = host.collect(share, pace.deadline(share.pairs.size))
            except (Unavailable, Moved) as e:
                for other, _ in shares[index + 1:]:
                    hosts[other].reset()  # their replies to this call are moot
                if isinstance(e, Moved):
                    raise _StaleRoute(worker) from None
                raise _WorkerFailed(worker, e) from None
            received = time.perf_counter()
            reply, values = answer.reply, answer.values
            went = sent[share.seq]
            # a share waits for its member's shares before it: time it from the last reply
            pace.observe(received - max(went, last_read.get(worker, went)), share.pairs.size)
            first_sent.setdefault(worker, went)
            last_read[worker] = received
            timings.setdefault(worker, []).append(reply.timing)
            known = host.inventory.inventory_version if host.inventory is not None else 0
            if reply.inventory_version and known and reply.inventory_version != known \
                    and host not in changed:
                changed.append(host)
            if reply.seq != share.seq:
                raise ShoalError(f"member {host.address} answered request {reply.seq}, "
                                 f"not {share.seq}")
            if tuple(values.shape) != (share.pairs.size, width):
                raise ShoalError(
                    f"member {host.address} returned shape {tuple(values.shape)} for layer "
                    f"{share.call.layer}, expected {(share.pairs.size, width)}")
            parts.append(values)
            stats.bytes_received += answer.received
            stats.worker_compute_seconds += reply.compute_seconds
            computing[worker] = computing.get(worker, 0.0) + reply.compute_seconds
            parse_scatter += time.perf_counter() - received
        before = time.perf_counter()
        result = put_back(parts, [share.pairs for _, share in shares], answer.dtype,
                          one_worker=len(first_sent) == 1).reshape(shape)
        done = time.perf_counter()
        stats.parse_scatter_seconds += parse_scatter + done - before
        self._note_members(hosts, shares, first_sent, last_read, computing, timings, stats)
        return result, changed

    def _note_members(self, hosts, shares, first_sent, last_read, computing, timings,
                      stats: LayerStats) -> None:
        """Each member's round trip and path; the critical member's parts (the longest from
        its first request sent to its last reply read) for the call's breakdown."""
        for worker, went in first_sent.items():
            host = hosts[worker]
            member = self.stats.member(host.address, host.path)
            member.calls += 1
            member.requests += sum(1 for w, _ in shares if w == worker)
            member.seconds += last_read[worker] - went
            if self.on_worker_timing is not None:
                self.on_worker_timing(host.address, last_read[worker] - went, computing[worker])
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
        # the replies.
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
