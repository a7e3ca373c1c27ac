"""The transport's floor: a bare gRPC bidirectional-stream echo with Shoal's message sizes.

`python -m benchmarks.echo serve --reply-bytes N` answers every message on a stream with N
bytes; `round_trips()` times messages over W such streams at once, the way the dispatcher
addresses W workers per layer. Raw bytes, no protobuf parsing: this is the floor.
"""

from __future__ import annotations

import argparse
import queue
import signal
import statistics
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from engine.auth import load_secret
from engine.tls import Identity
from proto import GRPC_OPTIONS, secure_channel, server_credentials

METHOD = "/shoal.bench.Echo/Stream"
_CLOSE = object()


def _identity(data: bytes) -> bytes:
    return data


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
    stop.wait()
    server.stop(0)


def round_trips(addresses: list[str], request_bytes: int, count: int, warmup: int = 20,
                identity: Identity | None = None) -> float:
    """Median seconds for one message out to every address and every reply back; over TLS
    as Shoal's links when given the cluster's identity."""
    channels = [grpc.insecure_channel(a, options=GRPC_OPTIONS) if identity is None
                else secure_channel(a, identity, GRPC_OPTIONS) for a in addresses]
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
    args = parser.parse_args()
    identity = load_secret(args.secret_file).require_identity() if args.secret_file else None
    serve(args.host, args.port, args.reply_bytes, identity)


if __name__ == "__main__":
    main()
