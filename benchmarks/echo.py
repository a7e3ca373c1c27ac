"""The transports' floor: a bare echo with Shoal's message sizes and fan-out, over a gRPC
bidirectional stream or an expert lane's frames on a TLS socket; raw bytes, no protobuf."""

from __future__ import annotations

import argparse
import queue
import signal
import socket
import statistics
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from engine.auth import load_secret
from engine.tls import Identity
from proto import GRPC_OPTIONS, lane, secure_channel, server_credentials

METHOD = "/shoal.bench.Echo/Stream"
_CLOSE = object()


def _identity(data: bytes) -> bytes:
    return data


# Seconds the main thread waits before it looks again for a stop. Python runs a signal's
# handler in the main thread, but the kernel may hand SIGTERM to any of gRPC's threads, and
# then nothing wakes a main thread blocked without a timeout (worker/daemon.py does the same).
TICK = 1.0


def serve(host: str, port: int, reply_bytes: int, identity: Identity | None = None) -> None:
    reply = b"\0" * reply_bytes

    def stream(request_iterator, context):
        for _ in request_iterator:
            yield reply

    handler = grpc.method_handlers_generic_handler(
        "shoal.bench.Echo",
        {"Stream": grpc.stream_stream_rpc_method_handler(stream, _identity, _identity)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    address = f"{host}:{port}"
    bound = (server.add_insecure_port(address) if identity is None
             else server.add_secure_port(address, server_credentials(identity)))
    server.start()
    print(f"echo serving on {host}:{bound}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(TICK):  # see TICK
        pass
    server.stop(0)


def serve_lanes(host: str, port: int, reply_bytes: int, identity: Identity) -> None:
    """The lane's echo: one thread per connection reads a frame and writes the reply, as a
    worker's lane thread does, without the credential check or any compute."""
    context = lane.server_context(identity)
    listener = socket.create_server((host, port))
    reply = b"\0" * reply_bytes
    limits = {lane.HELLO: 4096, lane.MESSAGE: 1 << 30}

    def answer(connection: socket.socket) -> None:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with context.wrap_socket(connection, server_side=True) as sock:
            try:
                lane.read_frame(sock, limits)  # HELLO
                lane.write_frame(sock, lane.READY, b"")
                while True:
                    lane.read_frame(sock, limits)
                    lane.write_frame(sock, lane.MESSAGE, reply)
            except (OSError, lane.LaneClosed):
                return

    print(f"echo serving on {host}:{listener.getsockname()[1]}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    listener.settimeout(TICK)  # see TICK
    while not stop.is_set():
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            continue
        connection.settimeout(None)
        threading.Thread(target=answer, args=(connection,), daemon=True).start()
    listener.close()


def lane_round_trips(addresses: list[str], request_bytes: int, count: int, identity: Identity,
                     warmup: int = 20) -> float:
    """Median seconds for one frame out to every lane echo and every reply back, written and
    read by this thread as the dispatcher does."""
    context = lane.client_context(identity)
    socks = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        sock = lane.connect(host, int(port), context, 10)
        lane.write_frame(sock, lane.HELLO, b"echo")
        lane.read_frame(sock, {lane.READY: 0})
        socks.append(sock)
    payload = b"\1" * request_bytes
    limits = {lane.MESSAGE: 1 << 30}
    times = []
    for i in range(warmup + count):
        started = time.perf_counter()
        for sock in socks:
            lane.write_frame(sock, lane.MESSAGE, payload)
        for sock in socks:
            lane.read_frame(sock, limits)
        if i >= warmup:
            times.append(time.perf_counter() - started)
    for sock in socks:
        sock.close()
    return statistics.median(times)


def round_trips(addresses: list[str], request_bytes: int, count: int, warmup: int = 20,
                identity: Identity | None = None) -> float:
    """Median seconds for one message out to every address and every reply back; over TLS
    as Shoal's links when given the cluster's identity."""
    channels = [grpc.insecure_channel(a, options=GRPC_OPTIONS) if identity is None
                else secure_channel(a, identity, GRPC_OPTIONS, door=False) for a in addresses]
    queues, replies = [], []
    for channel in channels:
        call = channel.stream_stream(METHOD, request_serializer=_identity,
                                     response_deserializer=_identity)
        q: queue.SimpleQueue = queue.SimpleQueue()
        queues.append(q)
        replies.append(call(iter(q.get, _CLOSE)))
    payload = b"\1" * request_bytes
    times = []
    for i in range(warmup + count):
        started = time.perf_counter()
        for q in queues:
            q.put(payload)
        for r in replies:
            next(r)
        if i >= warmup:
            times.append(time.perf_counter() - started)
    for q in queues:
        q.put(_CLOSE)
    for channel in channels:
        channel.close()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description="gRPC stream echo server for shoal bench")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--reply-bytes", type=int, required=True)
    parser.add_argument("--secret-file", type=Path, help="serve TLS with this cluster's identity")
    parser.add_argument("--lane", action="store_true",
                        help="echo expert-lane frames on a TLS socket (needs --secret-file)")
    args = parser.parse_args()
    identity = load_secret(args.secret_file).require_identity() if args.secret_file else None
    if args.lane:
        serve_lanes(args.host, args.port, args.reply_bytes, identity)
    else:
        serve(args.host, args.port, args.reply_bytes, identity)


if __name__ == "__main__":
    main()
