"""The two ways a layer call's messages travel to a worker, one interface: an expert lane
(`LaneChannel`, a TLS socket of its own, proto/lane.py) or a gRPC Compute stream
(`StreamChannel`, with a watchdog for overdue replies). A `WorkerLink` holds a few of each kind."""

from __future__ import annotations

import contextlib
import functools
import queue
import select
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Protocol

import grpc

from coordinator.dataplane.link_errors import (
    HEALTH,
    OTHER_IDENTITY,
    STREAM,
    error_for,
    error_for_code,
    refused_certificate,
)
from engine.auth import Secret, make_credential
from engine.errors import ShoalError, Unauthenticated, Unavailable
from engine.tls import Identity
from proto import COMPUTE, MESSAGE_LIMIT
from proto import lane as lane_wire

CONNECT_TIMEOUT = 10.0  # opening an expert lane: its TLS handshake and HELLO
IDLE_CHECK = 1.0  # seconds idle after which a lane is checked for a close before it is used
_CLOSE = object()


class ChannelOwner(Protocol):
    """What a channel needs of the link that holds it (coordinator/dataplane/link.py's
    WorkerLink): where the worker is, how to prove this cluster, and a reset after a failure."""

    address: str
    spin: float
    secret: Secret

    @property
    def node_id(self) -> str: ...

    def metadata(self, method: str) -> list[tuple[str, str]]: ...

    def lane_endpoint(self) -> tuple[str, int]: ...

    def reset(self) -> None: ...


class LaneRefused(Unavailable):
    """An expert lane could not be opened (its port refused, unreachable, or the worker
    answered the HELLO with a refusal): the link may still reach the worker over gRPC."""


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
        self._due: dict[StreamChannel, float] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self, stream: StreamChannel, deadline: float) -> None:
        self._due[stream] = deadline
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="shoal-deadlines",
                                                    daemon=True)
                    self._thread.start()
        self._wake.set()

    def disarm(self, stream: StreamChannel) -> None:
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


class StreamChannel:
    """One Compute stream of a link, on its own channel: requests queued onto it, replies
    read in order, and what the watchdog needs to cancel it when a reply is overdue."""

    def __init__(self, link: ChannelOwner, channel: grpc.Channel) -> None:
        self.link, self.channel = link, channel
        self._compute = channel.stream_stream(COMPUTE, _registered_method=True)
        self._requests: queue.SimpleQueue | None = None
        self._replies: Iterator[bytes] | None = None
        # receive() and the watchdog agree under this lock on whether a reply is awaited
        self._waiting_lock = threading.Lock()
        self._waiting = None
        self._timeout = 0.0
        self._late: float | None = None

    def send(self, request: bytes, timeout: float, reply: bool = True) -> None:
        """Queue a request (gRPC's own thread writes it: `timeout` is the reply's to keep)."""
        if self._requests is None:
            self._requests = queue.SimpleQueue()
            self._replies = self._compute(iter(self._requests.get, _CLOSE),
                                          metadata=self.link.metadata("Compute"))
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


class LaneChannel:
    """One expert lane of a link (proto/lane.py): a TLS socket of its own to the worker's lane
    port, opened at the first request. Requests are written and replies read by the calling
    thread itself. A request sent while replies are still owed on this lane is written
    without blocking, reading whatever replies arrive meanwhile into `_inbox`, so that the
    worker, blocked writing a large reply, never blocks our write (no reader thread needed)."""

    def __init__(self, link: ChannelOwner) -> None:
        self.link = link
        self._sock: ssl.SSLSocket | None = None
        self._owed = 0  # replies not read yet
        self._inbox = bytearray()  # reply bytes read while writing
        self._used = 0.0  # when a request was last written

    def _connect(self, timeout: float) -> ssl.SSLSocket:
        link = self.link
        host, port = link.lane_endpoint()
        try:
            identity = link.secret.require_identity()
            sock = lane_wire.connect(host, port, _lane_context(identity), timeout, identity)
            credential = make_credential(link.secret, lane_wire.LANE_METHOD, node=link.node_id)
            lane_wire.write_frame(sock, lane_wire.HELLO, credential.encode())
            kind, payload = lane_wire.read_frame(sock, _HELLO_REPLIES)
        except ssl.SSLError as e:
            if refused_certificate(e.reason or str(e)):
                raise Unauthenticated(OTHER_IDENTITY.format(address=link.address)
                                      + f" (expert lane: {e.reason or e})") from None
            raise LaneRefused(f"worker {link.address}: its expert lane on port {port} was cut "
                              f"during the TLS handshake ({e.reason or e})") from None
        except (OSError, ShoalError) as e:
            reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
            raise LaneRefused(f"worker {link.address}: cannot open its expert lane on port "
                              f"{port}: {reason}") from None
        if kind == lane_wire.ERROR:
            sock.close()
            code, details = lane_wire.read_error(payload)
            error = error_for_code(code, f"expert lane: {details}", link.address, HEALTH)
            if isinstance(error, Unauthenticated):
                raise error
            raise LaneRefused(str(error))
        return sock

    def send(self, request: bytes, timeout: float, reply: bool = True) -> None:
        """Write a request, waiting at most `timeout` seconds for the worker to take it;
        `reply`: whether one is owed. A lane the worker closed while it sat idle (its idle
        timeout, docs/security.md) is opened again first."""
        now = time.monotonic()
        if self._sock is not None and not self._owed and now - self._used > IDLE_CHECK \
                and select.select([self._sock], [], [], 0)[0]:
            self.reset()  # readable with nothing owed: the worker closed it
        self._used = now
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
        if reply:
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

    def receive(self, timeout: float) -> bytes:
        address, spin = self.link.address, self.link.spin
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
