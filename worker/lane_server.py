"""The worker's end of the expert lane (proto/lane.py): its listener, its caps per host and
in all, and threads that read a request, have it answered (worker/compute_answers.py) and
write its reply."""
from __future__ import annotations

import contextlib
import selectors
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable

import grpc

from engine.auth import CredentialChecker
from engine.errors import ShoalError, Unauthenticated
from engine.tls import Identity, shows_pass
from proto import REQUEST_LIMIT
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
from worker.compute_answers import ComputeAnswers, Refused
from worker.lobby import BACKLOG, Lobby, begins_tls, ends_request, first_bytes
from worker.threads import ThreadPool

HELLO_SECONDS = 5.0  # from accept to a checked credential
MAX_SILENT_PER_HOST = 128  # connections that have sent no byte yet (no thread), from one host
MAX_SILENT = 512  # ... from every host together (beyond either, the oldest silent is closed)
MAX_OPENING_PER_HOST = 8  # connections in their TLS handshake or HELLO, from one host
MAX_OPENING = 64  # ... from every host together (beyond either, the oldest is closed)
MAX_LANES_PER_HOST = 16  # a coordinator opens one per worker, four in a prompt pass
MAX_LANES = 64
# threads one host's connections may hold at once: its opening ones and lanes, and a few
# on their way out, so that one host's churn cannot take the pool from the others
THREADS_PER_HOST = MAX_OPENING_PER_HOST + MAX_LANES_PER_HOST + 4
IDLE_SECONDS = 300.0  # a lane with no request for this long is closed (--lane-idle-seconds),
# unless it is one of the host's KEEP_IDLE lanes used last: a coordinator holds one a worker
# (four in a prompt pass) and would see its idle lane closed only at its next request
KEEP_IDLE = 4
MESSAGE_SECONDS = 30.0  # a request, once begun, must be in within this (--lane-message-seconds)
_REQUEST_LIMIT = 2048  # bytes of the CONNECT request that shows the cluster's pass
_QUIET_SECONDS = 60.0  # one log line per cause at most this often


class _Held:
    """One accepted connection: its socket, then the TLS socket that took its descriptor;
    `busy` while a request of it is computed or answered (a stop lets that finish)."""

    def __init__(self, sock: socket.socket, share: tuple[str, bool]) -> None:
        self.sock = sock
        self.share = share  # its host, and whether it showed the cluster's pass
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
    certificate and its HELLO frame a fresh credential, both within HELLO_SECONDS. One that
    has sent no byte yet waits in the accept thread (a `Lobby`: no thread of its own, the
    first closed when room is short); one whose first bytes open a TLS handshake gets a
    thread. Connections in their handshake are few per host (the oldest is closed for a newer
    one), lanes past it a bounded number per host and in all, each served by a thread of a
    bounded pool of which a host holds at most THREADS_PER_HOST, so that nobody can hold the
    worker's threads or file descriptors, or another host's share, by opening connections.
    A connection that first shows the cluster's pass (engine/tls.py) has a host's caps and
    share of its own, apart from those of its host's others: no one without the secret file
    can take them, even from a coordinator's own address.
    A lane that sends nothing for `idle_seconds` is closed, and so is one whose message, once
    begun, is not in within `message_seconds`."""

    def __init__(
        self, host: str, port: int, context: ssl.SSLContext, checker: CredentialChecker,
        identity: Identity, log: Callable[[str], None] | None = None, spin: float = 0.0,
        idle_seconds: float = IDLE_SECONDS, message_seconds: float = MESSAGE_SECONDS,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family,
                                                   backlog=BACKLOG)
        except OSError as e:
            raise ShoalError(f"cannot listen for the expert lane on {host}:{port}: {e.strerror}"
                             " (give another --lane-port, or --no-lane)") from None
        self.port = self._listener.getsockname()[1]
        self._context, self._checker, self._identity = context, checker, identity
        self.spin = spin  # seconds a lane watches its socket busily before it blocks
        self.idle_seconds, self.message_seconds = idle_seconds, message_seconds
        self._answers: ComputeAnswers | None = None
        self._log = log or (lambda message: None)
        self._silent: Lobby[socket.socket] = Lobby(MAX_SILENT_PER_HOST, MAX_SILENT)
        self._opening: dict[tuple[str, bool], list[_Held]] = {}  # by share, oldest first
        self._lanes: Counter[str] = Counter()
        self._threads: Counter[tuple[str, bool]] = Counter()  # pool threads of each share
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
        """Accept connections, hold the silent ones, and give each that begins a TLS
        handshake to `_admit`; silent ones older than HELLO_SECONDS are closed."""
        selector = selectors.DefaultSelector()
        self._listener.setblocking(False)
        selector.register(self._listener, selectors.EVENT_READ)
        hosts: dict[socket.socket, str] = {}

        def spoke(sock: socket.socket) -> bool:  # sent bytes by now: handed on, or closed
            data = first_bytes(sock)
            if data is None:
                return False
            selector.unregister(sock)
            host = hosts.pop(sock)
            shown = self._shown(sock) if data[:1] == b"C" else None
            if shown is not None or begins_tls(data):
                self._begin(sock, (host, bool(shown)))
            else:
                sock.close()
            return True

        while not self._closed:
            try:
                for key, _ in selector.select(timeout=0.5):
                    if key.fileobj is not self._listener:
                        self._silent.remove(key.fileobj)
                        spoke(key.fileobj)
                        continue
                    for host, connection in self._accepted():
                        connection.setblocking(False)
                        hosts[connection] = host
                        selector.register(connection, selectors.EVENT_READ)
                        self._silent.add(connection, host, time.monotonic())
                        for victim in self._silent.overflow(host, spoke):
                            selector.unregister(victim)
                            hosts.pop(victim)
                            victim.close()
                for sock in self._silent.older_than(time.monotonic() - HELLO_SECONDS):
                    selector.unregister(sock)
                    hosts.pop(sock)
                    sock.close()
            except Exception as e:  # whatever it was, the next connection is accepted
                if self._closed:
                    break
                self._say("admit", f"expert lane: a connection failed: {type(e).__name__}: {e}")
                time.sleep(0.05)
        for sock in hosts:
            sock.close()
        selector.close()

    def _accepted(self) -> list[tuple[str, socket.socket]]:
        """The connections waiting to be accepted (64 at most at a time)."""
        accepted = []
        for _ in range(64):
            try:
                connection, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                if not self._closed:  # out of file descriptors, say: the lanes open go on
                    self._say("accept", f"expert lane: cannot accept a connection: "
                              f"{e.strerror}")
                break
            accepted.append((peer[0], connection))
        return accepted

    def _shown(self, sock: socket.socket) -> bool | None:
        """Whether the CONNECT request `sock` begins with shows the cluster's pass (it is
        read); None when it begins with none (a coordinator writes it whole at once, so a
        part is taken for none). A wrong pass goes on without one: its TLS handshake then
        tells the coordinator it belongs to another cluster."""
        try:
            data = sock.recv(_REQUEST_LIMIT, socket.MSG_PEEK)
            end = ends_request(data)
            if end is None or not data.startswith(b"CONNECT "):
                return None
            return shows_pass(sock.recv(end), self._identity)
        except OSError:
            return None

    def _begin(self, connection: socket.socket, share: tuple[str, bool]) -> None:
        connection.setblocking(True)
        try:
            self._admit(_Held(connection, share), share[0])
        except Exception as e:  # whatever it was, the next connection is accepted
            self._say("admit", f"expert lane: a connection failed: {type(e).__name__}: {e}")
            with contextlib.suppress(OSError):
                connection.close()

    def _admit(self, held: _Held, host: str) -> None:
        """Count `held` as opening (closing the oldest beyond the caps) and give it a thread;
        with none to give, close it and say why."""
        share = held.share
        with self._lock:
            self._connections.add(held)
            opening = self._opening.setdefault(share, [])
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
        with self._lock:
            shared = self._threads[share] < THREADS_PER_HOST
            if shared:
                self._threads[share] += 1
        try:
            given = shared and self._pool.submit(lambda: self._serve(held, host))
            why = (f"all {self._pool.size} lane threads are busy" if shared else
                   f"{host} holds its share of lane threads ({THREADS_PER_HOST})")
        except RuntimeError as e:
            given, why = False, f"no thread can be started ({e}: the process's thread limit?)"
        if not given:
            self._say(f"threads {shared}", f"expert lane: refusing connections: {why}; "
                      "coordinators use the gRPC port meanwhile")
            if shared:
                self._thread_done(held)
            self._forget(held)

    def _thread_done(self, held: _Held) -> None:
        with self._lock:
            self._threads[held.share] -= 1
            if not self._threads[held.share]:
                del self._threads[held.share]

    def _opened(self, held: _Held) -> None:
        """`held` is past its credential, or gone: no longer counted as opening."""
        with self._lock:
            opening = self._opening.get(held.share, [])
            if held in opening:
                opening.remove(held)
            if not opening:
                self._opening.pop(held.share, None)

    def _forget(self, held: _Held) -> None:
        self._opened(held)
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
            self._opened(held)
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
            self._forget(held)
            self._thread_done(held)

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
