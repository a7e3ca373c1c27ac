"""The shoal-worker command's start and stop, with real processes on loopback: a taken port
is refused before any expert is loaded (another worker's too: no SO_REUSEPORT sharing), bad
arguments likewise, and SIGTERM while a coordinator computes on it ends it with status 0,
every time (it used to abort with SIGABRT in about one stop in three)."""

import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from coordinator.decoding.generate import open_remote_model
from engine.auth import load_secret
from engine.sharding import shard

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store(tiny_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("daemon") / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, workers=1, progress=False)
    return out


def worker_command(store: Path, secret_file: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "worker.daemon", "--store", str(store / "worker-0"),
            "--secret-file", str(secret_file), "--no-advertise", "--host", "127.0.0.1", *extra]


def run_worker(store: Path, secret_file: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(worker_command(store, secret_file, *extra), capture_output=True,
                          text=True, timeout=60, cwd=REPO)


def test_a_port_another_worker_serves_on_is_refused(store, secret_file, start_worker):
    first = start_worker([store / "worker-0"], "--no-advertise")
    port = first.address.rsplit(":", 1)[1]
    second = run_worker(store, secret_file, "--port", port)
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in second.stderr
    assert "serving" not in second.stdout  # it never started beside the first
    assert first.proc.poll() is None


def test_a_port_another_program_holds_is_refused_before_loading(store, secret_file):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        run = run_worker(store, secret_file, "--port", str(taken.getsockname()[1]))
    assert run.returncode == 2 and "the port is in use" in run.stderr
    # Refused before the stores were scanned and verified: no budget line, no expert loaded.
    assert "memory budget" not in run.stdout + run.stderr


@pytest.mark.parametrize("args, message", [
    (("--readers", "0"), "--readers must be at least 1"),
    (("--memory-budget", "lots"), "lots"),
    (("--node-id", "not ok!"), "node id 'not ok!' is not valid"),
])
def test_bad_arguments_are_refused_before_loading(store, secret_file, args, message):
    run = run_worker(store, secret_file, "--port", "0", *args)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert "memory budget" not in run.stdout


STOPS = 6


@pytest.mark.slow
def test_sigterm_mid_compute_exits_cleanly_every_time(tiny_checkpoint, tmp_path, start_worker,
                                                      secret_file):
    sharded = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), sharded, progress=False)
    secret = load_secret(secret_file)
    codes = []
    for _ in range(STOPS):
        worker = start_worker([sharded / "experts"], "--no-advertise")
        remote = open_remote_model(sharded, [worker.address], secret)
        computed = threading.Event()
        stop = threading.Event()

        def compute(dispatcher=remote.dispatcher, computed=computed, stop=stop):
            while not stop.is_set():
                try:
                    dispatcher(0, mx.ones((1, 4, 64)), mx.array([[[0, 1]] * 4]))
                except Exception:  # the worker went away: expected, this is the test
                    return
                computed.set()

        thread = threading.Thread(target=compute, daemon=True)
        thread.start()
        assert computed.wait(30)
        worker.proc.send_signal(signal.SIGTERM)
        codes.append(worker.proc.wait(30))
        stop.set()
        thread.join(30)
        remote.close()
        assert "stopped" in worker.output()
    assert codes == [0] * STOPS
