"""`shoal generate --workers` with a worker stopped (SIGSTOP: it holds its connections and
answers nothing), as the real command against real workers: stopped before the start, the run
goes on without it where another worker holds its experts, and fails naming it where none
does; stopped mid-run, the run ends without waiting for its heat."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.dataplane.link import CONNECT_TIMEOUT
from engine.sharding import shard

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PROMPT = "the quick brown fox"


def _generate(sharded: Path, workers, secret_file: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "generate", PROMPT, "--model", str(sharded),
         "--workers", ",".join(w.address for w in workers), "--secret-file", str(secret_file),
         *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _tokens(sharded: Path, workers, secret_file: Path) -> tuple[list[int], str, float]:
    started = time.monotonic()
    proc = _generate(sharded, workers, secret_file, "--max-tokens", "8", "--json")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out)["token_ids"], err, time.monotonic() - started


def test_a_worker_stopped_before_the_start_is_left_out_when_others_hold_its_experts(
    replicated_stores, start_worker, secret_file
):
    sharded, stores = replicated_stores
    workers = [start_worker([store], "--no-advertise") for store in stores]
    expected, _, usual = _tokens(sharded, workers, secret_file)
    os.kill(workers[1].proc.pid, signal.SIGSTOP)
    try:
        tokens, err, took = _tokens(sharded, workers, secret_file)
    finally:
        os.kill(workers[1].proc.pid, signal.SIGCONT)
    assert tokens == expected
    assert f"worker {workers[1].address}" in err and "going on without it" in err, err
    print(f"with every worker: {usual:.1f} s; with a stopped one: {took:.1f} s")
    # not held for the stopped worker's handshake deadline: the others hold its experts
    assert took < usual + CONNECT_TIMEOUT / 2


def test_a_stopped_worker_without_a_replica_fails_the_start_naming_it(
    tiny_checkpoint, tmp_path, start_worker, secret_file
):
    sharded = tmp_path / "sharded"
    shard(tiny_checkpoint("qwen3_moe"), sharded, workers=2, progress=False)
    workers = [start_worker([sharded / f"worker-{i}"], "--no-advertise") for i in range(2)]
    os.kill(workers[1].proc.pid, signal.SIGSTOP)
    try:
        proc = _generate(sharded, workers, secret_file, "--max-tokens", "4")
        _, err = proc.communicate(timeout=120)
    finally:
        os.kill(workers[1].proc.pid, signal.SIGCONT)
    assert proc.returncode == 2, err
    assert f"worker {workers[1].address}" in err, err
    assert "without it, no live worker holds these experts: layer" in err, err
    assert "Traceback" not in err


def test_a_worker_stopped_mid_run_costs_no_wait_for_its_heat_at_exit(
    replicated_stores, start_worker, secret_file
):
    sharded, stores = replicated_stores
    workers = [start_worker([store], "--no-advertise") for store in stores]
    proc = _generate(sharded, workers, secret_file, "--max-tokens", "60")
    try:
        assert proc.stdout.read(1)  # the first text: the run is decoding
        os.kill(workers[1].proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - stopped
    finally:
        os.kill(workers[1].proc.pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    print(f"from the stop to the exit: {took:.1f} s")
    assert proc.returncode == 0, err
    assert "tok/s" in err, err  # the summary: it finished
    assert f"no heat from {workers[1].address}" not in err
    # The watchdog's deadline (1.5 s and 20 round trips) and the rest of the tokens; waiting
    # for the stopped worker's heat took 10 s more.
    assert took < 8.0, (took, err)


def test_a_lone_worker_killed_mid_run_ends_it_in_one_line_that_gives_its_reason_once(
    tiny_checkpoint, tmp_path, start_worker, secret_file
):
    sharded = tmp_path / "sharded"
    shard(tiny_checkpoint("qwen3_moe"), sharded, progress=False)
    worker = start_worker([sharded / "experts"], "--no-advertise")
    proc = _generate(sharded, [worker], secret_file, "--max-tokens", "100000")
    try:
        assert proc.stdout.read(1)  # the first text: the run is decoding
        worker.proc.kill()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    errors = [line for line in err.splitlines() if line.startswith("shoal: error")]
    assert len(errors) == 1 and "Traceback" not in err, err
    # "worker A failed: it closed its expert lane; no live worker holds these experts: ...",
    # not "...; not serving: worker A failed: it closed its expert lane" after it
    assert errors[0].count(worker.address) == 1, errors[0]
    assert "no live worker holds these experts" in errors[0], errors[0]
