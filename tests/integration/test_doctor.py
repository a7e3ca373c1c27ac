"""`shoal doctor` with real workers on loopback and real files: verdicts per finding, a
refused connection told apart, fingerprints compared, exit status 1 when something is wrong."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.ops.doctor import Check, check_secret, check_workers, failed, format_checks
from coordinator.ops.local_processes import start_worker as launch_worker
from engine.auth import create_secret
from engine.sharding import shard

REPO = Path(__file__).resolve().parents[2]


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", "doctor", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.fixture(scope="module")
def sharded(tiny_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("doctor") / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, workers=2, progress=False)
    return out


def by_area(report: dict, area: str) -> list[dict]:
    return [c for c in report["checks"] if c["area"] == area]


def test_doctor_checks_this_mac_and_each_worker(sharded, start_worker, secret_file, tmp_path):
    a = start_worker([sharded / "worker-0"], "--no-advertise", "--node-id", "a")
    b = start_worker([sharded / "worker-1"], "--no-advertise", "--node-id", "b")
    # a store of its own: one store is never served by two workers (engine/store_lock.py)
    shutil.copytree(sharded / "worker-1", tmp_path / "stranger")
    stranger = launch_worker([tmp_path / "stranger"], create_secret(tmp_path / "other"),
                             tmp_path / "s.log", ["--no-advertise", "--node-id", "s"])
    try:
        run = doctor("--workers", f"{a.address},{b.address},127.0.0.1:1,{stranger.address}",
                     "--model", str(sharded), "--store", str(sharded / "worker-0"),
                     "--store", str(tmp_path / "nowhere"), "--interface", "127.0.0.1",
                     "--secret-file", str(secret_file), "--json", "--wait", "8")
    finally:
        stranger.stop()
    assert run.returncode == 1, run.stderr  # something is wrong: exit 1
    report = json.loads(run.stdout)
    assert not report["ok"]
    assert [c["verdict"] for c in by_area(report, "secret")] == ["ok"]
    assert by_area(report, "mdns") == []  # workers given by address: no Bonjour query sent
    assert "127.0.0.1" in by_area(report, "network")[-1]["detail"]
    stores = by_area(report, "store")
    assert stores[0]["verdict"] == "ok" and "12 expert files" in stores[0]["detail"]
    assert stores[1]["verdict"] == "fail" and "nowhere does not exist" in stores[1]["detail"]
    workers = by_area(report, "worker")
    assert len(workers) == 4

    def about(address: str) -> dict:
        return next(c for c in workers if f"{address}:" in c["detail"])

    for worker, name in ((a, "a"), (b, "b")):
        check = about(worker.address)
        assert check["verdict"] == "ok", check
        assert check["detail"].startswith(f"{name} at {worker.address}: healthy via lo (local)")
        assert "round trip" in check["detail"] and "protocol 1" in check["detail"]
        assert "12 experts" in check["detail"]
    [dead] = [c for c in workers if c["detail"].startswith("127.0.0.1:1 ")]
    assert dead["verdict"] == "fail"  # in the words every surface uses (link_errors.dead_worker)
    assert dead["detail"] == ("127.0.0.1:1 is unreachable: connection refused at once: nothing "
                              "listens on that port")
    wrong = about(stranger.address)
    assert wrong["verdict"] == "fail" and "unauthenticated" in wrong["detail"]

    good = doctor("--workers", f"{a.address},{b.address}", "--interface", "127.0.0.1",
                  "--secret-file", str(secret_file), "--no-mdns")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "verdict: ready" in good.stdout and "FAIL" not in good.stdout


def test_a_secret_others_can_read_or_a_missing_one_fails(tmp_path):
    secret = create_secret(tmp_path / "secret")
    assert check_secret(secret).verdict == "ok"
    secret.chmod(0o644)
    check = check_secret(secret)
    assert check.verdict == "fail" and "chmod 600" in check.detail
    missing = check_secret(tmp_path / "none")
    assert missing.verdict == "fail" and "shoal cluster-init" in missing.detail


def row(node_id: str, fingerprint: str, **changes) -> dict:
    base = {"node_id": node_id, "address": f"10.0.0.{len(node_id)}:50551", "interface": "en0",
            "path": "wired", "state": "healthy", "detail": "", "experts": 4, "rtt_ms": 0.4,
            "duplicate_node_id": False, "protocol": 1, "fingerprint": fingerprint}
    return {**base, **changes}


def test_worker_verdicts_compare_models_protocols_and_paths():
    assert [c.verdict for c in check_workers([row("a", "f1"), row("bb", "f1")], None)] == [
        "ok", "ok"]
    mixed = check_workers([row("a", "f1"), row("bb", "f2")], None)
    assert all(c.verdict == "fail" and "different models" in c.detail for c in mixed)
    other = check_workers([row("a", "f1")], "f2")
    assert other[0].verdict == "fail" and "another model than --model" in other[0].detail
    old = check_workers([row("a", "f1", protocol=0)], None)
    assert old[0].verdict == "fail" and "upgrade Shoal" in old[0].detail
    wifi = check_workers([row("a", "f1", path="wireless")], None)
    assert wifi[0].verdict == "warn" and "Wi-Fi" in wifi[0].detail
    none = check_workers([], None)
    assert failed(none) and "no worker found" in none[0].detail
    text = format_checks([Check("mlx", "ok", "cpu"), Check("secret", "fail", "missing")])
    assert "FAIL  secret" in text and "verdict: 1 problem to fix" in text


def test_doctor_without_a_worker_option_checks_the_default_cluster(sharded, start_worker,
                                                                    secret_file):
    """What `shoal generate` would use with no --workers: the default cluster's workers,
    found with Bonjour (here announced on loopback)."""
    worker = start_worker([sharded / "worker-0"], "--node-id", "plain",
                          "--interface", "127.0.0.1")
    env = {**os.environ, "SHOAL_SECRET_FILE": str(secret_file)}
    run = subprocess.run([sys.executable, "-m", "coordinator.cli", "doctor", "--interface",
                          "127.0.0.1", "--json", "--wait", "6"], capture_output=True,
                         text=True, timeout=120, cwd=REPO, env=env)
    report = json.loads(run.stdout)
    assert by_area(report, "mdns")[0]["verdict"] == "ok"  # loopback multicast answers
    workers = by_area(report, "worker")
    ours = [c for c in workers if c["detail"].startswith(f"plain at {worker.address}")]
    assert ours and ours[0]["verdict"] == "ok", workers
