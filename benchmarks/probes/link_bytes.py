"""What moving one MoE layer call's bytes costs without expert work: the coordinator's links to
real servicers whose experts answer zeros at once, against the bare gRPC echo of the same sizes
and fan-out, median ms per call."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks.echo import round_trips
from benchmarks.echo import serve as echo_serve
from benchmarks.records import REPO
from benchmarks.shoal_runs import wait_for_line
from coordinator.dataplane.link import WorkerLink
from engine.auth import CredentialChecker, ensure_secret, load_secret
from proto import EXPERT_REPLY, EXPERT_REQUEST, add_expert_service, shoal_pb2
from worker.daemon import bind
from worker.residency import Request, Timing
from worker.service import ExpertServicer

WIDTH, TOP_K, WORKERS = 1024, 8, 2  # the bench checkpoint's shapes
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def keep_large_blocks() -> bool:
    """glibc only: blocks up to 32 MB (its ceiling) from the heap, up to 256 MB of freed heap
    kept; True if glibc took both."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 and mallopt(M_TRIM_THRESHOLD, 256 << 20) == 1


class _Holdings:
    version = 1

    def settle(self) -> None:
        pass


class _StandInExperts:
    """In place of a Residency: every pair's output is zeros, computed at once."""

    holdings = _Holdings()

    def compute(self, request: Request, timing: Timing) -> mx.array:
        out = mx.zeros((request.rows.size, request.hidden.shape[1]), mx.bfloat16)
        mx.eval(out)
        return out


class _StandInServicer(ExpertServicer):
    def __init__(self) -> None:  # noqa: D107 (no stores, no files: Compute only)
        self.residency = _StandInExperts()
        self.node_id = "stand-in"


def serve(secret_file: Path) -> None:
    """The stand-in worker: prints its address, serves until killed."""
    secret = load_secret(secret_file)
    server, port = bind("127.0.0.1", 0, futures.ThreadPoolExecutor(8),
                        CredentialChecker(secret), secret.require_identity())
    add_expert_service(_StandInServicer(), server)
    server.start()
    print(f"stand-in serving on 127.0.0.1:{port}", flush=True)
    time.sleep(3600)


def link_calls(addresses: list[str], secret_file: Path, tokens: int, calls: int) -> float:
    """Median seconds of one layer call: a request to every worker, then every reply."""
    links = [WorkerLink(a, load_secret(secret_file)) for a in addresses]
    hidden = np.zeros((tokens, WIDTH), np.uint16)  # bfloat16's bytes
    per_worker = TOP_K // WORKERS
    rows = np.repeat(np.arange(tokens, dtype=np.int32), per_worker)
    experts = np.tile(np.arange(per_worker, dtype=np.int32), tokens)
    times = []
    try:
        for i in range(calls + 5):
            started = time.perf_counter()
            for link in links:  # written and read as dispatch does
                link.send(EXPERT_REQUEST.write(
                    shoal_pb2.ExpertRequest(seq=i + 1, layer=1, call_pairs=tokens * TOP_K),
                    hidden=(hidden, "bfloat16"), rows=(rows, "int32"),
                    experts=(experts, "int32")))
            for link in links:
                _, tensors = EXPERT_REPLY.read(link.receive(60.0), "reply")
                np.frombuffer(tensors["output"].data, np.uint16)
            if i >= 5:
                times.append(time.perf_counter() - started)
    finally:
        for link in links:
            link.close()
    return statistics.median(times)


@contextlib.contextmanager
def servers(folder: Path, args: list[str]) -> Iterator[list[str]]:
    """WORKERS processes of this module run with `args` (stand-in workers or echo servers),
    their addresses once each serves (bounded: bench.wait_for_line); killed by PID after."""
    logs = [folder / f"{args[0].strip('-')}-{k}.log" for k in range(WORKERS)]
    procs = []
    try:
        for log in logs:
            with open(log, "w") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.probes.link_bytes", *args],
                    stdout=out, stderr=subprocess.STDOUT, cwd=REPO))
        yield [wait_for_line(log, r"on (\S+:\d+)") for log in logs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


def run(tokens: int, calls: int, keep: bool) -> dict:
    kept = keep_large_blocks() if keep else False
    flags = ["--keep-large-blocks"] if keep else []
    with tempfile.TemporaryDirectory() as tmp:
        secret_file = Path(tmp) / "secret"
        ensure_secret(secret_file)
        request_bytes = tokens * WIDTH * 2
        reply_bytes = tokens * TOP_K // WORKERS * WIDTH * 2
        with servers(Path(tmp), ["--serve", str(secret_file), *flags]) as addresses:
            shoal = link_calls(addresses, secret_file, tokens, calls)
        with servers(Path(tmp), ["--echo", str(secret_file), "--reply-bytes", str(reply_bytes),
                                 *flags]) as addresses:
            echo = round_trips(addresses, request_bytes, calls, warmup=5,
                               identity=load_secret(secret_file).require_identity())
    return {"tokens": tokens, "workers": WORKERS, "request_bytes": request_bytes,
            "reply_bytes": reply_bytes, "large_blocks_kept": kept,
            "shoal_link_ms": round(1e3 * shoal, 2), "echo_ms": round(1e3 * echo, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.link_bytes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512, help="rows of the layer call")
    parser.add_argument("--calls", type=int, default=20, help="timed calls (median)")
    parser.add_argument("--keep-large-blocks", action="store_true",
                        help="glibc's malloc keeps large blocks in every process (see above)")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # a stand-in worker
    parser.add_argument("--echo", type=Path, help=argparse.SUPPRESS)  # an echo server
    parser.add_argument("--reply-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.keep_large_blocks:
        keep_large_blocks()
    if args.serve:
        serve(args.serve)
    elif args.echo:
        echo_serve("127.0.0.1", 0, args.reply_bytes, load_secret(args.echo).require_identity())
    else:
        print(json.dumps(run(args.tokens, args.calls, args.keep_large_blocks)))


if __name__ == "__main__":
    main()
