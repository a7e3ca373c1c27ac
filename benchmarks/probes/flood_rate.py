"""What share of its calm speed does a running `shoal serve` stream keep while a helper floods
the server with idle sockets? (The tests bound only its longest wait: a ratio depends on the
machine's load.) `python -m benchmarks.probes.flood_rate [--quick] [--sockets N] [--hosts N]`"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

from benchmarks.checkpoints import WORKERS, bench_files
from benchmarks.measure import bench_prompt
from benchmarks.records import write_record
from coordinator.ops.local_processes import start_server, start_workers, stop_workers
from engine.errors import ShoalError
from engine.manifest import read_manifest

WINDOW_SECONDS = 8.0
STREAM_TOKENS = 3500  # under the bench checkpoints' context, longer than both windows


def _stream(url: str, prompt: list[int], times: list[float], stop: threading.Event) -> None:
    import openai  # the client only this probe needs

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    for _ in client.completions.create(model="bench", prompt=prompt, max_tokens=STREAM_TOKENS,
                                       temperature=0, stream=True):
        times.append(time.monotonic())
        if stop.is_set():
            return


def _rate(times: list[float], start: float, end: float) -> float:
    return sum(start <= t < end for t in times) / (end - start)


def run(*, quick: bool, sockets: int, hosts: int) -> dict:
    _, sharded, secret_file, log_dir = bench_files(quick)
    vocab = int(read_manifest(sharded).config["vocab_size"])
    workers = start_workers([[sharded / f"worker-{k}"] for k in range(WORKERS)], secret_file,
                            log_dir)
    server = flood = None
    stop, times = threading.Event(), []
    try:
        server = start_server(sharded, [w.address for w in workers], secret_file,
                              log_dir / "flood-rate.log", ("--model-id", "bench"))
        reader = threading.Thread(target=_stream, args=(server.url, bench_prompt(vocab, 16),
                                                        times, stop), daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while len(times) < 5:
            if not reader.is_alive() or time.monotonic() > deadline:
                raise ShoalError("the stream did not start (see the server's log)")
            time.sleep(0.05)
        calm_start = time.monotonic()
        time.sleep(WINDOW_SECONDS)
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        flood = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.socket_flood", host, port, "--sockets",
             str(sockets), "--hosts", str(hosts), "--seconds", str(WINDOW_SECONDS + 2)],
            stdout=subprocess.PIPE, text=True)
        flood.stdout.readline()  # holding N
        flood_start = time.monotonic()
        time.sleep(WINDOW_SECONDS)
        flood_end = time.monotonic()
        stop.set()
        calm = _rate(times, calm_start, calm_start + WINDOW_SECONDS)
        flooded = _rate(times, flood_start, flood_end)
        return {"sockets": sockets, "hosts": hosts, "calm_tokens_per_second": calm,
                "flood_tokens_per_second": flooded, "share_kept": flooded / calm}
    finally:
        stop.set()
        if flood is not None and flood.poll() is None:
            flood.kill()
            flood.wait(10)
        if server is not None:
            server.stop()
        stop_workers(workers)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.flood_rate",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny checkpoint")
    parser.add_argument("--sockets", type=int, default=3000, help="idle sockets (3000)")
    parser.add_argument("--hosts", type=int, default=100,
                        help="loopback addresses they come from (100)")
    args = parser.parse_args()
    report = run(quick=args.quick, sockets=args.sockets, hosts=args.hosts)
    write_record(what="flood-rate" + ("-quick" if args.quick else ""), figures=report)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
