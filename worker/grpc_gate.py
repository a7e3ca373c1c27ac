"""The gRPC port's front door: accepts each connection itself and relays its bytes to the gRPC
server on a loopback port, keeping silent connections apart from those in a TLS handshake and
few of either per source address, which grpcio cannot: no flood of sockets starves a peer."""

from __future__ import annotations

import contextlib
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable

from engine.errors import ShoalError
from engine.interfaces import busy_port
from engine.tls import Identity, shows_pass
from worker.lobby import BACKLOG, Lobby, begins_tls, ends_request, first_bytes, whole_record

SILENT_PER_HOST = 128  # connections that have sent no byte yet, from one host
SILENT = 512  # ... from every host together (beyond either, the oldest silent is closed)
OPENING_PER_HOST = 8  # connections in their TLS handshake, younger than the proving time
OPENING = 64  # ... from every host together (beyond either, the oldest is closed)
PASSED_PER_HOST = 16  # ... of those, ones that showed the cluster's pass, counted apart
PASSED = 64
_EARLY_LIMIT = 2048 + (1 << 14) + 5  # a CONNECT request's head and one TLS record
_ANSWER = b"HTTP/1.1 200 OK\r\n\r\n"
_CHUNK = 1 << 18
_QUIET_SECONDS = 60.0  # one log line per cause at most this often


class _Pipe:
    """One client connection and its relay to the gRPC server: bytes read from one side
    wait in `pending[side]` until the other has taken them (a side is read only while its
    bytes are not waiting: the slower peer sets the pace)."""

    def __init__(self, client: socket.socket, host: str) -> None:
        self.client, self.host = client, host
        self.server: socket.socket | None = None  # opened once the client sends a byte
        self.connected = False
        self.opened = time.monotonic()
        self.pending: dict[socket.socket, memoryview] = {client: memoryview(b"")}
        self.early = b""  # its bytes before the relay opens, as they arrive
        self.answered = False  # its CONNECT request was answered
        self.passed = False  # ... and showed the cluster's pass
        self.ended: set[socket.socket] = set()  # sides that sent their last byte
        self.shut: set[socket.socket] = set()  # sides told there is no more

    def other(self, sock: socket.socket) -> socket.socket | None:
        return self.server if sock is self.client else self.client


class Gate:
    """Listens on `host:port` and relays every connection to the gRPC server at
    `upstream` (loopback). A connection is silent until its first bytes, which must open a
    TLS handshake (else it is closed); then unproven until a call comes on it (`called`), or
    for its first `proving` seconds (the gRPC server closes one whose TLS handshake with the
    cluster's certificate has not ended by then). Silent ones are held by the door alone
    (a `Lobby`) and closed first: each host may have SILENT_PER_HOST, all SILENT; unproven
    ones OPENING_PER_HOST and OPENING; and `max_connections` in all (beyond it a silent one
    makes room, or a new connection is closed). A cluster member first shows the cluster's
    pass (an HTTP CONNECT, engine/tls.py): its unproven connections are counted apart
    (PASSED_PER_HOST, PASSED), so no one without the secret file can push them out, even
    from the member's own address."""

    def __init__(self, host: str, port: int, proving: float, identity: Identity,
                 max_connections: int = 0, log: Callable[[str], None] | None = None) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family,
                                                   backlog=BACKLOG)
        except OSError:
            raise ShoalError(busy_port(host, port)) from None
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self.upstream: tuple[str, int] | None = None
        self.proving, self.max_connections = proving, max_connections
        self._identity = identity
        self._log = log or (lambda message: None)
        self._selector = selectors.DefaultSelector()
        self._pipes: set[_Pipe] = set()
        self._silent: Lobby[_Pipe] = Lobby(SILENT_PER_HOST, SILENT)
        self._opening: dict[str, list[_Pipe]] = {}  # by host, oldest first
        self._passed: dict[str, list[_Pipe]] = {}  # ... of those that showed the pass
        self._relays: dict[int, _Pipe] = {}  # by the relay's local port
        self._called: queue.SimpleQueue[int] = queue.SimpleQueue()  # relays that made a call
        self._said: dict[str, float] = {}
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="grpc-gate", daemon=True)

    def start(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._thread.start()

    def stop_accepting(self) -> None:
        """New connections are refused; those open go on until either side closes them."""
        self._accepting = False

    def host_of(self, peer: str) -> str:
        """The client's host behind a gRPC peer string of a relayed connection
        ("ipv4:127.0.0.1:PORT"); the peer's own host for any other."""
        host, _, port = peer.rpartition(":")
        pipe = self._relays.get(int(port)) if port.isdigit() else None
        return pipe.host if pipe is not None else host

    def called(self, peer: str) -> None:
        """A call came on `peer`'s connection: it has the cluster's certificate (gRPC takes
        none without), so it is proven now (from any thread)."""
        port = peer.rpartition(":")[2]
        if port.isdigit():
            self._called.put(int(port))

    def _say(self, cause: str, message: str) -> None:
        now = time.monotonic()
        if now - self._said.get(cause, -_QUIET_SECONDS) >= _QUIET_SECONDS:
            self._said[cause] = now
            self._log(message)

    def _run(self) -> None:
        while True:
            try:
                if not self._accepting and self._listener.fileno() >= 0:
                    self._selector.unregister(self._listener)
                    self._listener.close()
                for key, mask in self._selector.select(timeout=0.5):
                    if key.data is None:
                        self._accept()
                    else:
                        self._relay(key.data, key.fileobj, mask)
                self._prove()
            except Exception as e:  # whatever it was, the next connection is served
                self._say("gate", f"gRPC port: {type(e).__name__}: {e}")
                time.sleep(0.05)

    def _accept(self) -> None:
        for _ in range(64):  # at most this many in a row: the open connections go on too
            try:
                client, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, for one: try again shortly
                self._say("accept", f"gRPC port: cannot accept a connection: {e.strerror}")
                return
            host = peer[0]
            full = self.max_connections and len(self._pipes) >= self.max_connections
            if full and not self._silent:
                self._say("full", f"gRPC port: {len(self._pipes)} connections open, the "
                          f"most taken; closing a new one from {host}")
                client.close()
                continue
            client.setblocking(False)
            pipe = _Pipe(client, host)
            self._pipes.add(pipe)
            self._selector.register(client, selectors.EVENT_READ, pipe)
            self._silent.add(pipe, host, pipe.opened)
            self._spoke(pipe)  # its ClientHello may be here already
            excess = len(self._pipes) - self.max_connections if self.max_connections else 0
            room = self._silent.total - len(self._silent) + excess if excess > 0 else 0
            closing = self._silent.overflow(host, self._spoke, room=room)
            if closing:
                # silent ones only, oldest first: a peer that began its handshake is never
                # closed for a socket that sent nothing
                self._say("silent", "gRPC port: many connections that send nothing (the "
                          f"latest from {host}); closing the oldest of them")
            for victim in closing:
                self._close(victim)

    def _spoke(self, pipe: _Pipe) -> bool:
        """Whether a silent connection sent bytes by now (read and relayed, if so)."""
        if first_bytes(pipe.client) is not None:
            self._relay(pipe, pipe.client, selectors.EVENT_READ)
        return pipe.server is not None or pipe not in self._pipes

    def _before_tls(self, pipe: _Pipe, data: bytes) -> bytes | None:
        """A client's bytes before its relay opens: a CONNECT request showing the cluster's
        pass (answered, the connection then counted among the passed), then the first whole
        TLS record (its ClientHello), returned to be relayed: one stalled before it never
        costs the gRPC server a connection. None while they are arriving, or when the
        connection was closed (not TLS, too long, or beyond its caps)."""
        early = pipe.early + data
        if pipe in self._silent:  # unproven from its first byte, unless it is garbage
            self._silent.remove(pipe)
            if early[:1] != b"C" and not begins_tls(early):
                return self._garbage(pipe)
            self._count(pipe)
        if not pipe.answered and early[:1] == b"C":
            end = ends_request(early)
            if end is None:
                return self._wait(pipe, early)
            request, early = early[:end], early[end:]
            if not request.startswith(b"CONNECT "):
                self._close(pipe)
                return None
            # a wrong pass goes on unpassed: its TLS handshake then says "another cluster"
            pipe.client.send(_ANSWER)  # a few bytes on a socket that has sent none yet
            pipe.answered = True
            if shows_pass(request, self._identity):
                self._uncount(pipe)
                pipe.passed = True
                self._count(pipe)
            if pipe not in self._pipes:
                return None
        if early and not begins_tls(early):
            return self._garbage(pipe)
        if not whole_record(early):
            return self._wait(pipe, early)
        pipe.early = b""
        return early

    def _garbage(self, pipe: _Pipe) -> None:
        self._say("garbage", f"gRPC port: closing a connection from {pipe.host} that "
                  "does not begin with TLS")
        self._close(pipe)

    def _wait(self, pipe: _Pipe, early: bytes) -> None:
        if len(early) > _EARLY_LIMIT:
            self._close(pipe)
        pipe.early = early

    def _kind(self, pipe: _Pipe) -> tuple[dict[str, list[_Pipe]], int, int]:
        """The unproven connections `pipe` is counted among, and their caps per host and
        in all."""
        if pipe.passed:
            return self._passed, PASSED_PER_HOST, PASSED
        return self._opening, OPENING_PER_HOST, OPENING

    def _count(self, pipe: _Pipe) -> None:
        """Count `pipe` as unproven, closing the oldest of its kind beyond their caps."""
        kind, per_host, total = self._kind(pipe)
        opening = kind.setdefault(pipe.host, [])
        opening.append(pipe)
        if len(opening) > per_host:
            self._evict(opening[0])
        elif sum(map(len, kind.values())) > total:
            busiest = max(kind, key=lambda h: len(kind[h]))
            self._evict(kind[busiest][0])

    def _uncount(self, pipe: _Pipe) -> None:
        kind = self._kind(pipe)[0]
        opening = kind.get(pipe.host, [])
        if pipe in opening:
            opening.remove(pipe)
            if not opening:
                del kind[pipe.host]

    def _evict(self, pipe: _Pipe) -> None:
        # the oldest, not the newest: a client slow to prove itself gives way, so that
        # connections that never finish their handshake cannot keep anyone out
        self._say("opening", "gRPC port: too many connections opening at once "
                  f"(the latest from {pipe.host}); closing the oldest")
        self._close(pipe)

    def _prove(self) -> None:
        """Connections older than the proving time are no longer counted as unproven; one
        that has not sent a byte by then is closed (gRPC never saw it, to close it)."""
        for pipe in self._silent.older_than(time.monotonic() - self.proving):
            self._close(pipe)
        while not self._called.empty():
            pipe = self._relays.get(self._called.get())
            if pipe is not None:
                self._uncount(pipe)
        proven = time.monotonic() - self.proving
        for kind in (self._opening, self._passed):
            for host in list(kind):
                opening = kind[host]
                while opening and opening[0].opened <= proven:
                    opening.pop(0)
                if not opening:
                    del kind[host]

    def _connect(self, pipe: _Pipe) -> None:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setblocking(False)
        server.bind(("127.0.0.1", 0))
        server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pipe.client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._relays[server.getsockname()[1]] = pipe
        pipe.server = server
        pipe.pending[server] = memoryview(b"")
        server.connect_ex(self.upstream)
        self._selector.register(server, selectors.EVENT_WRITE, pipe)

    def _relay(self, pipe: _Pipe, sock: socket.socket, mask: int) -> None:
        try:
            if sock is pipe.server and not pipe.connected:
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    raise OSError(error, "the gRPC server refused the relay")
                pipe.connected = True
            if mask & selectors.EVENT_READ and sock not in pipe.ended and not pipe.pending[sock]:
                data = sock.recv(_CHUNK)
                if data and pipe.server is None:
                    data = self._before_tls(pipe, data)
                    if data is None:  # a CONNECT request under way, or the pipe closed
                        if pipe in self._pipes:
                            self._interest(pipe)
                        return
                    self._connect(pipe)
                if data:
                    pipe.pending[sock] = memoryview(data)
                else:
                    pipe.ended.add(sock)
            self._flush(pipe)
        except OSError:
            self._close(pipe)
            return
        server_done = pipe.server in pipe.ended and not pipe.pending[pipe.server]
        if server_done or pipe.server is None and pipe.client in pipe.ended:
            self._close(pipe)  # gRPC is done with the connection (or it never began)
        else:
            self._interest(pipe)

    def _flush(self, pipe: _Pipe) -> None:
        """Hand each side's waiting bytes to the other, as many as it takes now."""
        if not pipe.connected:
            return
        for source in (pipe.client, pipe.server):
            target, waiting = pipe.other(source), pipe.pending[source]
            if waiting:
                try:
                    pipe.pending[source] = waiting[target.send(waiting):]
                except (BlockingIOError, InterruptedError):
                    pass
            if not pipe.pending[source] and source in pipe.ended and target not in pipe.shut:
                pipe.shut.add(target)
                target.shutdown(socket.SHUT_WR)

    def _interest(self, pipe: _Pipe) -> None:
        """Each side: read while its last bytes are delivered, write while the other's wait
        (or, for the relay, until its connection is made)."""
        for sock in (pipe.client, pipe.server):
            if sock is None:
                continue
            events = 0
            if sock not in pipe.ended and not pipe.pending[sock] and (
                    sock is pipe.client or pipe.connected):
                events |= selectors.EVENT_READ
            other = pipe.other(sock)
            if (other is not None and pipe.pending[other]) or (
                    sock is pipe.server and not pipe.connected):
                events |= selectors.EVENT_WRITE
            try:
                registered = self._selector.get_key(sock).events
            except KeyError:
                registered = 0
            if events == registered:
                continue
            if not events:
                self._selector.unregister(sock)
            elif registered:
                self._selector.modify(sock, events, pipe)
            else:
                self._selector.register(sock, events, pipe)

    def _close(self, pipe: _Pipe) -> None:
        if pipe not in self._pipes:
            return
        self._pipes.discard(pipe)
        self._silent.remove(pipe)
        self._uncount(pipe)
        for sock in (pipe.client, pipe.server):
            if sock is None:
                continue
            if sock is pipe.server:
                with contextlib.suppress(OSError):
                    self._relays.pop(sock.getsockname()[1], None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            sock.close()
