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

import grpc

from proto import GRPC_OPTIONS

METHOD = "/shoal.bench.Echo/Stream"
_CLOSE = object()


def _identity(data: bytes) -> bytes:
    return data


def serve(host: str, port: int, reply_bytes: int) -> None:
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
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    print(f"echo serving on {host}:{bound}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(0)


def round_trips(addresses: list[str], request_bytes: int, count: int, warmup: int = 20) -> float:
    """Median seconds for one message out to every address and every reply back."""
    channels = [grpc.insecure_channel(a, options=GRPC_OPTIONS) for a in addresses]
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
    args = parser.parse_args()
    serve(args.host, args.port, args.reply_bytes)


if __name__ == "__main__":
    main()
