"""Three hosts on one Ethernet segment, made of Linux network namespaces joined by a bridge:
two run shoal-worker, the third runs the coordinator, which is given no address at all. It
finds the workers with Bonjour (real multicast between the namespaces), checks them, reports
the path, and generates exactly the tokens mlx-lm generates in one process.

Needs root and iproute2 (`ip netns`), as in CI. Everything it creates is named after this
process's id and removed at the end, also when the test fails. Only addresses inside the
namespaces (10.251.0.0/24) are ever used; zeroconf in each namespace sees only its own
interfaces.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlx_lm.utils import load_model, load_tokenizer

from coordinator.decoding.generate import generate
from coordinator.ops.local_processes import LocalWorker
from engine.sharding import shard

REPO = Path(__file__).resolve().parents[2]
SUBNET = "10.251.0"
PORT = 50551
NEW_TOKENS = 8
START_TIMEOUT = 90.0
COMMAND_TIMEOUT = 180.0
_READY = re.compile(r"serving .* on (\S+:\d+)$", re.MULTILINE)


@dataclass(frozen=True)
class Host:
    netns: str
    address: str

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]


def ip(*args: str) -> None:
    run = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if run.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {run.stderr.strip()}")


def require_network_namespaces() -> None:
    """Fail (not skip) with the reason: CI runs as root, so a skip would hide a broken setup."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.fail("this test builds hosts from network namespaces: run it as root (CI does)")
    if shutil.which("ip") is None:
        pytest.fail("this test needs iproute2's `ip` command (apt-get install iproute2)")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.fail(f"`ip netns` does not work here: {probe.stderr.strip()}")


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    """Three namespaces with an eth0 each, cabled to a bridge in a fourth (the switch)."""
    require_network_namespaces()
    tag = f"shoal{os.getpid()}"
    switch = f"{tag}-switch"
    made: list[str] = []
    try:
        ip("netns", "add", switch)
        made.append(switch)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        found = []
        for index in (1, 2, 3):
            host = Host(f"{tag}-h{index}", f"{SUBNET}.{index + 1}")
            ip("netns", "add", host.netns)
            made.append(host.netns)
            ip("link", "add", "eth0", "netns", host.netns, "type", "veth",
               "peer", "name", f"port{index}", "netns", switch)
            ip("-n", switch, "link", "set", f"port{index}", "master", "br0")
            ip("-n", switch, "link", "set", f"port{index}", "up")
            ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            ip("-n", host.netns, "link", "set", "eth0", "up")
            ip("-n", host.netns, "link", "set", "lo", "up")
            found.append(host)
        yield found
    finally:
        for netns in reversed(made):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)


@pytest.fixture
def processes() -> Iterator[list[LocalWorker]]:
    """Processes started in the namespaces; stopped by PID before the namespaces go."""
    started: list[LocalWorker] = []
    yield started
    for worker in started:
        worker.stop()


def start_worker_on(host: Host, store: Path, secret: Path, cluster: str, config: Path,
                    log: Path, started: list[LocalWorker]) -> LocalWorker:
    cmd = [*host.prefix(), sys.executable, "-m", "worker.daemon", "--store", str(store),
           "--host", "0.0.0.0", "--port", str(PORT), "--secret-file", str(secret),
           "--cluster", cluster]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XDG_CONFIG_HOME": str(config)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                stdin=subprocess.DEVNULL)
    worker = LocalWorker(proc, "", log)
    started.append(worker)
    deadline = time.monotonic() + START_TIMEOUT
    while not _READY.search(worker.output()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"worker on {host.netns} did not start:\n{worker.output()}")
        time.sleep(0.05)
    worker.address = f"{host.address}:{PORT}"
    return worker


def shoal_on(host: Host, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*host.prefix(), sys.executable, "-m", "coordinator.cli", *args],
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT, cwd=REPO)


@pytest.mark.slow
def test_coordinator_discovers_workers_on_other_hosts_and_matches_mlx_lm(
    hosts, processes, tiny_checkpoint, secret_file, tmp_path
):
    source = tiny_checkpoint("qwen3_moe")
    sharded = tmp_path / "sharded"
    shard(source, sharded, workers=2, progress=False)
    cluster = f"netns-{os.getpid()}"
    first, second, coordinator = hosts
    for index, host in enumerate((first, second)):
        start_worker_on(host, sharded / f"worker-{index}", secret_file, cluster,
                        tmp_path / f"config-{index}", tmp_path / f"worker-{index}.log", processes)

    run = shoal_on(coordinator, "generate", "hello there", "--model", str(sharded),
                   "--cluster", cluster, "--secret-file", str(secret_file), "--json",
                   "--max-tokens", str(NEW_TOKENS), "--wait", "60")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    model, _ = load_model(source)
    expected = generate(model, load_tokenizer(source), report["prompt_token_ids"],
                        max_tokens=NEW_TOKENS)
    assert report["token_ids"] == expected.token_ids and len(expected.token_ids) == NEW_TOKENS
    for host in (first, second):
        assert f"at {host.address}:{PORT} via eth0 (wired)" in run.stderr, run.stderr

    listed = shoal_on(coordinator, "workers", "--cluster", cluster, "--json",
                      "--secret-file", str(secret_file))
    assert listed.returncode == 0, listed.stderr
    workers = sorted(json.loads(listed.stdout)["workers"], key=lambda w: w["address"])
    assert [(w["address"], w["interface"], w["path"], w["state"]) for w in workers] == [
        (f"{host.address}:{PORT}", "eth0", "wired", "healthy") for host in (first, second)
    ]
    for index, worker in enumerate(workers):  # each host made and kept its own node id
        stored = json.loads((tmp_path / f"config-{index}" / "shoal" / "node-id").read_text())
        assert worker["node_id"] == stored["node_id"]
        assert worker["experts"] > 0 and worker["rtt_ms"] is not None
    assert workers[0]["node_id"] != workers[1]["node_id"]
