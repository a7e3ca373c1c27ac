"""The expert lane's wire: Compute's messages (the same bytes as on the gRPC stream) in
length-prefixed frames on a TLS socket, both ends presenting the cluster's certificate."""

from __future__ import annotations

import os
import select
import socket
import ssl
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from engine.errors import MAX_MESSAGE, InvalidInput, Unavailable, clip
from engine.tls import NAME, Identity, door_request

# A frame is a 5-byte header (the payload's length, uint32 little-endian, and its kind), then
# the payload. A lane opens with HELLO (a `shoal-auth` credential for LANE_METHOD) answered by
# READY; then each MESSAGE the coordinator sends is one ExpertRequest, answered in order by one
# ExpertReply MESSAGE when it carries hidden rows. A refusal is an ERROR frame (a gRPC status
# code's number, then its UTF-8 message) after which the worker closes the lane.
HEADER = struct.Struct("<IB")
HELLO, READY, MESSAGE, ERROR = 1, 2, 3, 4
KINDS = {HELLO: "hello", READY: "ready", MESSAGE: "message", ERROR: "error"}
LANE_METHOD = "/shoal.v1.ExpertService/Lane"  # what a lane's credential is made for
HELLO_LIMIT = 1024  # a credential is about 110 bytes
# Larger writes go as two sendall calls (header, payload) rather than one joined copy.
_JOIN_BELOW = 1 << 16
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class LaneClosed(Unavailable):
    """The peer closed the lane (or it broke) where a frame was expected."""


def _context(identity: Identity, purpose: ssl.Purpose) -> ssl.SSLContext:
    """A TLS 1.3 context presenting the cluster's certificate and trusting only its authority.
    Python's ssl loads a certificate and key from a file only: they pass through a private
    temporary file (mode 0600, removed at once)."""
    context = ssl.create_default_context(purpose, cadata=identity.authority.decode())
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    with tempfile.TemporaryDirectory(prefix="shoal-tls-") as folder:
        path = Path(folder) / "identity.pem"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.certificate + identity.key)
        context.load_cert_chain(path)
    return context


def client_context(identity: Identity) -> ssl.SSLContext:
    """For a coordinator: checks that the worker's certificate names NAME (workers are
    reached by address, so the name is the cluster's, as TLS_CHANNEL_OPTIONS says for gRPC)."""
    context = _context(identity, ssl.Purpose.SERVER_AUTH)
    context.check_hostname = True
    return context


def server_context(identity: Identity) -> ssl.SSLContext:
    """For a worker: a client must present a certificate the cluster's authority signed."""
    return _context(identity, ssl.Purpose.CLIENT_AUTH)


def connect(host: str, port: int, context: ssl.SSLContext, timeout: float,
            identity: Identity | None = None) -> ssl.SSLSocket:
    """A TLS lane to host:port, handshake done, with Nagle off (frames are latency-bound).
    With `identity`, the cluster's pass is shown first (engine/tls.py), so that the worker
    keeps this connection a place no stranger can take."""
    raw = socket.create_connection((host, port), timeout=timeout)
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keep_alive(raw)
        if identity is not None:
            raw.sendall(door_request(f"{host}:{port}", identity))
        return context.wrap_socket(raw, server_hostname=NAME)
    except BaseException:
        raw.close()
        raise


def keep_alive(sock: socket.socket) -> None:
    """TCP keepalive probes on an idle lane, so that a peer that vanished (a Mac unplugged)
    is noticed in about 20 s; each platform names the idle time its own way."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPALIVE", 10), ("TCP_KEEPINTVL", 5),
                        ("TCP_KEEPCNT", 2)):
        if hasattr(socket, name):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
            except OSError:
                pass


def watch(sock: ssl.SSLSocket, seconds: float) -> None:
    """Watch `sock` busily for up to `seconds` until it has bytes to read: a thread that then
    reads finds them at once, instead of sleeping in the kernel and being woken (--spin-us)."""
    until = time.perf_counter() + seconds
    while not sock.pending() and not select.select([sock], [], [], 0)[0]:
        if time.perf_counter() >= until:
            return


def write_frame(sock: socket.socket, kind: int, payload: bytes | bytearray | memoryview) -> None:
    header = HEADER.pack(len(payload), kind)
    if len(payload) < _JOIN_BELOW:
        sock.sendall(header + payload)
    else:
        sock.sendall(header)
        sock.sendall(payload)


def write_error(sock: socket.socket, code: grpc.StatusCode, message: str) -> None:
    text = clip(message, MAX_MESSAGE).encode("utf-8", "replace")
    write_frame(sock, ERROR, bytes([code.value[0]]) + text)


# A body is read into a buffer that grows as its bytes arrive, from this size up, so that a
# header announcing a large message costs no memory until the message comes.
_FIRST_BUFFER = 1 << 20


class LaneTimeout(LaneClosed):
    """A lane frame that did not come, or not in full, within its time (read_frame)."""


class LaneIdle(LaneTimeout):
    """No frame began within the idle time (read_frame): nothing was lost."""


def _read_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    while view:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaneTimeout("a lane frame did not arrive in full in time")
            sock.settimeout(left)
        try:
            count = sock.recv_into(view)
        except TimeoutError:
            if deadline is None:  # the socket's own timeout: the caller's to word
                raise
            raise LaneTimeout("a lane frame did not arrive in full in time") from None
        if count == 0:
            raise LaneClosed("the lane was closed")
        view = view[count:]


def read_frame(sock: socket.socket, limits: dict[int, int], *, idle: float | None = None,
               within: float | None = None,
               begun: Callable[[], None] | None = None) -> tuple[int, bytearray]:
    """The next frame's kind and payload. `limits` gives the largest payload accepted for each
    kind expected here; any other kind, or a larger payload, is refused before its body is
    read (InvalidInput). With `idle`, a frame that has not begun within `idle` seconds
    raises LaneIdle, and LaneTimeout does one begun but not complete within `within` seconds
    (the socket's timeout is changed); without, the socket's own timeout applies. `begun` is
    called once the frame's first bytes are in (with `idle` only)."""
    header = bytearray(HEADER.size)
    view = memoryview(header)
    deadline = None
    if idle is not None:
        sock.settimeout(idle)
        try:
            count = sock.recv_into(view)
        except TimeoutError:
            raise LaneIdle(f"the lane was idle for {idle:g} s") from None
        if count == 0:
            raise LaneClosed("the lane was closed")
        view = view[count:]
        deadline = time.monotonic() + (within if within is not None else idle)
        if begun is not None:
            begun()
    _read_into(sock, view, deadline)
    size, kind = HEADER.unpack(header)
    if kind not in limits:
        raise InvalidInput(f"unexpected lane frame kind {kind}")
    if size > limits[kind]:
        raise InvalidInput(f"a lane {KINDS.get(kind, kind)} frame of {size} bytes is over the "
                           f"limit of {limits[kind]}")
    payload = bytearray(min(size, _FIRST_BUFFER))
    got = 0
    while True:
        _read_into(sock, memoryview(payload)[got:], deadline)
        got = len(payload)
        if got == size:
            return kind, payload
        payload += bytes(min(size - got, got))  # doubles, up to the announced size


def read_error(payload: bytes) -> tuple[grpc.StatusCode, str]:
    """An ERROR frame's status code and message."""
    code = _CODES.get(payload[0], grpc.StatusCode.UNKNOWN) if payload else grpc.StatusCode.UNKNOWN
    return code, bytes(payload[1:]).decode("utf-8", "replace")
