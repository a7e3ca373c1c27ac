"""A new user's first commands, through the real `shoal` and `shoal-worker` with workers on
loopback: `shoal workers --workers` as the README writes it, and its exit status; the shard
folder given for a store; doctor and the worker agreeing on where it listens and what it
announces; `shoal generate` naming what it did find when it gives up waiting; and workers
logging the copies and drops a deploy or rebalance makes."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.interfaces import kind_of, local_interfaces
from engine.sharding import shard
from tests.ports import free_ports

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"


def shoal(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def sharded(tiny_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("first-steps") / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, workers=2, progress=False)
    return out


@pytest.mark.slow
def test_workers_takes_the_readmes_worker_list_and_fails_when_none_answers(
    sharded, start_worker, secret_file
):
    a = start_worker([sharded / "worker-0"], "--no-advertise", "--node-id", "a")
    b = start_worker([sharded / "worker-1"], "--no-advertise", "--node-id", "b")
    listed = shoal("workers", "--workers", f"{a.address},{b.address}", "--json",
                   "--secret-file", str(secret_file))
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["workers"]
    assert sorted((r["node_id"], r["state"]) for r in rows) == [("a", "healthy"),
                                                                ("b", "healthy")]

    gone = f"{LOOPBACK}:{free_ports(1)[0]}"
    partly = shoal("workers", "--workers", f"{a.address},{gone}", "--secret-file",
                   str(secret_file), "--wait", "3")
    assert partly.returncode == 1, partly.stderr
    assert "unreachable" in partly.stdout and "healthy" in partly.stdout

    none = shoal("workers", "--workers", gone, "--secret-file", str(secret_file), "--wait", "2")
    assert none.returncode == 1 and "healthy" not in none.stdout

    # Bonjour, a cluster nobody runs: nothing answers, and the status says so.
    empty = shoal("workers", "--cluster", f"nobody-{os.getpid()}", "--interface", LOOPBACK,
                  "--secret-file", str(secret_file), "--wait", "2")
    assert empty.returncode == 1 and "no workers of cluster" in empty.stderr

    both = shoal("workers", "--workers", a.address, "--cluster", "x",
                 "--secret-file", str(secret_file))
    assert both.returncode == 2 and "not both" in both.stderr


def test_the_shard_folder_given_for_a_store_is_refused_naming_the_store(sharded, secret_file):
    run = subprocess.run(
        [sys.executable, "-m", "worker.daemon", "--store", str(sharded), "--no-advertise",
         "--port", "0", "--secret-file", str(secret_file)],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert run.returncode == 2
    assert run.stderr.startswith("shoal-worker: error:")
    assert "the folder `shoal shard` wrote" in run.stderr
    assert str(sharded / "worker-0") in run.stderr and str(sharded / "worker-1") in run.stderr
    assert "serving" not in run.stdout


def worker_run(store: Path, secret_file: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "worker.daemon", "--store", str(store), "--no-advertise",
         "--secret-file", str(secret_file), *extra],
        capture_output=True, text=True, timeout=60, cwd=REPO)


def test_the_folder_above_the_shard_folder_is_refused_naming_the_stores_not_the_shard(
    sharded, secret_file
):
    run = worker_run(sharded.parent, secret_file, "--port", "0")
    assert run.returncode == 2 and run.stderr.startswith("shoal-worker: error:")
    assert "a folder above the stores" in run.stderr
    named = re.search(r"the stores in it are ([^.]+)\.", run.stderr).group(1).split(", ")
    assert named == [str(sharded / "worker-0"), str(sharded / "worker-1")]


def test_a_store_folder_given_for_the_model_names_the_model_folder(sharded, secret_file):
    run = shoal("generate", "--model", str(sharded / "worker-0"), "--secret-file",
                str(secret_file), "hello")
    assert run.returncode == 2, run.stderr
    assert "is a worker's store folder" in run.stderr
    assert f"--model {sharded}" in run.stderr and "Traceback" not in run.stderr
    above = shoal("generate", "--model", str(sharded.parent), "hello")
    assert above.returncode == 2 and f"did you mean --model {sharded}?" in above.stderr


def test_a_busy_port_is_named_without_grpcs_own_log_line(sharded, secret_file):
    import socket

    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        run = worker_run(sharded / "worker-0", secret_file, "--port",
                         str(taken.getsockname()[1]))
    assert run.returncode != 0
    assert run.stderr.startswith("shoal-worker: error: cannot listen on"), run.stderr
    assert "add_port" not in run.stderr and "lsof -i :" in run.stderr


def test_a_second_worker_on_a_served_store_is_refused_naming_both_pids(
    sharded, start_worker, secret_file
):
    first = start_worker([sharded / "worker-1"], "--no-advertise")
    second = worker_run(sharded / "worker-1", secret_file, "--port", "0")
    assert second.returncode != 0
    assert second.stderr.startswith("shoal-worker: error:"), second.stderr
    assert f"already served by shoal-worker PID {first.proc.pid}" in second.stderr
    assert re.search(r"this shoal-worker \(PID \d+\) stops", second.stderr)
    assert "serving" not in second.stdout
    # nor does a coordinator serve it as its --local-store, and it names the worker's PID
    local = shoal("generate", "--model", str(sharded), "--local-store",
                  str(sharded / "worker-1"), "--workers", first.address, "--secret-file",
                  str(secret_file), "hello")
    assert local.returncode == 2 and "Traceback" not in local.stderr
    assert f"already served by shoal-worker PID {first.proc.pid}" in local.stderr


def test_a_worker_on_a_store_a_serve_local_store_holds_is_refused_naming_its_pid(
    sharded, secret_file
):
    store = sharded / "worker-0"
    serve = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "serve", "--model", str(sharded),
         "--local-store", str(store), "--workers", f"{LOOPBACK}:1", "--port", "0",
         "--secret-file", str(secret_file)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pid_file, deadline = store / ".shoal-serving.pid", time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text().startswith(f"{serve.pid} ")):
            assert serve.poll() is None and time.monotonic() < deadline, "serve never held it"
            time.sleep(0.1)
        run = worker_run(store, secret_file, "--port", "0")
    finally:
        serve.terminate()
        serve.wait(timeout=30)
    assert run.returncode == 2 and run.stderr.startswith("shoal-worker: error:"), run.stderr
    assert f"already served by shoal --local-store PID {serve.pid}" in run.stderr


def run_worker_until_advertised(store: Path, secret_file: Path, log: Path,
                                *extra: str) -> tuple[str, list[str]]:
    """Start shoal-worker with only `extra` deciding where it listens; (host it serves on,
    addresses it announced)."""
    cluster = f"truth-{os.getpid()}"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.daemon", "--store", str(store), "--port", "0",
             "--cluster", cluster, "--secret-file", str(secret_file), *extra],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = log.read_text()
            served = re.search(r"serving .* on (\S+):\d+\n", text)
            announced = re.search(r"advertising \S+ in cluster \S+ on (.+)\n", text)
            if served and announced:
                hosts = [a.rsplit(":", 1)[0] for a in announced.group(1).split(", ")]
                return served.group(1), hosts
            assert proc.poll() is None, text
            time.sleep(0.1)
        raise AssertionError(f"the worker did not advertise within 60 s:\n{log.read_text()}")
    finally:
        proc.terminate()
        proc.wait(30)


def doctor_says(*extra: str) -> tuple[str, list[str]]:
    run = shoal("doctor", "--no-mdns", "--json", *extra)
    details = [c["detail"] for c in json.loads(run.stdout)["checks"] if c["area"] == "network"]
    line = next(d for d in details if "started here listens on" in d)
    found = re.search(r"listens on (\S+) and announces ([^;]+)", line)
    return found.group(1), found.group(2).split(", ")


@pytest.mark.slow
def test_doctor_and_the_worker_agree_on_where_it_listens_and_what_it_announces(
    sharded, secret_file, tmp_path
):
    assert doctor_says() == run_worker_until_advertised(
        sharded / "worker-0", secret_file, tmp_path / "default.log")
    loopback = next(i.name for i in local_interfaces() if kind_of(i) == "local")
    assert doctor_says("--interface", loopback) == run_worker_until_advertised(
        sharded / "worker-0", secret_file, tmp_path / "interface.log", "--interface", loopback)
    worker_help = subprocess.run([sys.executable, "-m", "worker.daemon", "--help"],
                                 capture_output=True, text=True, timeout=60, cwd=REPO).stdout
    assert "every physical interface\n" not in worker_help.replace("  ", " ")
    assert "else on loopback only" in " ".join(worker_help.split())


@pytest.mark.slow
def test_generate_names_the_workers_and_clusters_it_saw_when_it_gives_up(
    sharded, start_worker, secret_file
):
    cluster = f"seen-{os.getpid()}"
    a = start_worker([sharded / "worker-0"], "--cluster", cluster, "--node-id", "a")
    x = start_worker([sharded / "worker-1"], "--cluster", cluster + "-x", "--node-id", "x")
    run = shoal("generate", "hi", "--model", str(sharded), "--cluster", cluster,
                "--interface", LOOPBACK, "--wait", "4", "--secret-file", str(secret_file))
    assert run.returncode == 2, run.stdout + run.stderr
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith("shoal: error: waited 4 s for the workers of cluster")
    assert f"found a at {a.address} healthy, " in error
    # Other workers may share this loopback: those of cluster-x are named, in their group.
    assert "seen in other clusters: " in error
    assert f"'{cluster}-x': x at {x.address}" in error


@pytest.mark.slow
def test_workers_log_the_copies_a_deploy_sends_them(tiny_checkpoint, tmp_path, start_worker,
                                                     secret_file):
    out = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, progress=False)  # OUT/experts: the local copies
    stores = [tmp_path / "a", tmp_path / "b"]
    for store in stores:
        store.mkdir()
        shutil.copy(out / "manifest.json", store / "manifest.json")  # a Mac just added
    workers = [start_worker([store], "--no-advertise", "--node-id", store.name)
               for store in stores]
    run = shoal("deploy", "--model", str(out), "--workers",
                ",".join(w.address for w in workers), "--secret-file", str(secret_file))
    assert run.returncode == 0, run.stderr
    received = [re.findall(r"received expert (\d+/\d+) \(\d+ bytes, checksum verified\) into "
                           + re.escape(str(store)), w.output())
                for w, store in zip(workers, stores, strict=True)]
    on_disk = [sorted(store.glob("L*/E*.safetensors")) for store in stores]
    assert [len(r) for r in received] == [len(files) for files in on_disk]
    assert all(received)


@pytest.mark.slow
def test_a_worker_logs_the_drain_and_the_drop_of_a_copy(tiny_checkpoint, tmp_path,
                                                         start_worker, secret_file):
    from coordinator.dataplane.link import WorkerLink
    from coordinator.ops.migration_executor import Executor
    from coordinator.ops.rebalancer import observe
    from engine.auth import load_secret
    from engine.manifest import read_manifest
    from engine.migration import MigrationPlan, Step

    out = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, progress=False)
    stores = [tmp_path / "keep", tmp_path / "drop"]
    for store in stores:
        shutil.copytree(out / "experts", store)
    workers = [start_worker([store], "--no-advertise", "--node-id", store.name)
               for store in stores]
    links = [WorkerLink(w.address, load_secret(secret_file)) for w in workers]

    def rebalance(keys: list[tuple[int, int]]) -> str:
        """Drain and drop `keys` on the second worker; its log once the burst is said."""
        _, by_name = observe(links)
        plan = MigrationPlan(tuple(Step(kind, key, "drop") for key in keys
                                   for kind in ("drain", "delete")), {})
        Executor(read_manifest(out), by_name, {}, log=lambda m: None, quiet=0.2,
                 progress=False).run(plan, "rebalance")
        deadline = time.monotonic() + 10  # the burst is said 2 s after its last drop
        while "shoal-worker: dropped" not in (log := workers[1].output()):
            assert time.monotonic() < deadline, log
            time.sleep(0.2)
        return log

    try:
        log = rebalance([(1, 5)])
        assert "draining expert 1/5: no longer offered" in log
        assert f"dropped expert 1/5: deleted {stores[1] / 'L001' / 'E0005.safetensors'}" in log
        assert "expert 1/5" not in workers[0].output()
        assert "listening on loopback only (this machine)" in log and "this Mac" not in log
        # a rebalance that drops many: one line for them all, not one each
        workers[1].log.write_text("")
        log = rebalance([(1, 6), (2, 0), (2, 1)])
    finally:
        for link in links:
            link.close()
    assert log.count("shoal-worker: dropped") == 1
    assert "shoal-worker: dropped 3 experts (1/6, 2/0, 2/1): their files deleted" in log
    assert "draining 3 experts (1/6, 2/0, 2/1)" in log


def test_a_worker_whose_output_reader_went_away_keeps_serving_and_stops_cleanly(
    sharded, secret_file
):
    """`shoal-worker ... | head -3`: the worker outlives the pipe, and SIGTERM still ends it
    with status 0 and no traceback."""
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.daemon", "--store", str(sharded / "worker-0"),
         "--no-advertise", "--port", "0", "--secret-file", str(secret_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while b"serving" not in proc.stdout.readline():
            assert time.monotonic() < deadline and proc.poll() is None
        proc.stdout.close()  # as `head` does
        time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err


def test_a_worker_stopped_with_ctrl_c_says_it_stops_then_that_it_stopped(
    sharded, start_worker
):
    import signal

    worker = start_worker([sharded / "worker-0"], "--no-advertise", "--node-id", "calm",
                          "--drain-seconds", "1")
    worker.proc.send_signal(signal.SIGINT)
    assert worker.proc.wait(30) == 0
    log = worker.output()
    assert "shoal-worker calm: stopping: the calls in flight get up to 1 s to finish" in log
    assert log.rstrip().endswith("shoal-worker calm: stopped") and "Traceback" not in log
