"""One request's hold on its cached experts: taken as their reads complete, given back once
computed, so the cache neither evicts them meanwhile nor waits for them longer than needed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import mlx.core as mx
import numpy as np

from engine.errors import ShoalError


class Held(Protocol):
    """An expert a lease holds, as the cache keeps it (`worker/cache.py`'s entry): its load's
    state, its decoded tensors until they are copied into its slot (-1 without a SlotPool)."""

    index: int
    state: int
    tensors: dict[str, mx.array] | None
    slot: int
    error: ShoalError | None


class Holder(Protocol):
    """What a lease asks of the cache that lent it (`worker/cache.py`'s `ExpertCache`)."""

    def take(self, lease: Lease) -> list[int]: ...
    def give_back(self, lease: Lease, positions: Iterable[int]) -> None: ...
    def end(self, lease: Lease) -> None: ...


class Lease:
    """One request's hold on its experts: take them as they become ready, then give them back.
    The cache keeps the fields; the request only calls the three methods."""

    def __init__(self, cache: Holder, idx: np.ndarray) -> None:
        self.cache = cache
        self.idx = idx
        self.pending: list[int] = []  # positions whose load could not start yet (no room)
        self.held: dict[int, Held] = {}
        self.taken = [False] * len(idx)

    def take(self) -> list[int]:
        """Block until some of the experts are ready; the positions of those not yet taken."""
        return self.cache.take(self)

    def tensors(self, pos: int) -> dict[str, mx.array]:
        """A taken expert's decoded tensors (a cache without a SlotPool keeps them so)."""
        return self.held[pos].tensors

    def slots(self, positions: np.ndarray) -> np.ndarray:
        """The slots of taken experts, once installed (`ExpertCache.install`)."""
        return np.array([self.held[pos].slot for pos in positions.tolist()], dtype=np.int32)

    def done(self, positions: Iterable[int]) -> None:
        """The experts at `positions` are computed: they may be evicted now."""
        self.cache.give_back(self, positions)

    def close(self) -> None:
        """Give back every expert still held (the request ended, computed or failed)."""
        self.cache.end(self)
