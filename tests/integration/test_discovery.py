"""Discovery and liveness with real worker processes, real zeroconf (on loopback) and real
gRPC: workers are found with no address given, a killed worker is dropped within seconds
and generation names the experts left without an owner, a restarted worker is taken back,
other clusters and models are ignored, duplicate node ids and wrong secrets are reported, a
cluster config stands in for Bonjour, and a lost worker's copies elsewhere take over."""

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from mlx_lm.utils import load_model, load_tokenizer

from coordinator.cluster.member import DEAD_AFTER
from coordinator.cluster.membership import CHECK_INTERVAL, Membership
from coordinator.decoding.generate import generate, open_remote_model
from coordinator.ops.local_processes import start_worker as launch_worker
from engine.auth import create_secret, load_secret
from engine.errors import Unavailable
from engine.placement import describe_ids
from engine.sharding import shard
from worker.store import scan_stores

REPO = Path(__file__).resolve().parents[2]
PROMPT = [5, 17, 42, 99, 7, 250, 33, 64]
NEW_TOKENS = 6
# Loopback multicast carries the Bonjour traffic; names are unique per test run.
LOOPBACK = "127.0.0.1"


def cluster_name(tag: str) -> str:
    return f"{tag}-{os.getpid()}"


def reference_tokens(source: Path, prompt: list[int]) -> list[int]:
    """mlx-lm in this process, the whole model, greedy."""
    model, _ = load_model(source)
    return generate(model, load_tokenizer(source), prompt, max_tokens=NEW_TOKENS).token_ids


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - started


def state_of(membership: Membership, node_id: str) -> str | None:
    states = [m.state for m in membership.snapshot() if m.node_id == node_id]
    return states[0] if len(states) == 1 else None


def only_held_by(store: Path) -> dict[int, list[int]]:
    by_layer: dict[int, list[int]] = {}
    for layer, expert in scan_stores([store], verify=False).held:
        by_layer.setdefault(layer, []).append(expert)
    return by_layer


def shoal(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


@pytest.fixture
def sharded(tiny_checkpoint, tmp_path) -> Path:
    out = tmp_path / "sharded"
    shard(tiny_checkpoint("qwen3_moe"), out, workers=2, progress=False)
    return out


def test_killed_worker_is_dropped_in_seconds_named_in_the_error_and_taken_back(
    tiny_checkpoint, sharded, start_worker, secret_file
):
    cluster = cluster_name("kill")
    start_worker([sharded / "worker-0"], "--cluster", cluster, "--node-id", "a")
    b = start_worker([sharded / "worker-1"], "--cluster", cluster, "--node-id", "b")
    expected = reference_tokens(tiny_checkpoint("qwen3_moe"), PROMPT)
    missing = [f"layer {layer}: {describe_ids(experts)}"
               for layer, experts in sorted(only_held_by(sharded / "worker-1").items())]
    secret = load_secret(secret_file)
    membership = Membership(secret, cluster=cluster, interface=LOOPBACK)
    membership.browse()
    remote = None
    try:
        remote = open_remote_model(sharded, [], secret, membership=membership, wait=30)

        def tokens() -> list[int]:
            return generate(remote.model, remote.tokenizer, PROMPT,
                            max_tokens=NEW_TOKENS).token_ids

        assert tokens() == expected
        assert {m.node_id: m.route.kind for m in membership.snapshot()} == {
            "a": "local", "b": "local"}

        b.proc.kill()  # no goodbye on Bonjour: only the health checks can tell
        took = wait_until(lambda: state_of(membership, "b") == "unreachable", 15, "b dropped")
        assert took <= DEAD_AFTER + 2 * CHECK_INTERVAL + 1.0
        with pytest.raises(Unavailable) as info:
            tokens()
        assert "no live worker holds these experts" in str(info.value)
        assert all(part in str(info.value) for part in missing), (str(info.value), missing)

        b = start_worker([sharded / "worker-1"], "--cluster", cluster, "--node-id", "b")
        wait_until(lambda: state_of(membership, "b") == "healthy", 30, "b taken back")
        assert tokens() == expected

        b.proc.kill()  # now in the middle of use: the failed call itself takes b out
        with pytest.raises(Unavailable) as info:
            tokens()
        assert "failed" in str(info.value) and all(part in str(info.value) for part in missing)
        assert state_of(membership, "b") == "unreachable"
    finally:
        if remote is not None:
            remote.close()
        membership.close()


def test_other_clusters_and_models_are_ignored_and_duplicates_and_secrets_reported(
    tiny_checkpoint, sharded, start_worker, secret_file, tmp_path
):
    cluster = cluster_name("mixed")
    other_model = tmp_path / "other-model"
    shard(tiny_checkpoint("mixtral"), other_model, workers=2, progress=False)
    first = start_worker([sharded / "worker-0"], "--cluster", cluster, "--node-id", "a")
    twin = start_worker([sharded / "worker-1"], "--cluster", cluster, "--node-id", "a")
    # the same experts again, each from a copy: a store is served by one worker at a time
    shutil.copytree(sharded / "worker-1", tmp_path / "x-store")
    shutil.copytree(sharded / "worker-0", tmp_path / "stranger-store")
    start_worker([tmp_path / "x-store"], "--cluster", cluster + "-x", "--node-id", "x")
    start_worker([other_model / "worker-0"], "--cluster", cluster, "--node-id", "m")
    other_secret = create_secret(tmp_path / "other-secret")
    stranger = launch_worker([tmp_path / "stranger-store"], other_secret, tmp_path / "s.log",
                             ["--cluster", cluster, "--node-id", "s"])
    try:
        run = shoal("workers", "--cluster", cluster, "--json", "--interface", LOOPBACK,
                    "--model", str(sharded), "--secret-file", str(secret_file), "--wait", "15")
    finally:
        stranger.stop()
    assert run.returncode == 0, run.stderr
    listed = json.loads(run.stdout)
    assert listed["cluster"] == cluster
    workers = sorted(listed["workers"], key=lambda w: (w["node_id"], w["address"]))
    assert [(w["node_id"], w["state"]) for w in workers] == [
        ("a", "healthy"), ("a", "healthy"), ("m", "incompatible"), ("s", "unauthenticated")]
    assert [w["duplicate_node_id"] for w in workers] == [True, True, False, False]
    assert "different model" in workers[2]["detail"]
    assert "cluster secret" in workers[3]["detail"]
    assert all(w["path"] == "local" and w["rtt_ms"] is not None for w in workers[:2])
    assert all(w["experts"] == 12 and w["memory_budget"] > 0 for w in workers[:2])
    # Both say so, whichever started first (no mDNS renaming is needed for it).
    for worker in (first, twin):
        wait_until(lambda w=worker: "already uses node id 'a'" in w.output(), 10, "warning")

    table = shoal("workers", "--cluster", cluster, "--interface", LOOPBACK,
                  "--secret-file", str(secret_file), "--wait", "3")
    assert table.returncode == 0 and "NODE ID" in table.stdout, table.stderr
    assert "duplicate id" in table.stdout and " x " not in table.stdout


def test_a_cluster_config_replaces_discovery(tiny_checkpoint, sharded, start_worker,
                                             secret_file, tmp_path):
    a = start_worker([sharded / "worker-0"], "--no-advertise", "--node-id", "a")
    b = start_worker([sharded / "worker-1"], "--no-advertise", "--node-id", "b")
    config = tmp_path / "desk.toml"
    config.write_text(
        'name = "desk"\n'
        f'[[workers]]\naddress = "{a.address}"\n'
        f'[[workers]]\naddress = "{b.address}"\n'
        '[[workers]]\naddress = "127.0.0.1:1"\nnode_id = "gone"\n'
    )
    listed = shoal("workers", "--cluster-config", str(config), "--json",
                   "--secret-file", str(secret_file), "--wait", "8")
    assert listed.returncode == 0, listed.stderr
    states = {w["node_id"]: w["state"] for w in json.loads(listed.stdout)["workers"]}
    assert states == {"a": "healthy", "b": "healthy", "gone": "unreachable"}

    run = shoal("generate", "hello there", "--model", str(sharded), "--cluster-config",
                str(config), "--secret-file", str(secret_file), "--json",
                "--max-tokens", str(NEW_TOKENS), "--wait", "20")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    source = tiny_checkpoint("qwen3_moe")
    assert report["token_ids"] == reference_tokens(source, report["prompt_token_ids"])
    assert f"worker a at {a.address} via lo (local)" in run.stderr

    # Each worker's counters, read after that generation: every expert it computed was resident.
    listed = shoal("workers", "--cluster-config", str(config), "--json", "--stats",
                   "--secret-file", str(secret_file), "--wait", "8")
    assert listed.returncode == 0, listed.stderr
    stats = {w["node_id"]: w.get("stats") for w in json.loads(listed.stdout)["workers"]}
    assert stats["gone"] is None
    for node in ("a", "b"):
        assert stats[node]["demands"] > 0 and stats[node]["hit_rate"] == 1.0, stats[node]
    table = shoal("workers", "--cluster-config", str(config), "--stats",
                  "--secret-file", str(secret_file), "--wait", "8")
    assert "hit rate 100.0%" in table.stdout, table.stdout


def test_a_lost_worker_is_routed_around_when_another_holds_its_experts(
    tiny_checkpoint, tmp_path, start_worker, secret_file
):
    source = tiny_checkpoint("qwen3_moe")
    full = tmp_path / "full"
    shard(source, full, progress=False)  # one store with every expert
    shutil.copytree(full / "experts", tmp_path / "copy")  # one store, one worker
    first = start_worker([full / "experts"], "--no-advertise", "--node-id", "first")
    second = start_worker([tmp_path / "copy"], "--no-advertise", "--node-id", "second")
    remote = open_remote_model(full, [first.address, second.address], load_secret(secret_file))
    try:
        expected = reference_tokens(source, PROMPT)
        second.proc.kill()
        tokens = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=NEW_TOKENS)
        assert tokens.token_ids == expected
        assert remote.cluster.holdings[1] == frozenset()  # taken out of the routing table
    finally:
        remote.close()
