"""Planning a layer call, pure functions over its routing: which member computes each
(token, expert) pair (`spread`; `spread_reads` where members stream), the requests that carry
them (`plan_call`), and the members' outputs put back in the pairs' order (`put_back`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.placement import LayerRoutes
from engine.tensors import to_mlx

LARGE_CALL = 64  # (token, expert) pairs from which a call's time is mostly per pair
# A worker's share of a prompt pass goes as pieces of about this many pairs, which it computes
# one after the other while the next arrives and the last's reply leaves (the size chosen by
# measurement; git keeps the report). The bits are the same: the worker pads and sorts by the
# whole call's pair count, and each pair's output does not depend on its call (in the tests).
PIECE_PAIRS = 512
# and those pieces are dealt over this many channels per worker, each a connection of its own,
# so that their transfers overlap.
CHANNELS = 4


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


def spread_reads(routes: LayerRoutes, experts: np.ndarray, warm: Callable[[int, int], bool],
                 read_seconds: Sequence[float] | None = None, turn: int = 0) -> np.ndarray:
    """The member that computes each (token, expert) pair of one layer call when members read
    experts from their drives: every pair of an expert goes to one copy (two would read it
    twice), one that probably holds it in memory (`warm(member, expert)`), else the one whose
    drive would end this call's reads soonest (`read_seconds[member]` a read, default 1: a
    layer's experts have one shape). Experts with fewer copies choose first; ties go round
    the copies by `turn`. Any copy gives the same result, so this changes who reads, not what."""
    experts = np.asarray(experts)
    if not routes.replicated:  # no expert has a second copy: nothing to choose
        return routes.copies[experts, 0]
    distinct = np.unique(experts).tolist()
    counts = routes.counts.tolist()
    queued: dict[int, float] = {}  # member -> seconds of reads this call gives its drive
    chosen = np.full(routes.copies.shape[0], -1, dtype=routes.copies.dtype)
    for expert in sorted(distinct, key=lambda e: (counts[e], e)):
        copies = routes.copies[expert, :max(counts[expert], 1)].tolist()
        turned = copies[(turn + expert) % len(copies):] + copies[:(turn + expert) % len(copies)]
        warmed = [m for m in turned if warm(m, expert)]
        if warmed:  # no read: the copy with the least reads to wait for computes it
            member = min(warmed, key=lambda m: queued.get(m, 0.0))
        else:
            member = min(turned, key=lambda m: queued.get(m, 0.0) + (
                1.0 if read_seconds is None else read_seconds[m]))  # the first of equals
            queued[member] = queued.get(member, 0.0) + (
                1.0 if read_seconds is None else read_seconds[member])
        chosen[expert] = member
    return chosen[experts]


def rows_of(tokens: np.ndarray) -> slice | np.ndarray:
    """Ascending token indices as a slice where they are a run (a view of the hidden states,
    not a copy), else as they are."""
    if tokens.size and tokens[-1] - tokens[0] + 1 == tokens.size:
        return slice(int(tokens[0]), int(tokens[-1]) + 1)
    return tokens


@dataclass(frozen=True)
class Piece:
    """One request of a layer call: to `worker`, on its channel `channel`, for the call's pairs
    `pairs` (indices into its flattened (token, slot) pairs, ascending), carrying the hidden
    rows `needed` of the call's tokens and each pair's row among them (`rows`)."""

    worker: int
    channel: int
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
        return [(pairs, rows_of(needed), rows)]
    cuts = np.searchsorted(rows, np.arange(1, count) * needed.size // count).tolist()
    out = []
    for lo, hi in zip([0, *cuts], [*cuts, pairs.size], strict=True):
        start, stop = int(rows[lo]), int(rows[hi - 1]) + 1
        out.append((pairs[lo:hi], rows_of(needed[start:stop]), rows[lo:hi] - start))
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


def plan_call(owner: np.ndarray, k: int, *, piece_pairs: int, channels: int,
              whole: Callable[[int], bool] = lambda worker: False) -> list[Piece]:
    """The requests of one layer call whose pair i goes to worker `owner[i]`, in the order
    they are sent: every worker's first piece first, workers ascending (the fixed order the
    replies are then read in), a worker's pieces dealt over its `channels`. A worker for which
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
                plan.append(Piece(worker, round_ % channels, *share[round_]))
    return plan


def put_back(parts: list[np.ndarray | mx.array], pairs: list[np.ndarray], dtype: mx.Dtype,
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
