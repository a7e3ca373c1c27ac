"""What one client can hold of `shoal serve` (docs/security.md): connections per address and in
all, the idlest closed when full, a deadline for headers, the body's limits, failed accepts
said once in a while; guarded in the protocol uvicorn serves connections with."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from coordinator.server.openai_answers import error_json

# Connections the kernel queues until they are accepted (the OS caps it: somaxconn); when
# the queue is full a new client's SYN is dropped and it tries again a second later.
BACKLOG = 4096


@dataclass(frozen=True)
class Limits:
    max_body: int = 4 << 20  # bytes of one request's body (413 beyond)
    max_connections: int = 1024  # open at once, all clients (kept well under the file limit)
    max_connections_per_host: int = 64  # open at once from one address
    header_timeout: float = 5.0  # seconds from a connection's opening, or its last answer,
    # to its next request's headers (slowloris, and connections that never send a byte)
    body_timeout: float = 30.0  # seconds for a request's body to arrive (408 beyond)
    large_body: int = 64 << 10  # bodies above this are decoded and tokenized one at a time

    @property
    def max_buffered(self) -> int:
        """Bytes of bodies held at once, read and not yet tokenized (503 beyond)."""
        return 16 * self.max_body


class ConnectionGuard:
    """The server's open connections, by client address: admits a new one or says no, and
    makes room when full by closing the one idle longest (no request in progress), so that
    thousands of idle sockets cannot keep a fresh client out. Runs on the event loop."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._hosts: dict[object, str] = {}  # every open connection -> its client's address
        self._per_host: dict[str, int] = {}
        self._idle: OrderedDict[object, Callable[[], None]] = OrderedDict()  # oldest first
        self.refused = self.evicted = self.timed_out = 0

    def admit(self, host: str) -> bool:
        """Whether a new connection from `host` may open now (then `opened` it), making
        room by closing the connection idle longest when the server is full; False when its
        address holds its share, or every connection is busy."""
        if self._per_host.get(host, 0) >= self.limits.max_connections_per_host:
            self.refused += 1
            return False
        if len(self._hosts) >= self.limits.max_connections:
            if not self._idle:
                self.refused += 1
                return False
            oldest, close = self._idle.popitem(last=False)
            self.gone(oldest)
            self.evicted += 1
            close()
        return True

    def opened(self, connection: object, host: str) -> None:
        self._hosts[connection] = host
        self._per_host[host] = self._per_host.get(host, 0) + 1

    def idle(self, connection: object, close: Callable[[], None]) -> None:
        if connection in self._hosts:
            self._idle[connection] = close
            self._idle.move_to_end(connection)

    def busy(self, connection: object) -> None:
        self._idle.pop(connection, None)

    def gone(self, connection: object) -> None:
        host = self._hosts.pop(connection, None)
        self._idle.pop(connection, None)
        if host is not None:
            self._per_host[host] -= 1
            if not self._per_host[host]:
                del self._per_host[host]

    def as_json(self) -> dict:
        return {"open": len(self._hosts), "idle": len(self._idle), "refused": self.refused,
                "evicted": self.evicted, "timed_out": self.timed_out}


_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


def guarded_protocol(guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """The protocol uvicorn serves each connection with: admitted by `guard` (a refused one
    is answered 503 and closed before any HTTP machinery is built for it), then uvicorn's
    HTTP/1.1 protocol (h11), closed when its request's headers do not arrive within the
    header timeout."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Guarded(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            guard.opened(self, _host(transport))
            self._waiting()

        def connection_lost(self, exc: Exception | None) -> None:
            guard.gone(self)
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._note()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._note()

        def _note(self) -> None:
            """Busy from a request's headers to its answer's end; waiting otherwise."""
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()
                guard.busy(self)
            elif self._deadline is None and not self.transport.is_closing():
                self._waiting()

        def _waiting(self) -> None:
            guard.idle(self, self.transport.close)
            self._deadline = self.loop.call_later(guard.limits.header_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            guard.timed_out += 1
            self.transport.close()

    class Gate(asyncio.Protocol):
        def __init__(self, **settings: object) -> None:
            self._settings = settings  # uvicorn's, for the HTTP protocol if admitted

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            host = _host(transport)
            if not guard.admit(host):
                body = json.dumps(error_json(
                    f"too many connections from {host} or in all; try again later",
                    "unavailable", 503)).encode()
                transport.write(_REFUSED % (len(body), body))  # type: ignore[attr-defined]
                transport.close()
                return
            protocol = Guarded(**self._settings)
            transport.set_protocol(protocol)
            protocol.connection_made(transport)

    return Gate


def _host(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) else "local"


class QuietAcceptErrors:
    """The event loop's handler for errors nobody awaits: a failed accept (out of files) is
    said in one line at most every 10 s, with the count, instead of a traceback each time."""

    def __init__(self) -> None:
        self._said = 0.0
        self._count = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if not context.get("message", "").startswith("socket.accept() out of system resource"):
            loop.default_exception_handler(context)
            return
        self._count += 1
        now = time.monotonic()
        if now - self._said >= 10.0:
            error = context.get("exception")
            print(f"shoal serve: warning: cannot accept connections ({error}); "
                  f"{self._count} failed accept(s) since the last warning",
                  file=sys.stderr, flush=True)
            self._said, self._count = now, 0
