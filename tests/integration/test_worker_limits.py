"""Real workers held to their limits: thousands of lanes and many generate runs leave their
thread count where it was, a worker at its thread limit refuses lanes clearly, serves on and
recovers when the limit lifts (and SIGTERM stops it), lane bodies cost memory only as their
bytes arrive, idle lanes are closed, and a stop answers the request being computed first."""

import json
import os
import select
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from coordinator.decoding.generate import open_remote_model
from engine.auth import load_secret
from engine.errors import Unavailable
from engine.manifest import read_manifest
from engine.sharding import shard
from proto import EXPERT_REPLY, REQUEST_LIMIT
from proto import lane as wire
from tests.integration.test_equivalence import PROMPT, greedy_tokens, make_stores
from tests.integration.test_lane import (
    REPLIES,
    answer_of,
    lane_of,
    open_lane,
    ready_lane,
    request_bytes,
)
from worker.lane_server import KEEP_IDLE

REPO = Path(__file__).resolve().parents[2]
BARE_LANES = 200  # per worker, each computing one request
GENERATE_RUNS = 10  # `shoal generate` processes, each opening its own lanes


@pytest.fixture(scope="module")
def sharded(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("limits") / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, progress=False, workers=2)
    return out


@pytest.fixture(scope="module")
def one_store(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("limits-one") / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, progress=False)  # every expert in out/experts
    return out


def threads_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("Threads:")))


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("VmRSS:"))) / 1024


def compute_on_a_new_lane(worker, link, manifest, secret, seq: int) -> None:
    host = worker.address.rpartition(":")[0]
    sock = ready_lane(host, link.inventory.lane_port, secret, link.node_id)
    try:
        wire.write_frame(sock, wire.MESSAGE, request_bytes(manifest, link.inventory, seq))
        kind, payload = wire.read_frame(sock, REPLIES)
        assert kind == wire.MESSAGE and EXPERT_REPLY.read(bytes(payload), "r")[0].seq == seq
    finally:
        sock.close()


def shoal_generate(sharded, workers, secret_file) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "generate", "--model", str(sharded),
         "--workers", ",".join(w.address for w in workers), "--secret-file", str(secret_file),
         "--max-tokens", "4", "--json", "hello"],
        capture_output=True, text=True, timeout=180, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["token_ids"]


@pytest.mark.long
@pytest.mark.slow
def test_lanes_and_generate_runs_leave_the_workers_thread_count_where_it_was(
    sharded, start_worker, secret_file
):
    workers = [start_worker([sharded / f"worker-{i}"], "--no-advertise") for i in (0, 1)]
    secret = load_secret(secret_file)
    manifest = read_manifest(sharded)
    links = [lane_of(worker, secret_file)[2] for worker in workers]
    try:
        first = shoal_generate(sharded, workers, secret_file)  # the lanes' threads start
        before = [threads_of(w.proc.pid) for w in workers]
        for seq in range(BARE_LANES):
            for worker, link in zip(workers, links, strict=True):
                compute_on_a_new_lane(worker, link, manifest, secret, seq)
        runs = [shoal_generate(sharded, workers, secret_file) for _ in range(GENERATE_RUNS)]
        time.sleep(0.5)  # the last lanes' threads go back to the pool
        after = [threads_of(w.proc.pid) for w in workers]
    finally:
        for link in links:
            link.close()
    print(json.dumps({"threads_before": before, "threads_after": after,
                      "bare_lanes_per_worker": BARE_LANES, "generate_runs": GENERATE_RUNS + 1}))
    assert runs == [first] * GENERATE_RUNS
    assert all(abs(a - b) <= 4 for a, b in zip(after, before, strict=True)), (before, after)


class ThreadLimit:
    """A pids cgroup (Linux's cgroup v1 or v2) holding one process: `hold()` lets it start no
    new thread, `lift()` takes the limit away. Root ignores RLIMIT_NPROC, a cgroup it cannot."""

    def __init__(self, pid: int) -> None:
        v1, v2 = Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")
        root = v1 if v1.is_dir() else v2
        if not (root / "cgroup.procs").exists() or (
                root == v2 and "pids" not in (v2 / "cgroup.controllers").read_text()):
            pytest.fail("this test holds a worker at a thread limit with a pids cgroup: it "
                        "needs root and Linux's cgroup pids controller (CI has both)")
        self.pid, self.root = pid, root
        self.group = root / f"shoal-test-{os.getpid()}-{pid}"
        self.group.mkdir()
        (self.group / "cgroup.procs").write_text(str(pid))

    def hold(self) -> None:
        (self.group / "pids.max").write_text(str(threads_of(self.pid)))

    def lift(self) -> None:
        (self.group / "pids.max").write_text("max")

    def remove(self) -> None:
        if Path(f"/proc/{self.pid}").exists():
            (self.root / "cgroup.procs").write_text(str(self.pid))
        self.group.rmdir()


def test_a_worker_at_its_thread_limit_refuses_lanes_serves_on_recovers_and_stops(
    sharded, start_worker, secret_file
):
    worker = start_worker([sharded / "worker-0"], "--no-advertise")
    secret = load_secret(secret_file)
    manifest = read_manifest(sharded)
    host, port, link = lane_of(worker, secret_file)
    limit = ThreadLimit(worker.proc.pid)
    try:
        limit.hold()
        for _ in range(3):  # no thread for it: closed, said in the log, the worker serves on
            with pytest.raises((ssl.SSLError, OSError)):
                wire.connect(host, port, wire.client_context(secret.identity), 10,
                             secret.identity).close()
        assert "no thread can be started" in worker.output()
        assert link.fetch_inventory(timeout=5).experts  # the gRPC port still answers
        assert link.check_health(timeout=5) < 5
        limit.lift()
        compute_on_a_new_lane(worker, link, manifest, secret, 7)
        limit.hold()  # and at the limit again, SIGTERM stops it
        worker.proc.send_signal(signal.SIGTERM)
        code = worker.proc.wait(20)
    finally:
        link.close()
        limit.lift()
        limit.remove()
    assert code == 0, worker.output()[-2000:]


def test_announced_lane_bodies_cost_memory_only_as_they_arrive_and_idle_lanes_are_closed(
    sharded, start_worker, secret_file
):
    """Four lanes announce a 256 MiB request and send 5 bytes of it: the worker's memory
    barely moves, and each is closed at the message deadline. Sixteen idle lanes, the most one
    host may hold, are closed at the idle timeout but for KEEP_IDLE of them, and the host is
    served again."""
    worker = start_worker([sharded / "worker-0"], "--no-advertise", "--lane-idle-seconds", "4",
                          "--lane-message-seconds", "3")
    secret = load_secret(secret_file)
    manifest = read_manifest(sharded)
    host, port, link = lane_of(worker, secret_file)
    pid = worker.proc.pid
    try:
        compute_on_a_new_lane(worker, link, manifest, secret, 1)
        before = rss_mb(pid)
        big = [ready_lane(host, port, secret, link.node_id) for _ in range(4)]
        for sock in big:
            sock.sendall(wire.HEADER.pack(REQUEST_LIMIT, wire.MESSAGE) + b"\x08\x01\x10\x00\x1a")
        time.sleep(1.0)
        grown = rss_mb(pid) - before
        started = time.monotonic()
        assert all(answer_of(sock) == b"" for sock in big)  # closed at the message deadline
        big_closed = time.monotonic() - started + 1.0
        idle = [ready_lane(host, port, secret, link.node_id) for _ in range(16)]
        opened = time.monotonic()
        refused = ready_or_error(host, port, secret, link.node_id)  # the host's cap is full
        # all but KEEP_IDLE are closed (which ones, of lanes opened within a moment of each
        # other and never used, is the order the worker's threads wake in)
        still_open, closed = set(idle), 0
        while closed < len(idle) - KEEP_IDLE and time.monotonic() - opened < 15:
            for sock in select.select(list(still_open), [], [], 0.2)[0]:
                sock.settimeout(2)
                assert answer_of(sock) == b""
                still_open.discard(sock)
                closed += 1
        idle_closed = time.monotonic() - opened
        assert closed == len(idle) - KEEP_IDLE, closed
        for sock in still_open:  # a coordinator's own lane stays open
            sock.settimeout(2)
            with pytest.raises(TimeoutError):
                sock.recv(1)
        compute_on_a_new_lane(worker, link, manifest, secret, 2)  # served again
    finally:
        link.close()
    print(json.dumps({"rss_growth_mb": round(grown, 1), "big_closed_after": big_closed,
                      "idle_closed_after": idle_closed}))
    assert grown < 64, grown
    assert 2.5 < big_closed < 8, big_closed
    assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert 3.5 < idle_closed < 10, idle_closed
    assert "idle for 4 s" in worker.output()


def ready_or_error(host: str, port: int, secret, node: str) -> object:
    """READY, or the status code of the ERROR frame a new lane gets."""
    sock = open_lane(host, port, secret, node=node)
    try:
        kind, payload = wire.read_frame(sock, REPLIES)
        return "READY" if kind == wire.READY else wire.read_error(payload)[0]
    finally:
        sock.close()


def test_a_stopped_worker_answers_the_request_arriving_and_closes_idle_lanes_at_once(
    sharded, start_worker, secret_file
):
    worker = start_worker([sharded / "worker-0"], "--no-advertise", "--drain-seconds", "5")
    secret = load_secret(secret_file)
    manifest = read_manifest(sharded)
    host, port, link = lane_of(worker, secret_file)
    try:
        idle = ready_lane(host, port, secret, link.node_id)
        busy = ready_lane(host, port, secret, link.node_id)
        request = request_bytes(manifest, link.inventory, seq=5)
        busy.sendall(wire.HEADER.pack(len(request), wire.MESSAGE) + request[:10])
        time.sleep(0.3)
        stopped = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        assert answer_of(idle) == b""  # nothing owed on it: closed at once
        idle_closed = time.monotonic() - stopped
        time.sleep(0.5)
        busy.sendall(request[10:])  # the rest of the layer call, after the stop
        kind, payload = wire.read_frame(busy, REPLIES)
        assert kind == wire.MESSAGE and EXPERT_REPLY.read(bytes(payload), "r")[0].seq == 5
        assert answer_of(busy) == b""  # and then the lane ends
        code = worker.proc.wait(15)
    finally:
        link.close()
    assert idle_closed < 2, idle_closed
    assert code == 0, worker.output()[-2000:]


def test_a_coordinator_whose_idle_lanes_were_closed_generates_again(
    sharded, start_worker, secret_file
):
    """The idle timeout spares a host's KEEP_IDLE lanes used last: a coordinator would see its
    idle lane closed only at its next request, and fail it."""
    workers = [start_worker([sharded / f"worker-{i}"], "--no-advertise", "--lane-idle-seconds",
                            "2") for i in (0, 1)]
    remote = open_remote_model(sharded, [w.address for w in workers], load_secret(secret_file))
    try:
        first = greedy_tokens(remote.model, PROMPT, 6)
        time.sleep(3.5)
        assert greedy_tokens(remote.model, PROMPT, 6) == first
        # Lanes used after the coordinator's own push its lanes out of the spared few: the
        # worker closes them while idle, and the coordinator opens them again at its next
        # request instead of taking the worker for lost.
        secret = load_secret(secret_file)
        manifest = read_manifest(sharded)
        host = workers[0].address.rpartition(":")[0]
        newer = []
        for link in remote.cluster.links:
            for seq in range(KEEP_IDLE):
                sock = ready_lane(host, link.inventory.lane_port, secret, link.node_id)
                wire.write_frame(sock, wire.MESSAGE, request_bytes(manifest, link.inventory,
                                                                   seq + 1))
                assert wire.read_frame(sock, REPLIES)[0] == wire.MESSAGE
                newer.append(sock)
        time.sleep(3.5)
        assert greedy_tokens(remote.model, PROMPT, 6) == first
        assert all(remote.cluster.holdings)  # no worker was taken for lost
        for sock in newer:
            sock.close()
    finally:
        remote.close()


@pytest.mark.slow
@pytest.mark.parametrize("replicated", [True, False])
def test_a_worker_at_its_thread_limit_is_passed_over_like_a_busy_one(
    replicated, one_store, start_worker, secret_file, tmp_path
):
    """Held at its thread limit before its first compute (MLX starts a thread on a thread's
    first one), a worker's lane refuses and its gRPC Compute answers "busy" (UNAVAILABLE),
    never a raw errno: a copy elsewhere takes its experts and the tokens are the same, or,
    with no copy, generate fails within 5 s, and `shoal generate` says so in one line."""
    sharded = one_store
    manifest = read_manifest(sharded)
    keys = sorted((e.layer, e.expert) for e in manifest.experts)
    shares = [keys, keys] if replicated else [keys[::2], keys[1::2]]
    stores = make_stores(sharded, tmp_path, shares)
    workers = [start_worker([store], "--no-advertise") for store in stores]
    secret = load_secret(secret_file)
    limit = ThreadLimit(workers[1].proc.pid)
    try:
        limit.hold()
        remote = open_remote_model(sharded, [w.address for w in workers], secret)
        try:
            started = time.monotonic()
            if replicated:
                tokens = greedy_tokens(remote.model, PROMPT, 6)
            else:
                with pytest.raises(Unavailable, match="busy") as failed:
                    greedy_tokens(remote.model, PROMPT, 6)
            took = time.monotonic() - started
        finally:
            remote.close()
        run = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "generate", "--model", str(sharded),
             "--workers", ",".join(w.address for w in workers), "--secret-file",
             str(secret_file), "--max-tokens", "4", "--json", "hello"],
            capture_output=True, text=True, timeout=180, cwd=REPO)
    finally:
        limit.lift()
        limit.remove()
    print(json.dumps({"replicated": replicated, "seconds": took, "stderr": run.stderr}))
    assert "Resource temporarily unavailable" not in run.stderr
    if replicated:
        alone = open_remote_model(sharded, [workers[0].address], secret)
        try:
            assert tokens == greedy_tokens(alone.model, PROMPT, 6)
        finally:
            alone.close()
        assert run.returncode == 0, run.stderr
    else:
        assert took < 5, took
        assert "thread limit" in str(failed.value)
        lines = run.stderr.strip().splitlines()
        assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
        assert len([line for line in lines if "busy" in line]) == 1, run.stderr
