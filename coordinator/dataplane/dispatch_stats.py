"""What `--stats` reads of the dispatcher: each layer's figures, decode calls apart from
prompt passes, and each member's path and round trip."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


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
        self.members: dict[str, MemberStats] = {}  # by address
        # layer calls run by the coordinator's own experts as mlx-lm's own module (every
        # expert of the layer resident here): no request, no round trip
        self.whole_calls = 0

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

    def member(self, address: str, path: str) -> MemberStats:
        """Where a call adds one member's figures (its path as it was then)."""
        stats = self.members.get(address)
        if stats is None or stats.path != path:
            stats = self.members[address] = MemberStats(path)
        return stats

    def reset(self) -> None:
        self._slots.clear()
        self.worker_requests.clear()
        self.members.clear()
        self.whole_calls = 0


@dataclass
class MemberStats:
    """One member's part in the calls it took part in: how its shares travelled (in process,
    lane, grpc), how many calls and requests, and its round trips (first request sent to last
    reply read) summed."""

    path: str
    calls: int = 0
    requests: int = 0
    seconds: float = 0.0

    def report(self) -> dict:
        calls = max(self.calls, 1)
        return {"path": self.path, "calls": self.calls, "requests": self.requests,
                "round_trip_us": 1e6 * self.seconds / calls}
