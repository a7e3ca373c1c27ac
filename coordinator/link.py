"""One worker as the coordinator reaches it: a `WorkerLink` owns the gRPC channel and a
long-lived bidirectional Compute stream (and, for a prompt pass's pieces, a few more, each on
a connection of its own), queues requests onto them and reads each one's replies in order;
the handshake that says whether a worker can serve this model; and how a failed call reads
for the user (`error_for`, one table for every call on a link).
"""

from __future__ import annotations

import contextlib
import functools
import queue
import select
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.auth import HEALTH_CHECK, METADATA_KEY, UNBOUND_METHODS, Secret, make_credential
from engine.errors import ShoalError, Unauthenticated, Unavailable
from engine.manifest import ExpertKey, Manifest
from engine.tls import Identity
from proto import (
    COMPUTE,
    ERROR_CODES,
    GRPC_OPTIONS,
    MESSAGE_LIMIT,
    PROTOCOL_VERSION,
    SERVICE,
    error_class_for,
    secure_channel,
    shoal_pb2,
    shoal_pb2_grpc,
)
from proto import lane as lane_wire

CONNECT_TIMEOUT = 10.0
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
_CLOSE = object()
_HELLO_REPLIES = {lane_wire.READY: 0, lane_wire.ERROR: 1 << 16}
_REPLIES = {lane_wire.MESSAGE: MESSAGE_LIMIT, lane_wire.ERROR: 1 << 16}


@functools.lru_cache(maxsize=4)
def _lane_context(identity: Identity) -> ssl.SSLContext:
    return lane_wire.client_context(identity)


class _Watchdog:
    """Cancels the Compute stream of a link whose reply is overdue, so that the thread
    waiting in `receive` gets an error instead of waiting forever (gRPC's blocking stream
    iterator takes no timeout). One thread for every link; arming costs a dict write."""

    def __init__(self) -> None:
        self._due: dict[_Stream, float] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self, stream: _Stream, deadline: float) -> None:
        self._due[stream] = deadline
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="shoal-deadlines",
                                                    daemon=True)
                    self._thread.start()
        self._wake.set()

    def disarm(self, stream: _Stream) -> None:
        self._due.pop(stream, None)

    def _run(self) -> None:
        while True:
            if not self._due:
                self._wake.wait()
                self._wake.clear()
                continue
            now = time.monotonic()
            for stream, deadline in list(self._due.items()):
                if now >= deadline and self._due.get(stream) == deadline:
                    self._due.pop(stream, None)
                    stream.overdue()
            time.sleep(0.02)


_WATCHDOG = _Watchdog()


def incompatibility(
    address: str, protocol: int, fingerprint: str, manifest: Manifest | None
) -> str | None:
    """Why a worker (its inventory or its Bonjour advert) cannot serve this model, or None.
    Without a manifest (`shoal workers`) only the protocol is judged."""
    if protocol != PROTOCOL_VERSION:
        return (
            f"worker {address} speaks protocol {protocol}, this coordinator "
            f"{PROTOCOL_VERSION}: upgrade Shoal on both"
        )
    if manifest is not None and fingerprint != manifest.fingerprint:
        return (
            f"worker {address} serves a different model ({fingerprint[:12]}, expected "
            f"{manifest.model_type} {manifest.fingerprint[:12]})"
        )
    return None


def held(inventory: shoal_pb2.Inventory) -> frozenset[ExpertKey]:
    return frozenset((h.layer, h.expert) for h in inventory.experts)


@dataclass(frozen=True)
class ErrorWording:
    """How one kind of call on a link words a failed gRPC call for the user.

    A status code in `refusals` is the worker's own answer: it raised that ShoalError there
    (proto.ERROR_CODES read back; FAILED_PRECONDITION stands for any other), and the details
    are its message. Any other code means the call did not get through: Unavailable, worded
    by `failed`; with `identity`, a refused credential or TLS handshake is Unauthenticated
    instead (the worker belongs to another cluster, or the clocks disagree).
    """

    refusals: frozenset[grpc.StatusCode] = frozenset()
    failed: str = "worker {address}: {code}: {details}"
    identity: bool = False


_REFUSALS = frozenset(code for _, code in ERROR_CODES) | {grpc.StatusCode.FAILED_PRECONDITION}
_OTHER_IDENTITY = (
    "worker {address} refused this cluster's TLS identity or holds another's: copy the same "
    "cluster secret file (shoal cluster-init) to every Mac"
)
# The calls of a link: the handshake and the counters are the worker's bookkeeping, which it
# never refuses; any other call (heat, expert files) answers with the worker's refusals; on
# the Compute stream only "an expert moved" is an answer (see Cluster.reload), any other
# failure loses the worker for this call.
INVENTORY = ErrorWording(identity=True)
STATS = ErrorWording()
HEALTH = ErrorWording(identity=True)
CALL = ErrorWording(_REFUSALS, failed="worker {address}: {details}")
STREAM = ErrorWording(frozenset({grpc.StatusCode.ABORTED}),
                 failed="worker {address} failed: {code}: {details}")


def error_for(error: grpc.RpcError, address: str, wording: ErrorWording = CALL) -> ShoalError:
    """A failed call to the worker at `address` as the ShoalError the user is shown."""
    return error_for_code(error.code(), error.details() or error.code().name, address, wording)


def error_for_code(code: grpc.StatusCode, details: str, address: str,
                   wording: ErrorWording = CALL) -> ShoalError:
    """The same, from a status code and its details (an expert lane's ERROR frame)."""
    if code in wording.refusals:
        return (error_class_for(code) or ShoalError)(f"worker {address}: {details}")
    if wording.identity and "handshake failed" in details.lower():
        return Unauthenticated(_OTHER_IDENTITY.format(address=address))
    refused = wording.identity and code == grpc.StatusCode.UNAUTHENTICATED
    kind = Unauthenticated if refused else Unavailable
    return kind(wording.failed.format(address=address, code=code.name, details=details))


def handshake(
    link: WorkerLink, manifest: Manifest | None, timeout: float
) -> tuple[shoal_pb2.Inventory, str | None]:
    """Ask a worker what it holds: its inventory, and why it cannot serve this model (or
    None). Raises Unavailable or Unauthenticated when it does not answer."""
    inventory = link.fetch_inventory(timeout)
    return inventory, incompatibility(link.address, inventory.protocol_version,
                                      inventory.fingerprint, manifest)


class _Stream:
    """One Compute stream of a link, on its own channel: requests queued onto it, replies
    read in order, and what the watchdog needs to cancel it when a reply is overdue."""

    def __init__(self, link: WorkerLink, channel: grpc.Channel) -> None:
        self.link, self.channel = link, channel
        self._compute = channel.stream_stream(COMPUTE, _registered_method=True)
        self._requests: queue.SimpleQueue | None = None
        self._replies: Iterator[bytes] | None = None
        # receive() and the watchdog agree under this lock on whether a reply is awaited
        self._waiting_lock = threading.Lock()
        self._waiting = None
        self._timeout = 0.0
        self._late: float | None = None

    def send(self, request: bytes) -> None:
        if self._requests is None:
            self._requests = queue.SimpleQueue()
            self._replies = self._compute(iter(self._requests.get, _CLOSE),
                                          metadata=self.link._metadata("Compute"))
        self._requests.put(request)

    def receive(self, timeout: float) -> bytes:
        address = self.link.address
        replies = self._replies
        if replies is None:
            raise Unavailable(f"worker {address}: no request is awaiting a reply")
        with self._waiting_lock:
            self._waiting, self._timeout, self._late = replies, timeout, None
        _WATCHDOG.arm(self, time.monotonic() + timeout)
        try:
            reply = next(replies)
            with self._waiting_lock:
                self._waiting = None
            return reply
        except grpc.RpcError as e:
            self.link.reset()
            if self._late is not None:
                raise Unavailable(f"worker {address} did not answer within "
                                  f"{self._late:.1f} s") from None
            raise error_for(e, address, STREAM) from None
        except StopIteration:
            self.link.reset()
            raise Unavailable(f"worker {address} closed its stream") from None
        finally:
            with self._waiting_lock:
                self._waiting = None
            _WATCHDOG.disarm(self)

    def overdue(self) -> None:
        """Called by the watchdog when a reply is late: give up the stream, unless the reply
        came meanwhile."""
        with self._waiting_lock:
            if self._waiting is None:
                return
            self._late = self._timeout
            self._waiting.cancel()

    @property
    def open(self) -> bool:
        return self._requests is not None

    def reset(self) -> None:
        if self._requests is not None:
            self._requests.put(_CLOSE)
        self._requests = self._replies = None


class _Lane:
    """One expert lane of a link (proto/lane.py): a TLS socket of its own to the worker's lane
    port, opened at the first request. Requests are written and replies read by the calling
    thread itself. A request sent while replies are still owed on this lane is written
    without blocking, reading whatever replies arrive meanwhile into `_inbox`, so that the
    worker, blocked writing a large reply, never blocks our write (no reader thread needed)."""

    def __init__(self, link: WorkerLink) -> None:
        self.link = link
        self._sock: ssl.SSLSocket | None = None
        self._owed = 0  # replies not read yet
        self._inbox = bytearray()  # reply bytes read while writing

    def _connect(self, timeout: float) -> ssl.SSLSocket:
        link = self.link
        host, port = link.lane_endpoint()
        try:
            sock = lane_wire.connect(host, port, _lane_context(link._secret.require_identity()),
                                     timeout)
            credential = make_credential(link._secret, lane_wire.LANE_METHOD, node=link.node_id)
            lane_wire.write_frame(sock, lane_wire.HELLO, credential.encode())
            kind, payload = lane_wire.read_frame(sock, _HELLO_REPLIES)
        except ssl.SSLError as e:
            raise Unauthenticated(_OTHER_IDENTITY.format(address=link.address)
                                  + f" (expert lane: {e.reason or e})") from None
        except (OSError, ShoalError) as e:
            reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
            raise Unavailable(f"worker {link.address}: cannot open its expert lane on port "
                              f"{port}: {reason}") from None
        if kind == lane_wire.ERROR:
            sock.close()
            code, details = lane_wire.read_error(payload)
            raise error_for_code(code, f"expert lane: {details}", link.address, HEALTH)
        return sock

    def send(self, request: bytes, timeout: float) -> None:
        if self._sock is None:
            self._sock = self._connect(min(timeout, CONNECT_TIMEOUT))
            self._owed = 0
            self._inbox.clear()
        sock = self._sock
        try:
            if not self._owed:  # nothing can be in the way: write it all, blocking
                sock.settimeout(timeout)
                lane_wire.write_frame(sock, lane_wire.MESSAGE, request)
            else:
                self._write_reading(lane_wire.HEADER.pack(len(request), lane_wire.MESSAGE),
                                    request, time.monotonic() + timeout)
        except (OSError, ShoalError) as e:
            self.link.reset()
            raise self._failed(e) from None

    def owe(self) -> None:
        """The request just sent has a reply to read."""
        self._owed += 1

    def _write_reading(self, header: bytes, payload: bytes, deadline: float) -> None:
        sock = self._sock
        for part in (header, payload):
            view = memoryview(part)
            while view:
                try:
                    sock.settimeout(0.0)
                    view = view[sock.send(view):]
                    continue
                except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError):
                    pass
                self._read_available()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the worker stopped reading")
                select.select([sock], [sock], [], left)

    def _read_available(self) -> None:
        sock = self._sock
        sock.settimeout(0.0)
        chunk = bytearray(1 << 18)
        while True:
            try:
                count = sock.recv_into(chunk)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                return
            if count == 0:
                raise lane_wire.LaneClosed("the lane was closed")
            self._inbox += memoryview(chunk)[:count]

    def receive(self, timeout: float, spin: float = 0.0) -> bytes:
        address = self.link.address
        sock = self._sock
        if sock is None or not self._owed:
            raise Unavailable(f"worker {address}: no request is awaiting a reply")
        try:
            kind, payload = self._read_frame(sock, timeout, spin)
        except TimeoutError:
            self.link.reset()
            raise Unavailable(f"worker {address} did not answer within {timeout:.1f} s") \
                from None
        except (OSError, ShoalError) as e:
            self.link.reset()
            raise self._failed(e) from None
        self._owed -= 1
        if kind == lane_wire.ERROR:
            self.link.reset()
            code, details = lane_wire.read_error(payload)
            raise error_for_code(code, details, address, STREAM)
        return payload

    def _read_frame(self, sock: ssl.SSLSocket, timeout: float, spin: float
                    ) -> tuple[int, bytearray]:
        if self._inbox:  # replies read while writing come first
            sock.settimeout(timeout)
            reader = _Buffered(self._inbox, sock)
            kind, payload = lane_wire.read_frame(reader, _REPLIES)
            self._inbox = reader.rest()
            return kind, payload
        if spin > 0:
            lane_wire.watch(sock, spin)
        sock.settimeout(timeout)
        return lane_wire.read_frame(sock, _REPLIES)

    def _failed(self, error: Exception) -> ShoalError:
        """A broken lane, worded as a failed gRPC stream is (STREAM)."""
        if isinstance(error, lane_wire.LaneClosed):
            why = "it closed its expert lane"
        elif isinstance(error, TimeoutError):
            why = f"it did not take a request in time ({error})"
        elif isinstance(error, ssl.SSLError):
            why = f"its expert lane broke: {error.reason or error}"
        elif isinstance(error, ShoalError):
            why = f"expert lane: {error}"
        else:
            why = f"its expert lane broke: {error.strerror or error}"
        return Unavailable(f"worker {self.link.address} failed: {why}")

    @property
    def open(self) -> bool:
        return self._sock is not None

    def reset(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock, self._owed = None, 0
        self._inbox = bytearray()


class _Buffered:
    """Reads from `head` first, then from `sock` (what lane_wire.read_frame needs)."""

    def __init__(self, head: bytearray, sock: ssl.SSLSocket) -> None:
        self._head, self._at, self._sock = head, 0, sock

    def recv_into(self, view: memoryview) -> int:
        if self._at < len(self._head):
            count = min(len(view), len(self._head) - self._at)
            view[:count] = self._head[self._at:self._at + count]
            self._at += count
            return count
        return self._sock.recv_into(view)

    def rest(self) -> bytearray:
        return self._head[self._at:]


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
    """One worker: its gRPC channel (the control plane), its inventory, and the Compute lanes
    to it. With the `lane` transport (the default) each lane is an expert lane, a TLS socket
    of its own (`_Lane`); with `grpc`, or to a worker that serves no lane, a Compute stream
    (`_Stream`: lane 0 on the link's own channel, further lanes each on a channel of its own).
    Lanes beyond the first carry a prompt pass's pieces."""

    def __init__(self, address: str, secret: Secret, transport: str = "lane",
                 spin: float = 0.0) -> None:
        """`transport` and `spin` come from a Transport, which checks them (Transport.link)."""
        self.address = address
        self.transport = transport
        self.spin = spin  # seconds a lane watches its socket busily before blocking on a reply
        self._secret = secret
        self._channel = secure_channel(address, secret.require_identity(), _LINK_OPTIONS)
        self._stub = shoal_pb2_grpc.ExpertServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        # bytes both ways: messages are written and read by proto.EXPERT_REQUEST / EXPERT_REPLY
        self._streams: list[_Stream | _Lane] = []
        self.inventory: shoal_pb2.Inventory | None = None
        # where the expert lane is reached when not at the worker's own host and the port its
        # inventory names (a relay between: benchmarks/network.py)
        self.lane_address: str | None = None

    @property
    def uses_lane(self) -> bool:
        """Whether Compute's messages go on expert lanes: asked for, and the worker has one."""
        return (self.transport == "lane" and self.inventory is not None
                and self.inventory.lane_port > 0)

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
        return max(len(self._streams), 1)

    def _metadata(self, method: str) -> list[tuple[str, str]]:
        """A call's credential, bound to this worker's node id, which every call but the
        inventory needs: the inventory (the node id) is fetched first if not known yet."""
        path = f"/shoal.v1.ExpertService/{method}"
        if self.inventory is None and path not in UNBOUND_METHODS:
            self.fetch_inventory()
        return [(METADATA_KEY, make_credential(self._secret, path, node=self.node_id))]

    @property
    def node_id(self) -> str:
        """The worker's node id, once its inventory was fetched ("" before)."""
        return self.inventory.node_id if self.inventory is not None else ""

    def fetch_inventory(self, timeout: float = CONNECT_TIMEOUT) -> shoal_pb2.Inventory:
        try:
            self.inventory = self._stub.GetInventory(
                shoal_pb2.InventoryRequest(), timeout=timeout,
                metadata=self._metadata("GetInventory"), wait_for_ready=True,
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
                shoal_pb2.StatsRequest(), timeout=timeout, metadata=self._metadata("GetStats")
            )
        except grpc.RpcError as e:
            raise error_for(e, self.address, STATS) from None

    def call(self, method: str, request, *, timeout: float | None = CONNECT_TIMEOUT):
        """Any other call of the expert service (heat, expert files), with the credential;
        a refusal becomes the ShoalError the worker raised. A streamed reply is returned as
        its iterator (errors while reading it are grpc.RpcError: see error_for)."""
        try:
            return getattr(self._stub, method)(request, timeout=timeout,
                                               metadata=self._metadata(method))
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
                metadata=[(METADATA_KEY, make_credential(self._secret, HEALTH_CHECK))])
        except grpc.RpcError as e:
            raise error_for(e, self.address, HEALTH) from None
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise Unavailable(f"worker {self.address} is shutting down")
        return time.perf_counter() - started

    def _stream(self, lane: int) -> _Stream | _Lane:
        if self._streams and isinstance(self._streams[0], _Lane) != self.uses_lane:
            self.reset()  # the worker's inventory changed its lane: start over
            self._streams.clear()
        while len(self._streams) <= lane:
            if self.uses_lane:
                self._streams.append(_Lane(self))
            elif not self._streams:
                self._streams.append(_Stream(self, self._channel))
            else:  # a connection of its own for each further gRPC lane
                self._streams.append(_Stream(self, secure_channel(
                    self.address, self._secret.require_identity(),
                    [*_LINK_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])))
        return self._streams[lane]

    def send(self, request: bytes, lane: int = 0, *, reply: bool = True,
             timeout: float = FIRST_REPLY_TIMEOUT) -> None:
        """Send one ExpertRequest's bytes (proto.EXPERT_REQUEST.write) on lane `lane`;
        `reply`: whether it asks for one (a prefetch hint alone does not). An expert lane
        waits at most `timeout` seconds for the worker to take it."""
        if not isinstance(request, bytes):  # gRPC's thread would fail on it, out of sight
            raise TypeError(f"a Compute request is bytes, not {type(request).__name__}")
        if self.inventory is None:  # whether it has a lane, and the node id to credit
            self.fetch_inventory()
        stream = self._stream(lane)
        if isinstance(stream, _Lane):
            stream.send(request, timeout)
            if reply:
                stream.owe()
        else:
            stream.send(request)

    def receive(self, timeout: float, lane: int = 0) -> bytes:
        """The next reply's bytes on a lane (proto.EXPERT_REPLY.read); Unavailable if none
        came within `timeout` seconds (the lanes are then abandoned: a worker that hung is
        treated as lost)."""
        stream = self._stream(lane)
        if isinstance(stream, _Lane):
            return stream.receive(timeout, self.spin)
        return stream.receive(timeout)

    def close_lanes(self) -> None:
        """End the streams beyond the first, none of whose replies is awaited: a stream holds
        one of the worker's threads (and of its calls from this host, worker/service.py:
        PeerLimit), so an idle coordinator keeps one. Their connections stay open."""
        for stream in self._streams[1:]:
            stream.reset()

    @property
    def open_streams(self) -> int:
        return sum(stream.open for stream in self._streams)

    def reset(self) -> None:
        """Abandon the Compute streams (and any reply still owed on them); the next send opens
        new ones."""
        for stream in self._streams:
            stream.reset()

    def close(self) -> None:
        self.reset()
        for stream in self._streams:
            if isinstance(stream, _Stream) and stream.channel is not self._channel:
                stream.channel.close()
        self._channel.close()
