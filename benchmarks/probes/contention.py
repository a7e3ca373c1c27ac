"""Does expert compute get faster by running on two cores of this machine? Decode-shaped requests
in worker processes (`Residency.compute`, no gRPC): one alone, two at once, and two beside a
third process keeping a core busy as the coordinator does."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from builders.demo_models import cache_root
from worker.residency import Request, Residency
from worker.store import scan_stores

REPO = Path(__file__).resolve().parents[2]
REQUESTS = 330
BUSY_SECONDS = 8.0


def worker(store: Path, seed: int, start_at: float) -> None:
    residency = Residency(scan_stores([store], verify=False))
    rng = np.random.default_rng(seed)
    held: dict[int, list[int]] = {}
    for layer, expert in residency.held():
        held.setdefault(layer, []).append(expert)
    layers = sorted(held)
    requests = [
        Request(layer,
                rng.standard_normal((1, residency.runners[layer].input_width)).astype(np.float32),
                "float32", np.zeros(4, np.int32),
                rng.choice(held[layer], 4, replace=False).astype(np.int32))
        for layer in (layers[i % len(layers)] for i in range(REQUESTS))
    ]
    for request in requests[: 2 * len(layers)]:
        residency.compute(request)
    time.sleep(max(0.0, start_at - time.time()))
    started = time.perf_counter()
    for request in requests:
        residency.compute(request)
    ms = 1e3 * (time.perf_counter() - started) / len(requests)
    print(f"  worker {store.name}: {ms:.2f} ms per 4-expert request", flush=True)


def busy(start_at: float) -> None:
    weights = mx.quantize(mx.random.normal((3, 512, 1024)), 64, 4)
    x = mx.random.normal((1, 1024))
    mx.eval(weights, x)
    time.sleep(max(0.0, start_at - time.time()))
    started, steps = time.perf_counter(), 0
    while time.perf_counter() - started < BUSY_SECONDS:
        mx.eval(mx.quantized_matmul(x, *weights, group_size=64, bits=4))
        steps += 1
    print(f"  busy thread: {1e3 * BUSY_SECONDS / steps:.2f} ms per step", flush=True)


def together(roles: list[list[str]]) -> None:
    start_at = str(time.time() + 5.0)  # every process loads first, then all start at once
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.probes.contention", *role,
                               start_at], cwd=REPO) for role in roles]
    for proc in procs:
        proc.wait(600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        if args.role[0] == "busy":
            busy(float(args.role[1]))
        else:
            worker(Path(args.role[0]), int(args.role[1]), float(args.role[2]))
        return
    stores = cache_root() / "bench" / "full" / "sharded-w2"
    if not stores.exists():
        sys.exit(f"no benchmark stores at {stores}: run `shoal bench` once first")
    w0, w1 = [str(stores / "worker-0"), "0"], [str(stores / "worker-1"), "1"]
    for name, roles in (("one worker alone", [w0]), ("two workers at once", [w0, w1]),
                        ("two workers and a busy thread", [w0, w1, ["busy"]])):
        print(name, flush=True)
        together(roles)


if __name__ == "__main__":
    main()
