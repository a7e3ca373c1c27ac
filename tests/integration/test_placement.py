"""Placement with real worker processes: `shoal deploy` fills workers that start with nothing
but the manifest, and experts held by several workers have their tokens dealt over the
copies, with output equal to mlx-lm's in one process."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from coordinator.dataplane.link import WorkerLink
from coordinator.decoding.generate import open_remote_model
from coordinator.ops.heat_record import fetch_readings
from engine.auth import load_secret
from engine.manifest import MANIFEST_NAME, read_manifest
from engine.sharding import shard
from tests.integration.test_equivalence import greedy_tokens
from worker.store import scan_stores

REPO = Path(__file__).resolve().parents[2]
PROMPT = [5, 17, 42, 99, 7, 250, 33, 64, 128, 12]
NEW_TOKENS = 10


def shoal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def expected(source: Path) -> tuple[mx.array, list[int]]:
    model, _ = load_model(source)
    return model(mx.array([PROMPT])), greedy_tokens(model, PROMPT, NEW_TOKENS)


def check_output(sharded: Path, addresses: list[str], secret: bytes, source: Path) -> None:
    logits, tokens = expected(source)
    remote = open_remote_model(sharded, addresses, secret)
    try:
        difference = mx.abs(remote.model(mx.array([PROMPT])) - logits).max().item()
        assert difference <= 1e-5
        assert greedy_tokens(remote.model, PROMPT, NEW_TOKENS) == tokens
    finally:
        remote.close()


@pytest.mark.slow
def test_deploy_fills_empty_workers_and_the_cluster_then_generates_exactly(
    tiny_checkpoint, tmp_path, start_worker, secret_file
):
    source = tiny_checkpoint("mixtral", layout="hf")
    sharded = tmp_path / "out"
    manifest = shard(source, sharded, progress=False)
    stores = []
    for k in range(2):
        stores.append(tmp_path / f"store-{k}")
        stores[-1].mkdir()
        shutil.copy(sharded / MANIFEST_NAME, stores[-1] / MANIFEST_NAME)
    workers = [start_worker([s], "--no-advertise", "--node-id", f"d{k}")
               for k, s in enumerate(stores)]
    assert all("waiting for `shoal deploy`" in w.output() for w in workers)
    common = ["--model", str(sharded), "--workers", ",".join(w.address for w in workers),
              "--secret-file", str(secret_file)]

    dry = shoal("deploy", *common, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["execution"] is None and plan["imbalance_now"] is None
    assert {s["source"] for s in plan["steps"] if s["kind"] == "copy"} == {"(local files)"}
    assert not list(stores[0].rglob("*.safetensors"))

    run = shoal("deploy", *common)
    assert run.returncode == 0, run.stderr
    # off a terminal the progress bar stays quiet (no redraws in a log); the summary says it all
    assert "\r" not in run.stderr and "done:" in run.stdout and "B/s)" in run.stdout
    held = set()
    for store in stores:
        scan = scan_stores([store])
        assert not scan.problems
        held |= set(scan.held)
    assert held == {(e.layer, e.expert) for e in manifest.experts}

    check_output(sharded, [w.address for w in workers], load_secret(secret_file), source)
    again = shoal("deploy", *common)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout


@pytest.mark.slow
def test_experts_held_twice_share_their_tokens_and_the_output_does_not_change(
    tiny_checkpoint, tmp_path, start_worker, secret_file
):
    source = tiny_checkpoint("qwen3_moe")
    sharded = tmp_path / "out"
    shard(source, sharded, progress=False)
    stores = [sharded / "experts", tmp_path / "copy"]
    shutil.copytree(stores[0], stores[1])
    workers = [start_worker([s], "--no-advertise", "--node-id", f"r{k}")
               for k, s in enumerate(stores)]
    secret = load_secret(secret_file)
    check_output(sharded, [w.address for w in workers], secret, source)

    links = [WorkerLink(w.address, secret) for w in workers]
    try:
        counts = [r.counts for r in fetch_readings(links)]
    finally:
        for link in links:
            link.close()
    both = set(counts[0]) & set(counts[1])
    assert len(both) >= len(read_manifest(sharded).experts) // 2, counts
