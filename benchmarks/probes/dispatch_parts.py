"""The coordinator's own cost per decode layer call, workers replaced by in-process stand-ins
(no network, no expert compute): the dispatcher's `send` and `parse_scatter` parts, us per
call, on the bench checkpoint's shapes."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

from coordinator.cluster.snapshot import Snapshot
from coordinator.dataplane.dispatch import Dispatcher
from coordinator.dataplane.link import answer_of, request_bytes
from engine.placement import replica_routes
from engine.process import launch_directly
from proto import EXPERT_REPLY, EXPERT_REQUEST, shoal_pb2

WIDTH, TOP_K, EXPERTS, WORKERS = 1024, 8, 64, 2


class _Link:
    """A worker that answers at once with zeros of the right shape."""

    in_process = False
    path = "stand-in"

    def __init__(self, index: int) -> None:
        self.address = f"stand-in-{index}"
        self.inventory = None
        self._requests: list[bytes] = []

    def whole(self, layer, x, inds, timing=None) -> None:
        return None

    def submit(self, share, timeout: float) -> int:
        request = request_bytes(share)
        self.send(request)
        return len(request)

    def collect(self, share, timeout: float):
        return answer_of(self.receive(timeout), self.address)

    def send(self, request: bytes, lane: int = 0, *, reply: bool = True,
             timeout: float = 0.0) -> None:
        self._requests.append(request)

    def receive(self, timeout: float, lane: int = 0) -> bytes:
        request, tensors = EXPERT_REQUEST.read(self._requests.pop(0), "request")
        output = np.zeros((tensors["experts"].shape[0], WIDTH), np.float32)
        return EXPERT_REPLY.write(
            shoal_pb2.ExpertReply(seq=request.seq, timing=shoal_pb2.WorkerTiming()),
            output=(output, "float32"))

    def reset(self) -> None:
        self._requests.clear()

    def end_pass(self) -> None:
        pass


class _Cluster:
    def __init__(self) -> None:
        holdings = [frozenset((0, e) for e in range(EXPERTS) if e % WORKERS == w)
                    for w in range(WORKERS)]
        self.current = Snapshot(tuple(_Link(w) for w in range(WORKERS)), tuple(holdings),
                                replica_routes({0: EXPERTS}, holdings), 1)


def run(calls: int) -> dict:
    dispatcher = Dispatcher(_Cluster())
    rng = np.random.default_rng(0)
    x = mx.random.normal((1, 1, WIDTH))
    seconds = []
    for i in range(calls + 100):
        inds = mx.array(rng.choice(EXPERTS, TOP_K, replace=False).astype(np.int32)
                        .reshape(1, 1, TOP_K))
        hidden = x + i
        mx.eval(hidden, inds)
        if i == 100:
            dispatcher.stats.reset()
        started = time.perf_counter()
        mx.eval(dispatcher(0, hidden, inds))
        if i >= 100:
            seconds.append(time.perf_counter() - started)
    decode = dispatcher.stats.decode
    return {"device": str(mx.default_device()), "calls": calls,
            "call_us_median": round(1e6 * statistics.median(seconds), 1),
            "send_us": round(1e6 * decode.send_seconds / decode.calls, 1),
            "parse_scatter_us": round(1e6 * decode.parse_scatter_seconds / decode.calls, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.dispatch_parts",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="timed calls (default 500)")
    calls = parser.parse_args().calls
    launch_directly()  # as `shoal` does, before any kernel (engine/process.py)
    print(json.dumps(run(calls), indent=1))


if __name__ == "__main__":
    main()
