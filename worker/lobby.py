"""Connections that have sent nothing yet, kept apart from those that began a TLS handshake:
they cost one file each, never a thread, and they are the ones closed when room is short, so
that idle sockets (from any process, on any host) cannot push a peer's handshake out."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

# Connections waiting to be accepted. When this queue is full the kernel drops a new SYN,
# which its sender tries again only a second later: a flood of more sockets than the door
# holds then waits here, so the queue is as long as Linux allows by default (its
# net.core.somaxconn; macOS's kern.ipc.somaxconn is lower, and taken silently).
BACKLOG = 4096
_HANDSHAKE_RECORD = 0x16  # TLS's record type of a ClientHello
_MAJOR_VERSION = 3  # TLS 1.0-1.3 all say 3.x in a record header


def begins_tls(data: bytes) -> bool:
    """Whether a connection's first bytes (one or more) open a TLS handshake."""
    return bool(data) and data[0] == _HANDSHAKE_RECORD and (
        len(data) < 2 or data[1] == _MAJOR_VERSION)


def whole_record(data: bytes) -> bool:
    """Whether `data`, which opens a TLS handshake, holds its first record whole."""
    return len(data) >= 5 and len(data) >= 5 + int.from_bytes(data[3:5], "big")


def ends_request(data: bytes) -> int | None:
    """Where an HTTP request's head (as a CONNECT's) ends in `data`; None before its end."""
    end = data.find(b"\r\n\r\n")
    return None if end < 0 else end + 4


def first_bytes(sock: socket.socket) -> bytes | None:
    """The bytes waiting on a non-blocking `sock`, left there (b"" when its peer closed it);
    None while it has sent nothing."""
    try:
        return sock.recv(8, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


class Lobby(Generic[T]):
    """Silent connections by host, oldest first: at most `per_host` from one host and `total`
    from all. Beyond either, `overflow` picks the oldest of that host (or of the host holding
    most), unless it has spoken meanwhile, to be closed."""

    def __init__(self, per_host: int, total: int) -> None:
        self.per_host, self.total = per_host, total
        self._hosts: dict[str, dict[T, float]] = {}  # insertion order: oldest first
        self._host_of: dict[T, str] = {}

    def __len__(self) -> int:
        return len(self._host_of)

    def __contains__(self, item: object) -> bool:
        return item in self._host_of

    def add(self, item: T, host: str, now: float) -> None:
        self._hosts.setdefault(host, {})[item] = now
        self._host_of[item] = host

    def remove(self, item: T) -> None:
        host = self._host_of.pop(item, None)
        if host is None:
            return
        waiting = self._hosts[host]
        del waiting[item]
        if not waiting:
            del self._hosts[host]

    def overflow(self, host: str, spoke: Callable[[T], bool], room: int = 0) -> list[T]:
        """Items to close so that `host` is within its share and all within the total less
        `room` (leaving room for newcomers), oldest first. `spoke(item)` is asked of each
        before it is picked: True when it has sent bytes meanwhile (the caller took it on)."""
        closing: list[T] = []
        while self._host_of:
            if len(self._hosts.get(host, ())) > self.per_host:
                chosen = host
            elif len(self._host_of) > self.total - room:
                chosen = max(self._hosts, key=lambda h: len(self._hosts[h]))
            else:
                break
            oldest = next(iter(self._hosts[chosen]))
            self.remove(oldest)
            if not spoke(oldest):
                closing.append(oldest)
        return closing

    def older_than(self, when: float) -> list[T]:
        """Items waiting since before `when`, taken out."""
        old = []
        for waiting in self._hosts.values():
            for item, since in waiting.items():
                if since >= when:
                    break
                old.append(item)
        for item in old:
            self.remove(item)
        return old
