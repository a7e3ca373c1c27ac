"""Fixtures shared by the whole test suite: tiny random checkpoints built once per session,
the cluster secret, and real shoal-worker processes that are killed by PID at teardown."""

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.auth import create_secret
from engine.synthetic import build_checkpoint

REPO = Path(__file__).resolve().parents[1]
WORKER_START_TIMEOUT = 90.0

TinyCheckpoint = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """A factory: tiny_checkpoint(family, quantize_bits=None, layout="mlx") -> checkpoint folder.

    Each combination is built once per session (seed 0) and shared by every test
    that asks for it, so treat the folder as read-only: copy it (shutil.copytree)
    before changing anything in it.
    """
    built: dict[tuple[str, int | None, str], Path] = {}

    def get(family: str, quantize_bits: int | None = None, layout: str = "mlx") -> Path:
        key = (family, quantize_bits, layout)
        if key not in built:
            bits = "f32" if quantize_bits is None else f"q{quantize_bits}"
            # mktemp gives a fresh numbered folder, so a build that failed half-way
            # (and was therefore not cached) never leaves files for the next attempt.
            out_dir = tmp_path_factory.mktemp(f"{family}-{layout}-{bits}")
            built[key] = build_checkpoint(
                out_dir, family, quantize_bits=quantize_bits, layout=layout
            )
        return built[key]

    return get


@pytest.fixture(scope="session")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_secret(tmp_path_factory.mktemp("secret") / "secret")


@dataclass
class RunningWorker:
    proc: subprocess.Popen
    address: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen, grace: float = 5.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)


def launch_worker(
    stores: list[Path], secret: Path, log: Path, extra: tuple[str, ...] = ()
) -> RunningWorker:
    """Start `shoal-worker` on a free loopback port and wait (bounded) until it serves."""
    cmd = [sys.executable, "-m", "worker.daemon", "--host", "127.0.0.1", "--port", "0",
           "--secret-file", str(secret), *extra]
    for store in stores:
        cmd += ["--store", str(store)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + WORKER_START_TIMEOUT
    while time.monotonic() < deadline:
        match = re.search(r" on (127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
        if match:
            return RunningWorker(proc, match.group(1), log)
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.05)
    stop_process(proc)
    raise RuntimeError(f"worker did not start in {WORKER_START_TIMEOUT} s:\n{log.read_text()}")


@pytest.fixture
def start_worker(
    secret_file: Path, tmp_path: Path
) -> Iterator[Callable[..., RunningWorker]]:
    """A factory: start_worker([store, ...], *extra_args) -> RunningWorker; all are stopped."""
    started: list[RunningWorker] = []

    def start(stores: list[Path], *extra: str) -> RunningWorker:
        log = tmp_path / f"worker-{len(started)}.log"
        worker = launch_worker(stores, secret_file, log, extra)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
