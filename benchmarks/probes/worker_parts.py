"""One worker's decode request in process, part by part (validate, count, build the gathered
call, evaluate, record): what the worker's "bookkeeping" in `shoal bench`'s breakdown is made
of on this backend; `--gap` idles before each request, as in a cluster."""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np

from benchmarks.checkpoints import bench_checkpoint
from engine import tensors
from engine.process import launch_directly
from engine.tensors import mlx_dtype, to_mlx
from worker.residency import Request, Residency
from worker.store import scan_stores

# "record" notes the request's heat before the reply; "settle" counts it after the reply is
# sent (worker/holdings.py), off the reply's path
PARTS = ("validate", "count", "build", "evaluate", "record", "settle")
# "build" split in two, once more after the timed pass: the arrays into MLX, then the graph;
# "advice" is the part of to_mlx spent in engine.tensors.to_gpu_reader (CUDA only)
BUILD_PARTS = ("to_mlx", "advice", "graph")


def requests(residency: Residency, count: int, experts_per_row: int = 4) -> list[Request]:
    held: dict[int, list[int]] = {}
    for layer, expert in residency.held():
        held.setdefault(layer, []).append(expert)
    rng = np.random.default_rng(0)
    layers = sorted(held)
    out = []
    for i in range(count):
        layer = layers[i % len(layers)]
        hidden = rng.standard_normal((1, residency.runners[layer].input_width))
        experts = rng.choice(held[layer], experts_per_row, replace=False).astype(np.int32)
        out.append(Request(layer, hidden.astype(np.float32), "float32",
                           np.zeros(experts_per_row, np.int32), experts))
    return out


def idle(seconds: float) -> None:
    if seconds:
        time.sleep(seconds)


def run(quick: bool, count: int, gap: float = 0.0) -> dict:
    _, sharded = bench_checkpoint(quick)
    residency = Residency(scan_stores([sharded / "worker-0"], verify=False))
    warm, timed = requests(residency, 100), requests(residency, count)
    for request in warm:
        residency.compute(request)
    seconds = dict.fromkeys(PARTS, 0.0)
    for r in timed:
        idle(gap)
        t0 = time.perf_counter()
        runner = residency.validate(r)
        stack = residency._stack(r.layer)
        t1 = time.perf_counter()
        distinct = int(np.count_nonzero(np.bincount(r.experts)))
        residency.cache.count_resident(r.layer, distinct, r.experts.size)
        positions = stack.positions[r.experts]
        t2 = time.perf_counter()
        out = runner.gathered(stack.params, r.hidden, mlx_dtype(r.dtype), r.rows, positions)
        t3 = time.perf_counter()
        mx.eval(out)
        t4 = time.perf_counter()
        residency.holdings.asked(r.layer, r.experts)
        t5 = time.perf_counter()
        residency.holdings.settle()
        t6 = time.perf_counter()
        for part, took in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5),
                              strict=True):
            seconds[part] += took
    whole = 0.0
    for r in timed:
        idle(gap)
        started = time.perf_counter()
        residency.compute(r)
        whole += (time.perf_counter() - started) / count
    build = dict.fromkeys(BUILD_PARTS, 0.0)
    advise = tensors.to_gpu_reader

    def timed_advice(array: mx.array) -> None:
        before = time.perf_counter()
        advise(array)
        build["advice"] += time.perf_counter() - before

    tensors.to_gpu_reader = timed_advice  # to_mlx looks it up at each call
    try:
        for r in timed:  # as ExpertRunner.gathered builds a decode request's call
            runner, stack = residency.runners[r.layer], residency._stack(r.layer)
            positions = stack.positions[r.experts].reshape(1, -1)
            idle(gap)
            t0 = time.perf_counter()
            x, inds = to_mlx(([r.hidden], mlx_dtype(r.dtype)), ([positions], mx.int32))
            t1 = time.perf_counter()
            out = runner.module(x, inds)
            t2 = time.perf_counter()
            mx.eval(out)
            build["to_mlx"] += t1 - t0
            build["graph"] += t2 - t1
    finally:
        tensors.to_gpu_reader = advise
    residency.close()
    return {"device": str(mx.default_device()), "requests": count, "gap_us": 1e6 * gap,
            "parts_us": {p: 1e6 * s / count for p, s in seconds.items()},
            "build_parts_us": {p: 1e6 * s / count for p, s in build.items()},
            "compute_us": 1e6 * whole}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.worker_parts",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny checkpoint")
    parser.add_argument("--requests", type=int, default=2000, metavar="N",
                        help="timed decode requests (default 2000)")
    parser.add_argument("--gap", type=float, default=0.0, metavar="US",
                        help="idle this many microseconds before each timed request "
                             "(default 0: back to back)")
    args = parser.parse_args(argv)
    launch_directly()  # as shoal-worker does, before any kernel (engine/process.py)
    print(json.dumps(run(args.quick, args.requests, args.gap / 1e6), indent=1))


if __name__ == "__main__":
    main()
