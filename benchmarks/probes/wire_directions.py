"""Which way a decode layer call's wire time goes (the request's way, the worker's own time,
its write of the reply, the reply's way), median us per call and worker, in a real cluster on
one machine (one monotonic clock); the workers run through this module (`--as-worker`)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.checkpoints import bench_files
from benchmarks.measure import bench_prompt, timed_generation
from coordinator.dataplane import link
from coordinator.decoding.generate import open_remote_model
from coordinator.ops.local_processes import start_workers, stop_workers
from engine.auth import load_secret
from engine.process import launch_directly
from proto import lane as lane_wire
from worker import daemon, lane_server

TIMES_DIR = "SHOAL_WIRE_DIRECTIONS_DIR"  # parent -> worker: where each worker writes its times


def as_worker(argv: list[str]) -> None:
    """Run worker.daemon with argv, its Compute messages timed (see the module's docstring)."""
    times: list[tuple[str, float]] = []
    answer, write_frame = lane_server.ComputeAnswers.answer, lane_server.write_frame

    def timed_answer(self, data):
        times.append(("received", time.perf_counter()))
        reply = answer(self, data)
        if reply is not None:
            times.append(("answered", time.perf_counter()))
        return reply

    def timed_write_frame(sock, kind, payload):
        write_frame(sock, kind, payload)
        if kind == lane_wire.MESSAGE:
            times.append(("replied", time.perf_counter()))

    def keep_writing() -> None:
        path = Path(os.environ[TIMES_DIR]) / f"{os.getpid()}.json"
        while True:
            time.sleep(0.5)
            path.write_text(json.dumps(times))

    lane_server.ComputeAnswers.answer, lane_server.write_frame = timed_answer, timed_write_frame
    threading.Thread(target=keep_writing, daemon=True).start()
    sys.argv = ["shoal-worker", *argv]
    daemon.main()


def run(quick: bool) -> dict:
    events: dict[str, list[tuple[str, float]]] = {}
    send, receive = link.WorkerLink.send, link.WorkerLink.receive

    def timed_send(self, request: bytes, lane: int = 0, *, reply: bool = True,
                   timeout: float = link.FIRST_REPLY_TIMEOUT) -> None:
        queued = time.perf_counter()
        send(self, request, lane, reply=reply, timeout=timeout)
        if reply:
            events.setdefault(self.address, []).append(("queued", queued))
            events[self.address].append(("written", time.perf_counter()))

    def timed_receive(self, timeout: float, lane: int = 0) -> bytes:
        reply = receive(self, timeout, lane)
        events.setdefault(self.address, []).append(("held", time.perf_counter()))
        return reply

    link.WorkerLink.send, link.WorkerLink.receive = timed_send, timed_receive
    _, sharded, secret, logs = bench_files(quick, "wire-directions-logs")
    folder = tempfile.mkdtemp()
    os.environ[TIMES_DIR] = folder
    # start_workers runs PREFIX python -m worker.daemon ARGS: this module takes that over
    prefix = [sys.executable, "-m", "benchmarks.probes.wire_directions", "--as-worker"]
    workers = start_workers([[sharded / f"worker-{k}"] for k in range(2)], secret, logs,
                            places=[(prefix, "127.0.0.1")] * 2)
    try:
        remote = open_remote_model(sharded, [w.address for w in workers], load_secret(secret))
        try:
            prompt = bench_prompt(remote.manifest.config["vocab_size"], 16)
            timed_generation(remote.model, remote.tokenizer, prompt, 8)  # warm-up
            skip = {address: len(e) // 2 for address, e in events.items()}  # calls so far
            timed_generation(remote.model, remote.tokenizer, prompt, 32)
            time.sleep(1.2)  # the workers' last write
        finally:
            remote.close()
        pids = {w.address: w.proc.pid for w in workers}
    finally:
        stop_workers(workers)
    out = {}
    for address, seen in events.items():
        queued = [t for kind, t in seen if kind == "queued"]
        held = [t for kind, t in seen if kind == "held"]
        theirs = json.loads((Path(folder) / f"{pids[address]}.json").read_text())
        written = [t for kind, t in seen if kind == "written"]
        received = [t for kind, t in theirs if kind == "received"]
        answered = [t for kind, t in theirs if kind == "answered"]
        replied = [t for kind, t in theirs if kind == "replied"] or answered  # gRPC: no hook
        calls = range(skip[address], min(len(queued), len(held), len(received), len(replied)))

        out[f"worker-{len(out)}"] = {
            "calls": len(calls),
            "write_us": _median_us(written, queued, calls),
            "request_way_us": _median_us(received, written, calls),
            "worker_us": _median_us(answered, received, calls),
            "reply_write_us": _median_us(replied, answered, calls),
            "reply_way_us": _median_us(held, replied, calls),
            "round_trip_us": _median_us(held, queued, calls),
        }
    return out


def _median_us(later: list[float], earlier: list[float], calls: range) -> float:
    return round(1e6 * statistics.median(later[i] - earlier[i] for i in calls))


def main() -> None:
    if sys.argv[1:2] == ["--as-worker"]:  # PREFIX python -m worker.daemon ARGS
        rest = sys.argv[2:]
        if rest[1:3] != ["-m", "worker.daemon"]:
            raise SystemExit(f"--as-worker expects PYTHON -m worker.daemon ARGS, got {rest}")
        as_worker(rest[3:])
        return
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.wire_directions",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny checkpoint")
    args = parser.parse_args()
    launch_directly()  # as `shoal` does, before any kernel (engine/process.py)
    print(json.dumps(run(args.quick), indent=1))


if __name__ == "__main__":
    main()
