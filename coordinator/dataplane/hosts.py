"""One interface for a member's experts, however they are reached (`ExpertHost`): in this
process (coordinator/dataplane/local_experts.py) or on a worker over its expert lane or gRPC
(coordinator/dataplane/link.py); and the shares of a layer call that the dispatcher hands them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol, TypeVar

import mlx.core as mx
import numpy as np

from engine.errors import ShoalError
from engine.tensors import dtype_name, to_numpy
from proto import shoal_pb2
from worker.residency import Timing

IN_PROCESS, LANE_PATH, GRPC_PATH = "in process", "lane", "grpc"  # how a share travels


@dataclass(eq=False)
class LayerCall:
    """What every share of one layer call reads: the switch input `x` (evaluated) and each
    (token, slot) pair's expert, flattened; the hidden rows on the host once a share needs
    them (a worker's request carries them as bytes, in the model's activation dtype)."""

    layer: int
    x: mx.array
    experts: np.ndarray

    @cached_property
    def hidden(self) -> np.ndarray:
        return to_numpy(self.x).reshape(-1, self.x.shape[-1])

    @cached_property
    def wire_dtype(self) -> str:
        return dtype_name(self.x.dtype)


@dataclass(frozen=True, eq=False)
class Share:
    """One request of a layer call to one member, on its channel `channel`: the call's pairs
    `pairs` (ascending indices into its flattened pairs), the tokens whose hidden rows it
    needs (`needed`) and each pair's row among them (`rows`), and a prefetch hint, if any."""

    call: LayerCall
    seq: int
    channel: int
    pairs: np.ndarray
    needed: slice | np.ndarray
    rows: np.ndarray
    hint: shoal_pb2.PrefetchHint | None = None

    @property
    def experts(self) -> np.ndarray:
        return self.call.experts[self.pairs]


@dataclass(frozen=True)
class Answer:
    """A member's outputs for one share, (pairs, width): host values from a worker's reply,
    an MLX array from this process; the reply's timing and inventory version; bytes read."""

    reply: shoal_pb2.ExpertReply
    values: np.ndarray | mx.array
    dtype: mx.Dtype
    received: int = 0


class ExpertHost(Protocol):
    """A member's experts. The dispatcher submits every share of a call before it collects any,
    those of hosts `in_process` last (they compute on this device while the others' travel),
    and collects them in a fixed order. Raises Unavailable (lost) or Moved (an expert left)."""

    address: str
    inventory: shoal_pb2.Inventory | None
    in_process: bool

    @property
    def path(self) -> str:
        """How its shares travel (IN_PROCESS, LANE_PATH, GRPC_PATH), for --stats."""
        ...

    def whole(self, layer: int, x: mx.array, inds: mx.array,
              timing: Timing | None = None) -> mx.array | None:
        """The layer's call as mlx-lm's own module makes it, lazily, when every expert of the
        layer is held here in memory, or, under a memory budget, once the missing ones are read
        (their picks' evaluation and the waits for reads go in `timing`); else None."""
        ...

    def submit(self, share: Share, timeout: float) -> int:
        """Start a share (bytes written, 0 in process); `timeout`: seconds to take it."""
        ...

    def collect(self, share: Share, timeout: float) -> Answer: ...

    def hint(self, layer: int, hint: shoal_pb2.PrefetchHint) -> None:
        """Start reads of experts the next call will probably use; no answer."""
        ...

    def end_pass(self) -> None:
        """A call's replies are all read: let go of what a prompt pass's pieces opened."""
        ...

    def reset(self) -> None:
        """Abandon what is owed (a call being redone); the next share starts afresh."""
        ...

    def fetch_inventory(self, timeout: float = ...) -> shoal_pb2.Inventory: ...

    def fetch_stats(self, timeout: float = ...) -> shoal_pb2.WorkerStats: ...

    def call(self, method: str, request, *, timeout: float | None = ...): ...

    def check_health(self, timeout: float) -> float: ...

    def close(self) -> None: ...


H = TypeVar("H", bound=ExpertHost)


def fresh_inventories(hosts: Iterable[H]) -> dict[H, shoal_pb2.Inventory]:
    """What each of `hosts` holds, asked now, for a member that gave up an expert another took
    in; one that does not answer is left out (its liveness is the members' checks to judge)."""
    found = {}
    for host in hosts:
        try:
            found[host] = host.fetch_inventory()
        except ShoalError:
            continue
    return found
