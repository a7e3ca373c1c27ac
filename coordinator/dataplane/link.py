"""One worker as the coordinator reaches it (`WorkerLink`, an ExpertHost): its gRPC channel
(inventory, counters, heat, files, health) and its Compute channels; the handshake that says
whether it can serve this model; the transports (`Transport`)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.dataplane.compute_channels import LaneChannel, LaneRefused, StreamChannel
from coordinator.dataplane.hosts import GRPC_PATH, LANE_PATH, Answer, Share
from coordinator.dataplane.link_errors import (
    HEALTH,
    INVENTORY,
    STATS,
    error_for,
    incompatibility,
)
from engine.auth import HEALTH_CHECK, METADATA_KEY, UNBOUND_METHODS, Secret, make_credential
from engine.errors import ShoalError, Unavailable
from engine.manifest import Manifest
from engine.tensors import mlx_dtype
from proto import (
    EXPERT_REPLY,
    EXPERT_REQUEST,
    GRPC_OPTIONS,
    SERVICE,
    secure_channel,
    shoal_pb2,
    shoal_pb2_grpc,
)
from proto.wire import WireView, decode

CONNECT_TIMEOUT = 10.0
IDENTITY_CHECK_TIMEOUT = 2.0  # the health check before an inventory (TLS identity refused?)
# Until a link has measured its round trips, a reply may take this long (a first prefill
# chunk on a slow CPU worker, compiling its kernels); afterwards see dispatch.py's `Pace`.
FIRST_REPLY_TIMEOUT = 120.0
MIN_REPLY_TIMEOUT = 1.5  # above a busy 2-core machine's hiccups; a hung worker costs this
KEEPALIVE = [  # pings every 10 s on idle links, 5 s to answer one
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# gRPC backs off up to 2 minutes between reconnects by default; a worker that comes back
# should be taken in again within a second or two.
_LINK_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    *KEEPALIVE,
]
def handshake(
    link: WorkerLink, manifest: Manifest | None, timeout: float
) -> tuple[shoal_pb2.Inventory, str | None]:
    """Ask a worker what it holds: its inventory, and why it cannot serve this model (or
    None). Raises Unavailable or Unauthenticated when it does not answer."""
    inventory = link.fetch_inventory(timeout)
    return inventory, incompatibility(link.address, inventory.protocol_version,
                                      inventory.fingerprint, manifest)


def request_bytes(share: Share) -> bytes:
    """A share as the ExpertRequest a worker reads (proto.EXPERT_REQUEST)."""
    call = share.call
    return EXPERT_REQUEST.write(
        shoal_pb2.ExpertRequest(seq=share.seq, layer=call.layer, prefetch=share.hint,
                                call_pairs=call.experts.size),
        hidden=(call.hidden[share.needed], call.wire_dtype), rows=(share.rows, "int32"),
        experts=(share.experts, "int32"),
    )


def answer_of(data: bytes, address: str) -> Answer:
    """A worker's ExpertReply bytes as the share's Answer (its outputs on the host)."""
    reply, tensors = EXPERT_REPLY.read(data, f"reply of {address}")
    output = tensors.get("output", WireView())
    values = decode(output, what=f"output of {address}", ndim=2)
    return Answer(reply, values, mlx_dtype(output.dtype), len(data))


TRANSPORTS = ("lane", "grpc")  # how Compute's messages travel: docs/protocol.md


@dataclass(frozen=True)
class Transport:
    """How a coordinator's links carry Compute: `kind` one of TRANSPORTS; `spin` seconds an
    expert lane watches its socket busily for a reply before it blocks (0: it blocks at once)."""

    kind: str = "lane"
    spin: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in TRANSPORTS:
            raise ShoalError(f"unknown transport {self.kind!r}: one of {', '.join(TRANSPORTS)}")
        if not 0 <= self.spin <= 0.1:
            raise ShoalError(f"--spin-us must be 0-100000, got {self.spin * 1e6:g}")

    def link(self, address: str, secret: Secret) -> WorkerLink:
        return WorkerLink(address, secret, self.kind, self.spin)


LANE = Transport()  # the default: expert lanes, no spin


class WorkerLink:
    """One worker: its gRPC channel (the control plane), its inventory, and the Compute
    channels to it, as an ExpertHost (hosts.py). With the `lane` transport (the
    default) each channel is an expert lane (`LaneChannel`); with `grpc`, to a worker that
    serves no lane, or whose lane cannot be opened, a gRPC Compute stream (`StreamChannel`:
    channel 0 on the link's own gRPC channel, the others each on a connection of its own).
    Channels beyond the first carry a prompt pass's pieces."""

    def __init__(self, address: str, secret: Secret, transport: str = "lane",
                 spin: float = 0.0) -> None:
        """`transport` and `spin` come from a Transport, which checks them (Transport.link)."""
        self.address = address
        self.transport = transport
        self.spin = spin  # seconds a lane watches its socket busily before blocking on a reply
        self.secret = secret
        self._channel = secure_channel(address, secret.require_identity(), _LINK_OPTIONS)
        self._stub = shoal_pb2_grpc.ExpertServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        # bytes both ways: messages are written and read by proto.EXPERT_REQUEST / EXPERT_REPLY
        self._channels: list[LaneChannel | StreamChannel] = []
        self.lane_refused = ""  # why its expert lane could not be opened: Compute on gRPC
        self.inventory: shoal_pb2.Inventory | None = None
        # where the expert lane is reached when not at the worker's own host and the port its
        # inventory names (a relay between: benchmarks/network.py)
        self.lane_address: str | None = None

    @property
    def uses_lane(self) -> bool:
        """Whether Compute's messages go on expert lanes: asked for, and the worker has one."""
        return (self.transport == "lane" and not self.lane_refused
                and self.inventory is not None and self.inventory.lane_port > 0)

    def lane_endpoint(self) -> tuple[str, int]:
        """The worker's expert lane: its gRPC host, the port its inventory names."""
        if self.lane_address is not None:
            host, _, port = self.lane_address.rpartition(":")
            return host.strip("[]"), int(port)
        host = self.address.rpartition(":")[0].strip("[]")
        return host, self.inventory.lane_port

    @property
    def connections(self) -> int:
        """Connections opened to the worker for Compute: the link's own channel (gRPC's lane
        0), and one per further lane (each expert lane is one)."""
        return max(len(self._channels), 1)

    def metadata(self, method: str) -> list[tuple[str, str]]:
        """A call's credential, bound to this worker's node id, which every call but the
        inventory needs: the inventory (the node id) is fetched first if not known yet."""
        path = f"/shoal.v1.ExpertService/{method}"
        if self.inventory is None and path not in UNBOUND_METHODS:
            self.fetch_inventory()
        return [(METADATA_KEY, make_credential(self.secret, path, node=self.node_id))]

    @property
    def node_id(self) -> str:
        """The worker's node id, once its inventory was fetched ("" before)."""
        return self.inventory.node_id if self.inventory is not None else ""

    def fetch_inventory(self, timeout: float = CONNECT_TIMEOUT) -> shoal_pb2.Inventory:
        """What the worker holds now; its expert lane, if it has one, is tried again."""
        self.lane_refused = ""
        started = time.monotonic()
        try:  # a worker of another cluster fails now, not at the end of a wait for it
            self.check_health(min(timeout, IDENTITY_CHECK_TIMEOUT))
        except Unavailable:
            pass  # not up yet, or stopping: GetInventory waits for it
        try:
            self.inventory = self._stub.GetInventory(
                shoal_pb2.InventoryRequest(),
                timeout=max(timeout - (time.monotonic() - started), 0.1),
                metadata=self.metadata("GetInventory"), wait_for_ready=True,
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.check_health(1.0)  # says why, if the reason is known (refused, TLS)
                message = f"worker {self.address} did not answer in {timeout:.0f} s"
                raise Unavailable(message) from None
            raise error_for(e, self.address, INVENTORY) from None
        return self.inventory

    def fetch_stats(self, timeout: float = CONNECT_TIMEOUT) -> shoal_pb2.WorkerStats:
        """The worker's cache, prefetch and drive counters since it started."""
        try:
            return self._stub.GetStats(
                shoal_pb2.StatsRequest(), timeout=timeout, metadata=self.metadata("GetStats")
            )
        except grpc.RpcError as e:
            raise error_for(e, self.address, STATS) from None

    def call(self, method: str, request, *, timeout: float | None = CONNECT_TIMEOUT):
        """Any other call of the expert service (heat, expert files), with the credential;
        a refusal becomes the ShoalError the worker raised. A streamed reply is returned as
        its iterator (errors while reading it are grpc.RpcError: see error_for)."""
        try:
            return getattr(self._stub, method)(request, timeout=timeout,
                                               metadata=self.metadata(method))
        except grpc.RpcError as e:
            raise error_for(e, self.address) from None

    def check_health(self, timeout: float) -> float:
        """One grpc.health.v1 check; returns the round trip in seconds, raises Unavailable,
        or Unauthenticated when the TLS handshake fails (another cluster's identity)."""
        started = time.perf_counter()
        try:
            # the credential is not needed, but spares the check the small share a worker
            # keeps for checks without one (worker/interceptors.py: CHECKS_PER_PEER)
            reply = self._health.Check(
                health_pb2.HealthCheckRequest(service=SERVICE.full_name), timeout=timeout,
                metadata=[(METADATA_KEY, make_credential(self.secret, HEALTH_CHECK))])
        except grpc.RpcError as e:
            raise error_for(e, self.address, HEALTH, timeout) from None
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise Unavailable(f"worker {self.address} is shutting down")
        return time.perf_counter() - started

    # -- the compute path (hosts.py's ExpertHost) ---------------------------------------

    in_process = False

    @property
    def path(self) -> str:
        """How Compute travels to this worker now: its expert lane, or gRPC (asked for, the
        worker has no lane, or its lane could not be opened: then the reason is named)."""
        if self.uses_lane:
            return LANE_PATH
        return f"{GRPC_PATH} (lane refused: {self.lane_refused})" if self.lane_refused \
            else GRPC_PATH

    def whole(self, layer: int, x, inds, timing=None) -> None:
        return None  # a worker's experts are reached with requests, never in this graph

    def _compute_channel(self, index: int) -> LaneChannel | StreamChannel:
        lanes = self.uses_lane
        if self._channels and isinstance(self._channels[0], LaneChannel) != lanes:
            self.reset()  # the worker's inventory changed its lane: start over
            self._channels.clear()
        while len(self._channels) <= index:
            if lanes:
                self._channels.append(LaneChannel(self))
            elif not self._channels:
                self._channels.append(StreamChannel(self, self._channel))
            else:  # a connection of its own for each further gRPC stream
                self._channels.append(StreamChannel(self, secure_channel(
                    self.address, self.secret.require_identity(),
                    [*_LINK_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])))
        return self._channels[index]

    def submit(self, share: Share, timeout: float) -> int:
        request = request_bytes(share)
        self.send(request, share.channel, timeout=timeout)
        return len(request)

    def collect(self, share: Share, timeout: float) -> Answer:
        return answer_of(self.receive(timeout, share.channel), self.address)

    def hint(self, layer: int, hint: shoal_pb2.PrefetchHint) -> None:
        self.send(EXPERT_REQUEST.write(shoal_pb2.ExpertRequest(layer=layer, prefetch=hint)),
                  reply=False)

    def send(self, request: bytes, channel: int = 0, *, reply: bool = True,
             timeout: float = FIRST_REPLY_TIMEOUT) -> None:
        """Send one ExpertRequest's bytes (proto.EXPERT_REQUEST.write) on channel `channel`;
        `reply`: whether it asks for one (a prefetch hint alone does not). An expert lane
        waits at most `timeout` seconds for the worker to take it. A lane that cannot be
        opened (refused, or the worker's lane port unreachable) leaves this link on gRPC
        until its inventory is fetched again, said once on stderr and in `path`."""
        if not isinstance(request, bytes):  # gRPC's thread would fail on it, out of sight
            raise TypeError(f"a Compute request is bytes, not {type(request).__name__}")
        if self.inventory is None:  # whether it has a lane, and the node id to credit
            self.fetch_inventory()
        try:
            self._compute_channel(channel).send(request, timeout, reply)
        except LaneRefused as refused:
            if any(c.open for c in self._channels):
                raise  # replies owed on other lanes of this call: the call is redone
            self.check_health(CONNECT_TIMEOUT)  # a worker that is gone is lost, not gRPC's
            self.lane_refused = str(refused)
            print(f"shoal: {refused}; using gRPC for this worker", file=sys.stderr, flush=True)
            self._compute_channel(channel).send(request, timeout, reply)

    def receive(self, timeout: float, channel: int = 0) -> bytes:
        """The next reply's bytes on a channel (proto.EXPERT_REPLY.read); Unavailable if none
        came within `timeout` seconds (the channels are then abandoned: a worker that hung is
        treated as lost)."""
        return self._compute_channel(channel).receive(timeout)

    def end_pass(self) -> None:
        """End the channels beyond the first, none of whose replies is awaited: each holds one
        of the worker's threads (and of its calls from this host, worker/service.py:
        PeerLimit), so an idle coordinator keeps one. Their connections stay open."""
        for channel in self._channels[1:]:
            channel.reset()

    @property
    def open_streams(self) -> int:
        return sum(channel.open for channel in self._channels)

    def reset(self) -> None:
        """Abandon the Compute channels (and any reply still owed on them); the next send
        opens new ones."""
        for channel in self._channels:
            channel.reset()

    def close(self) -> None:
        self.reset()
        for channel in self._channels:
            if isinstance(channel, StreamChannel) and channel.channel is not self._channel:
                channel.channel.close()
        self._channel.close()
