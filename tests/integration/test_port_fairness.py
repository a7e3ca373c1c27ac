"""Fairness on a worker's ports under floods of sockets reopened as fast as they are closed:
between hosts made of network namespaces (as in test_multihost.py), another host's new
connections succeed and its lane's replies keep coming; from the coordinator's own address
(any local process can flood from it), fresh `shoal generate` runs and lanes still succeed."""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from coordinator.dataplane.link import WorkerLink
from coordinator.ops.local_processes import LocalWorker
from engine.auth import load_secret
from engine.errors import ShoalError
from engine.sharding import shard
from tests.integration import socket_flood
from tests.integration.test_lane import ready_lane
from tests.integration.test_multihost import (  # noqa: F401 (fixtures)
    _READY,
    PORT,
    REPO,
    START_TIMEOUT,
    Host,
    hosts,
    processes,
)
from worker.lane_server import THREADS_PER_HOST
from worker.lobby import BACKLOG

FILE_LIMIT = 4096  # the worker's: its connection cap follows (worker/daemon.py)
FLOOD_SECONDS = 90  # its own end, well beyond the handshakes even on a busy machine (it is
# ended as soon as they are done)
FLOOD_SOCKETS = 4000  # more than the worker's connection cap
FLOOD_RATE = 5000  # reconnects a second asked of the flooding host (it reports what it made)
HANDSHAKES = 40


def threads_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("Threads:")))


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("VmRSS:"))) / 1024


def listen_overflows(host: Host) -> int:
    """Connections `host`'s kernel dropped for a full accept queue (a dropped SYN is tried
    again only a second later)."""
    netstat = subprocess.run([*host.prefix(), "cat", "/proc/net/netstat"], capture_output=True,
                             text=True, timeout=30, check=True).stdout.splitlines()
    names, values = (line.split() for line in netstat if line.startswith("TcpExt:"))
    return int(values[names.index("ListenOverflows")])


def start_limited_worker(host: Host, store: Path, secret: Path, log: Path,
                         started: list[LocalWorker]) -> LocalWorker:
    """A worker on `host`'s PORT that may open FILE_LIMIT files (macOS's default is lower)."""
    cmd = [*host.prefix(), "prlimit", f"--nofile={FILE_LIMIT}:{FILE_LIMIT}", "--",
           sys.executable, "-m", "worker.daemon", "--store", str(store), "--host", "0.0.0.0",
           "--port", str(PORT), "--secret-file", str(secret), "--no-advertise"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XDG_CONFIG_HOME": str(log.parent)}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                stdin=subprocess.DEVNULL)
    worker = LocalWorker(proc, f"{host.address}:{PORT}", log)
    started.append(worker)
    deadline = time.monotonic() + START_TIMEOUT
    while not _READY.search(worker.output()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"worker on {host.netns} did not start:\n{worker.output()}")
        time.sleep(0.05)
    return worker


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["idle", "slowloris"])  # never a byte; bytes that reach gRPC
def test_one_hosts_flood_on_the_grpc_port_leaves_another_hosts_handshakes_succeeding(
    mode, hosts, processes, tiny_checkpoint, secret_file, tmp_path  # noqa: F811
):
    sharded = tmp_path / "sharded"
    shard(tiny_checkpoint("qwen3_moe"), sharded, progress=False)
    worker_host, flooder, client = hosts
    worker = start_limited_worker(worker_host, sharded / "experts", secret_file,
                                  tmp_path / "worker.log", processes)
    rss_before = rss_mb(worker.proc.pid)
    overflows = listen_overflows(worker_host)
    flood = subprocess.Popen(
        [*flooder.prefix(), sys.executable, "-m", "tests.integration.socket_flood",
         worker_host.address, str(PORT), "--sockets", str(FLOOD_SOCKETS), "--source",
         flooder.address, "--mode", mode, "--seconds", str(FLOOD_SECONDS), "--rate",
         str(FLOOD_RATE)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        first = flood.stdout.readline()
        assert first.startswith("holding"), first
        probe = subprocess.run(
            [*client.prefix(), sys.executable, "-m", "tests.integration.handshake_probe",
             worker.address, str(secret_file), "--count", str(HANDSHAKES)],
            capture_output=True, text=True, timeout=FLOOD_SECONDS + 60, cwd=REPO)
        assert probe.returncode == 0, probe.stderr
        flooding = flood.poll() is None  # the flood outlasted the handshakes
        rss_flooded = rss_mb(worker.proc.pid)
        overflows = listen_overflows(worker_host) - overflows
        flood.send_signal(signal.SIGINT)  # ends it, with its report
        out, _ = flood.communicate(timeout=30)
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait(10)
    handshakes, flood_report = json.loads(probe.stdout), json.loads(out.splitlines()[-1])
    print(json.dumps({"mode": mode, "handshakes": handshakes, "flood": flood_report,
                      "worker_rss_mb": [rss_before, rss_flooded],
                      "listen_overflows": overflows}))
    assert flooding
    assert flood_report["closed_by_server"] > FLOOD_SOCKETS  # closed, reopened, closed...
    assert handshakes["succeeded"] >= 0.9 * HANDSHAKES, handshakes
    # the flood's sockets wait in the accept queue (worker/lobby.py: BACKLOG), which has room
    # for all of them: no SYN of the other host is dropped, to be tried again a second later
    assert FLOOD_SOCKETS < BACKLOG and overflows == 0, overflows
    assert rss_flooded - rss_before < 64  # the flood costs the worker little memory


# fresh runs under each flood: the 15 under the idle one; one wave of 5 under the
# stalled ClientHellos, which take the same slots and the handshake threads besides
SAME_HOST_RUNS = {"idle": 15, "hello": 5}
WAVE = 5  # runs started together
SAME_HOST_SOCKETS = 2000  # per port: more than the worker holds of one host's silent ones
SAME_HOST_SECONDS = 420  # the floods' own end, beyond the runs (killed when they are done)
LANE_OPENS = 40
LANE_OPENERS = 8


def generate_waves(sharded: Path, worker: LocalWorker, secret_file: Path, count: int
                   ) -> list[subprocess.CompletedProcess]:
    """`count` fresh `shoal generate` runs, WAVE at a time side by side (fresh handshakes at
    once, and the floods, which take both cores, last a third as long)."""
    command = [sys.executable, "-m", "coordinator.cli", "generate", "--model", str(sharded),
               "--workers", worker.address, "--secret-file", str(secret_file),
               "--max-tokens", "4", "--json", "hello"]
    runs = []
    for _ in range(count // WAVE):
        wave = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, cwd=REPO) for _ in range(WAVE)]
        for run in wave:
            try:
                out, err = run.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                run.kill()
                out, err = run.communicate(timeout=10)
            runs.append(subprocess.CompletedProcess(command, run.returncode, out, err))
    return runs


def lane_opens(worker: LocalWorker, secret_file: Path, count: int) -> int:
    """Fresh expert lanes opened to `worker` (TLS, HELLO, READY within 5 s), of `count`,
    LANE_OPENERS at a time (a coordinator opens one per worker and channel at once)."""
    link = WorkerLink(worker.address, load_secret(secret_file))
    try:
        port, node = link.fetch_inventory().lane_port, link.node_id
    finally:
        link.close()
    secret = load_secret(secret_file)

    def opens(_: int) -> bool:
        try:
            ready_lane("127.0.0.1", port, secret, node).close()
            return True
        except (OSError, ShoalError, AssertionError):
            return False

    with ThreadPoolExecutor(LANE_OPENERS) as pool:
        return sum(pool.map(opens, range(count)))


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["idle", "hello"])  # never a byte; a ClientHello begun
def test_a_flood_from_the_coordinators_own_host_locks_it_out_of_neither_port(
    mode, start_worker, tiny_checkpoint, secret_file, tmp_path
):
    """Any local process can flood both of a worker's ports from the coordinator's own
    address (127.0.0.1 here), reconnecting each socket as fast as it can, idle or stalled in
    a TLS ClientHello: fresh `shoal generate` runs from that address all succeed, on their
    expert lanes, and fresh lanes open. Silent connections are held apart from those in a
    TLS handshake and closed first (worker/lobby.py), and a coordinator's connections, which
    show the cluster's pass first (engine/tls.py), are counted apart from the flood's."""
    sharded = tmp_path / "sharded"
    shard(tiny_checkpoint("qwen3_moe"), sharded, progress=False)
    worker = start_worker([sharded / "experts"], "--no-advertise")
    link = WorkerLink(worker.address, load_secret(secret_file))
    try:
        lane = f"127.0.0.1:{link.fetch_inventory().lane_port}"
    finally:
        link.close()
    floods = [socket_flood.start(address, sockets=SAME_HOST_SOCKETS, source="127.0.0.1",
                                 rate=0, seconds=SAME_HOST_SECONDS, mode=mode)
              for address in (worker.address, lane)]
    try:
        runs = generate_waves(sharded, worker, secret_file, SAME_HOST_RUNS[mode])
        opened = lane_opens(worker, secret_file, LANE_OPENS)
        flooding = [flood.poll() is None for flood in floods]
    finally:
        for flood in floods:
            flood.send_signal(signal.SIGINT)
    reports = []
    for flood in floods:
        try:
            out, _ = flood.communicate(timeout=30)
            reports.append(json.loads(out.strip().splitlines()[-1]) if out.strip() else {})
        except (subprocess.TimeoutExpired, json.JSONDecodeError):
            flood.kill()
            flood.wait(10)
            reports.append({})
    failed = [run.stderr[-500:] for run in runs if run.returncode != 0]
    fell_back = [run.stderr for run in runs if "using gRPC" in run.stderr]
    print(json.dumps({"mode": mode, "runs": len(runs), "failed": len(failed),
                      "lane_fallbacks": len(fell_back), "lane_opens": [opened, LANE_OPENS],
                      "floods": reports}))
    assert not failed, failed
    assert len({tuple(json.loads(run.stdout)["token_ids"]) for run in runs}) == 1
    assert not fell_back, fell_back[0]
    assert opened >= 0.95 * LANE_OPENS, opened
    assert all(flooding)  # the floods outlasted the runs
    for report in reports:  # closed, reopened, closed...: the flood went on throughout
        assert report.get("closed_by_server", 0) > SAME_HOST_SOCKETS, reports


LANE_FLOOD_SOCKETS = 64
STREAM_SECONDS = 12
LONGEST_PAUSE = 0.5


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["idle", "hello"])  # never a byte; a ClientHello begun
def test_one_hosts_lane_flood_never_pauses_another_hosts_stream(
    mode, hosts, processes, tiny_checkpoint, secret_file, tmp_path  # noqa: F811
):
    """64 sockets from one host reconnecting to a worker's lane as fast as they can, idle
    (held without a thread) or stalled in a TLS ClientHello (a thread each, a few per host):
    another host's layer calls on its lane are each answered within LONGEST_PAUSE, and the
    flooding host's connections add no more lane threads than its share."""
    sharded = tmp_path / "sharded"
    shard(tiny_checkpoint("qwen3_moe"), sharded, progress=False)
    worker_host, flooder, client = hosts
    worker = start_limited_worker(worker_host, sharded / "experts", secret_file,
                                  tmp_path / "worker.log", processes)
    before = threads_of(worker.proc.pid)
    flood = subprocess.Popen(
        [*flooder.prefix(), sys.executable, "-m", "tests.integration.socket_flood",
         worker_host.address, str(PORT + 1), "--sockets", str(LANE_FLOOD_SOCKETS), "--source",
         flooder.address, "--mode", mode, "--seconds", str(STREAM_SECONDS + 30), "--rate",
         "0"], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        first = flood.stdout.readline()
        assert first.startswith("holding"), first
        probe = subprocess.run(
            [*client.prefix(), sys.executable, "-m", "tests.integration.handshake_probe",
             worker.address, str(secret_file), "--stream", str(STREAM_SECONDS), "--model",
             str(sharded)], capture_output=True, text=True, timeout=STREAM_SECONDS + 60,
            cwd=REPO)
        flooding = flood.poll() is None
        threads = threads_of(worker.proc.pid)
    finally:
        flood.send_signal(signal.SIGINT)
        try:
            out, _ = flood.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            flood.kill()
            out, _ = flood.communicate(timeout=10)
    assert probe.returncode == 0, probe.stderr
    streamed, flood_report = json.loads(probe.stdout), json.loads(out.strip().splitlines()[-1])
    print(json.dumps({"mode": mode, "stream": streamed, "flood": flood_report,
                      "worker_threads": [before, threads]}))
    assert flooding and streamed["lane"]
    assert flood_report["closed_by_server"] > LANE_FLOOD_SOCKETS or mode == "idle"
    assert streamed["answered"] > 0 and streamed["seconds"] >= STREAM_SECONDS
    assert streamed["longest_gap"] < LONGEST_PAUSE, streamed
    # the flooding host's share of the lane threads at most, besides the client's lane (its
    # thread, and the one MLX starts on a thread's first compute) and a little to spare
    assert threads - before <= THREADS_PER_HOST + 4, (before, threads)
