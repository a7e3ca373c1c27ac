"""The worker's end of the expert lane (proto/lane.py): its listener, its caps per host and
in all, and threads that read a request, compute it and write its reply; and `ComputeAnswers`,
what a Compute message gets whichever transport brought it (worker/service.py uses it too).
"""
from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable

import grpc

from engine.auth import CredentialChecker
from engine.errors import ShoalError, Unauthenticated
from engine.tensors import dtype_name, to_numpy
from proto import EXPERT_REPLY, EXPERT_REQUEST, REQUEST_LIMIT, shoal_pb2, status_for
from proto.lane import (
    HELLO,
    HELLO_LIMIT,
    LANE_METHOD,
    MESSAGE,
    READY,
    LaneClosed,
    LaneIdle,
    LaneTimeout,
    keep_alive,
    read_frame,
    watch,
    write_error,
    write_frame,
)
from proto.wire import WireView, decode
from worker.residency import Request, Residency, Timing
from worker.threads import ThreadPool

HELLO_SECONDS = 5.0  # from accept to a checked credential
MAX_OPENING_PER_HOST = 8  # connections not yet past their credential, from one host
MAX_OPENING = 64  # ... from every host together (beyond either, the oldest is closed)
MAX_LANES_PER_HOST = 16  # a coordinator opens one per worker, four in a prompt pass
MAX_LANES = 64
IDLE_SECONDS = 300.0  # a lane with no request for this long is closed (--lane-idle-seconds),
# unless it is one of the host's KEEP_IDLE lanes used last: a coordinator holds one a worker
# (four in a prompt pass) and would see its idle lane closed only at its next request
KEEP_IDLE = 4
MESSAGE_SECONDS = 30.0  # a request, once begun, must be in within this (--lane-message-seconds)
_QUIET_SECONDS = 60.0  # one log line per cause at most this often


ACTIVATION_DTYPES = ("float32", "bfloat16", "float16")


def decode_request(message: shoal_pb2.ExpertRequest, tensors: dict[str, WireView]) -> Request:
    """A Compute request (EXPERT_REQUEST.read) as checked numpy views of its bytes."""
    hidden = decode(tensors.get("hidden", WireView()), what="hidden", dtypes=ACTIVATION_DTYPES,
                    ndim=2)
    rows = decode(tensors.get("rows", WireView()), what="rows", dtypes=("int32",), ndim=1)
    experts = decode(tensors.get("experts", WireView()), what="experts", dtypes=("int32",),
                     ndim=1)
    return Request(message.layer, hidden, tensors["hidden"].dtype, rows, experts,
                   message.call_pairs)


class Refused(ShoalError):
    """A Compute message refused: the status code and message both transports answer with
    (the gRPC stream aborts with them, the expert lane sends them in an ERROR frame)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ComputeAnswers:
    """What a worker does with each Compute message, whichever transport brought it: the
    request's bytes in, its reply's bytes out (None for a prefetch hint alone)."""

    def __init__(self, residency: Residency) -> None:
        self.residency = residency

    def answer(self, data: bytes | bytearray) -> bytes | None:
        """Raises Refused with the code and message to answer a bad request with."""
        started = time.perf_counter()
        try:
            message, tensors = EXPERT_REQUEST.read(data, "request")
        except ShoalError as e:
            raise Refused(status_for(e), str(e)) from None
        if message.HasField("prefetch"):
            self.residency.prefetch(message.prefetch.layer, message.prefetch.experts)
        if "hidden" not in tensors:
            return None
        timing = Timing()
        try:
            request = decode_request(message, tensors)
            parsed = time.perf_counter()
            out = self.residency.compute(request, timing)
        except ShoalError as e:
            raise Refused(status_for(e), f"request {message.seq}: {e}") from None
        computed = time.perf_counter()
        output = to_numpy(out)
        done = time.perf_counter()  # the copy into the reply's bytes follows: in the wire
        return EXPERT_REPLY.write(
            shoal_pb2.ExpertReply(
                seq=message.seq,
                compute_seconds=done - started - timing.waited,
                inventory_version=self.residency.holdings.version,
                timing=shoal_pb2.WorkerTiming(
                    parse=parsed - started, matrix=timing.matrix,
                    bookkeeping=computed - parsed - timing.matrix - timing.waited
                    - timing.reads,
                    reply=done - computed, waited=timing.waited, reads=timing.reads),
            ),
            output=(output, dtype_name(out.dtype)),
        )

    def sent(self) -> None:
        """A reply was sent: its tokens count as served now (Holdings.asked)."""
        self.residency.holdings.settle()


class _Held:
    """One accepted connection: its socket, then the TLS socket that took its descriptor;
    `busy` while a request of it is computed or answered (a stop lets that finish)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.busy = False
        self.shut = False
        self.counted = False  # among its host's lanes (past its credential, not closing)

    def shutdown(self) -> None:
        """Wake its thread, wherever it waits (handshake, credential, request)."""
        self.shut = True
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)


class LaneServer:
    """The expert lane's listener on `host:port` (0: a free port; see `port`).

    Nothing is read from a connection before its TLS handshake proved the cluster's
    certificate and its HELLO frame a fresh credential, both within HELLO_SECONDS.
    Connections still in that state are few per host (the oldest is closed for a newer one),
    lanes past it a bounded number per host and in all, each served by a thread of a bounded
    pool, so that nobody can hold the worker's threads or file descriptors by opening
    connections. A lane that sends nothing for `idle_seconds` is closed, and so is one whose
    message, once begun, is not in within `message_seconds`."""

    def __init__(
        self, host: str, port: int, context: ssl.SSLContext, checker: CredentialChecker,
        log: Callable[[str], None] | None = None, spin: float = 0.0,
        idle_seconds: float = IDLE_SECONDS, message_seconds: float = MESSAGE_SECONDS,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family, backlog=128)
        except OSError as e:
            raise ShoalError(f"cannot listen for the expert lane on {host}:{port}: {e.strerror}"
                             " (give another --lane-port, or --no-lane)") from None
        self.port = self._listener.getsockname()[1]
        self._context, self._checker = context, checker
        self.spin = spin  # seconds a lane watches its socket busily before it blocks
        self.idle_seconds, self.message_seconds = idle_seconds, message_seconds
        self._answers: ComputeAnswers | None = None
        self._log = log or (lambda message: None)
        self._opening: dict[str, list[_Held]] = {}  # by host, oldest first
        self._lanes: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._connections: set[_Held] = set()
        self._said: dict[str, float] = {}
        self._closed = False
        # every connection the caps admit has a thread: opening, lanes, and a few on their
        # way out
        self._pool = ThreadPool(MAX_OPENING + MAX_LANES + 8, "lane", self._log)
        self._thread = threading.Thread(target=self._accept, name="lane-accept", daemon=True)

    @property
    def threads(self) -> int:
        """Threads started for lanes so far (they serve one connection after another)."""
        return self._pool.threads

    def start(self, answers: ComputeAnswers) -> None:
        """Accept lanes (the listener is bound already: connections wait in its backlog)."""
        self._answers = answers
        self._thread.start()

    def close(self, drain: float = 0.0) -> None:
        """Stop accepting and end every lane; a request being computed has up to `drain`
        seconds to be answered first (a coordinator reading a reply sees the lane closed)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        until = time.monotonic() + drain
        while True:
            with self._lock:
                waiting = [held for held in self._connections if not held.busy]
                busy = len(self._connections) - len(waiting)
                for held in waiting:  # under the lock: none turns busy meanwhile
                    held.shutdown()
            if not busy or time.monotonic() >= until:
                break
            time.sleep(0.02)
        with self._lock:
            for held in self._connections:
                held.shutdown()
        self._pool.close()
        if self._thread.is_alive():
            self._thread.join(2)

    def _say(self, cause: str, message: str) -> None:
        now = time.monotonic()
        if now - self._said.get(cause, -_QUIET_SECONDS) >= _QUIET_SECONDS:
            self._said[cause] = now
            self._log(message)

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, peer = self._listener.accept()
            except OSError as e:
                if self._closed:
                    return
                # out of file descriptors (or another passing failure): keep serving the
                # lanes open, try again shortly
                self._say("accept", f"expert lane: cannot accept a connection: {e.strerror}")
                time.sleep(0.05)
                continue
            try:
                self._admit(_Held(connection), peer[0])
            except Exception as e:  # whatever it was, the next connection is accepted
                self._say("admit", f"expert lane: a connection failed: {type(e).__name__}: {e}")
                with contextlib.suppress(OSError):
                    connection.close()

    def _admit(self, held: _Held, host: str) -> None:
        """Count `held` as opening (closing the oldest beyond the caps) and give it a thread;
        with none to give, close it and say why."""
        with self._lock:
            self._connections.add(held)
            opening = self._opening.setdefault(host, [])
            opening.append(held)
            evicted = opening.pop(0) if len(opening) > MAX_OPENING_PER_HOST else None
            if evicted is None and sum(map(len, self._opening.values())) > MAX_OPENING:
                oldest = max(self._opening, key=lambda h: len(self._opening[h]))
                evicted = self._opening[oldest].pop(0)
        if evicted is not None:
            # the oldest, not the newest: a client that is slow to prove itself gives way,
            # so that idle connections cannot keep a coordinator out
            evicted.shutdown()
            self._say(f"opening {host}", "expert lane: too many connections opening at "
                      f"once (the latest from {host}); closing the oldest")
        try:
            given = self._pool.submit(lambda: self._serve(held, host))
            why = f"all {self._pool.size} lane threads are busy"
        except RuntimeError as e:
            given, why = False, f"no thread can be started ({e}: the process's thread limit?)"
        if not given:
            self._say("threads", f"expert lane: refusing connections: {why}; coordinators "
                      "use the gRPC port meanwhile")
            self._forget(held, host)

    def _opened(self, held: _Held, host: str) -> None:
        """`held` is past its credential, or gone: no longer counted as opening."""
        with self._lock:
            opening = self._opening.get(host, [])
            if held in opening:
                opening.remove(held)
            if not opening:
                self._opening.pop(host, None)

    def _forget(self, held: _Held, host: str) -> None:
        self._opened(held, host)
        with self._lock:
            self._connections.discard(held)
        with contextlib.suppress(OSError):
            held.sock.close()

    def _serve(self, held: _Held, host: str) -> None:
        try:
            connection = held.sock
            connection.settimeout(HELLO_SECONDS)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keep_alive(connection)
            with self._lock:  # wrapping takes the descriptor over: shutdown() must see it
                lane = held.sock = self._context.wrap_socket(
                    connection, server_side=True, do_handshake_on_connect=False)
            lane.do_handshake()
            _, hello = read_frame(lane, {HELLO: HELLO_LIMIT})
            try:
                self._checker.check(hello.decode("ascii", "replace"), LANE_METHOD)
            except Unauthenticated as e:
                write_error(lane, grpc.StatusCode.UNAUTHENTICATED, str(e))
                return
            self._opened(held, host)
            with self._lock:
                admitted = (self._lanes[host] < MAX_LANES_PER_HOST
                            and self._lanes.total() < MAX_LANES)
                if admitted:
                    self._lanes[host] += 1
            if not admitted:
                write_error(lane, grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"{MAX_LANES_PER_HOST} expert lanes from {host} (or {MAX_LANES} in "
                            "all) are open already")
                return
            try:
                write_frame(lane, READY, b"")
                held.counted = True
                self._answer(held, lane, host)
            finally:
                with self._lock:
                    if held.counted:
                        self._lanes[host] -= 1
        except LaneTimeout as e:
            self._say(f"timeout {e}", f"expert lane: closing a lane from {host}: {e}")
        except (OSError, ShoalError):
            pass  # a handshake that failed, a peer that left: nothing to answer
        finally:
            self._forget(held, host)

    def _answer(self, held: _Held, lane: ssl.SSLSocket, host: str) -> None:
        """Requests in, replies out, in order, until the coordinator closes the lane, it idles
        too long, or a request is refused (its ERROR frame ends the lane, as an abort ends a
        gRPC stream)."""
        answers, spin = self._answers, self.spin

        def begun() -> None:  # a request is arriving: a stop lets it be answered
            with self._lock:
                if held.shut:
                    raise LaneClosed("the worker is stopping")
                held.busy = True

        while True:
            with self._lock:
                held.busy = False
                if held.shut:
                    return
            if spin > 0:
                watch(lane, spin)
            try:
                _, data = read_frame(lane, {MESSAGE: REQUEST_LIMIT}, idle=self.idle_seconds,
                                     within=self.message_seconds, begun=begun)
                lane.settimeout(self.message_seconds)  # for the reply: a reader that stopped
                reply = answers.answer(data)
            except LaneIdle:
                with self._lock:  # idle lanes time out longest-idle first
                    if self._lanes[host] <= KEEP_IDLE:
                        continue
                    self._lanes[host] -= 1  # closing: the next one to time out may stay
                    held.counted = False
                raise
            except LaneTimeout:
                raise
            except LaneClosed:
                return
            except Refused as e:
                write_error(lane, e.code, str(e))
                return
            except ShoalError as e:  # a frame over the limit or of a kind not expected here
                write_error(lane, grpc.StatusCode.INVALID_ARGUMENT, str(e))
                return
            if reply is not None:
                write_frame(lane, MESSAGE, reply)
                answers.sent()
