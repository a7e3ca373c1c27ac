"""Start and stop shoal-worker processes, and `shoal serve`, on this machine (for `shoal demo`,
benchmarks, tests)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ShoalError

START_TIMEOUT = 120.0
_READY = re.compile(r"serving .* on (\S+:\d+)$", re.MULTILINE)


@dataclass
class LocalWorker:
    proc: subprocess.Popen
    address: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `grace` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(grace)


def start_worker(
    stores: Sequence[Path],
    secret_file: Path,
    log: Path,
    extra: Sequence[str] = (),
    *,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
    timeout: float = START_TIMEOUT,
) -> LocalWorker:
    """Launch `shoal-worker` on a free port of `host` and wait until it serves (bounded).
    `prefix` runs it through another command (`ip netns exec NS` for a namespace)."""
    cmd = [*prefix, sys.executable, "-m", "worker.daemon", "--host", host, "--port", "0",
           "--secret-file", str(secret_file), *extra]
    for store in stores:
        cmd += ["--store", str(store)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            cwd=Path(__file__).resolve().parents[1],
        )
    worker = LocalWorker(proc, "", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = _READY.search(worker.output())
        if match:
            worker.address = match.group(1)
            return worker
        if proc.poll() is not None:
            raise ShoalError(f"a local worker exited with status {proc.returncode}:\n"
                             f"{worker.output().strip()}")
        time.sleep(0.05)
    worker.stop()
    raise ShoalError(f"a local worker did not start within {timeout:.0f} s; see {log}")


def start_workers(
    store_groups: Sequence[Sequence[Path]],
    secret_file: Path,
    log_dir: Path,
    places: Sequence[tuple[Sequence[str], str]] = (),
) -> list[LocalWorker]:
    """Start one worker per group of stores; if any fails, stop those already started.
    `places` gives each worker a (command prefix, host) other than loopback."""
    workers: list[LocalWorker] = []
    try:
        for index, stores in enumerate(store_groups):
            prefix, host = places[index] if places else ((), "127.0.0.1")
            # Found by address, not by Bonjour: advertising would only announce several
            # workers that share this machine's node id.
            workers.append(start_worker(stores, secret_file, log_dir / f"worker-{index}.log",
                                        ("--no-advertise",), host=host, prefix=prefix))
    except BaseException:
        stop_workers(workers)
        raise
    return workers


def stop_workers(workers: Sequence[LocalWorker]) -> None:
    """Signal all first, then wait for each: they shut down in parallel."""
    for worker in workers:
        if worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGTERM)
    for worker in workers:
        worker.stop()


_SERVING = re.compile(r"on (http://\S+:\d+)/v1")


@dataclass
class LocalServer:
    proc: subprocess.Popen
    url: str  # http://HOST:PORT, without /v1
    log: Path

    def stop(self, grace: float = 15.0) -> None:
        LocalWorker(self.proc, "", self.log).stop(grace)


def start_server(
    model: Path, workers: Sequence[str], secret_file: Path, log: Path,
    extra: Sequence[str] = (), *, timeout: float = START_TIMEOUT,
) -> LocalServer:
    """Launch `shoal serve` over `workers` on a free loopback port and wait until it
    answers (bounded)."""
    cmd = [sys.executable, "-m", "coordinator.cli", "serve", "--model", str(model),
           "--workers", ",".join(workers), "--port", "0", "--secret-file", str(secret_file),
           *extra]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            cwd=Path(__file__).resolve().parents[1],
        )
    server = LocalServer(proc, "", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = _SERVING.search(log.read_text(errors="replace"))
        if match:
            server.url = match.group(1)
            return server
        if proc.poll() is not None:
            raise ShoalError(f"shoal serve exited with status {proc.returncode}:\n"
                             f"{log.read_text(errors='replace').strip()}")
        time.sleep(0.1)
    server.stop()
    raise ShoalError(f"shoal serve did not start within {timeout:.0f} s; see {log}")
