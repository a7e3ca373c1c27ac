"""Live rebalancing with real worker processes. Skewed traffic builds heat; `shoal rebalance`
moves and replicates experts while another process generates, whose tokens stay equal to
mlx-lm's; afterwards the load the workers measure is more even. A worker killed in the middle
of a migration loses no expert, and running the command again finishes the job."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlx_lm.utils import load_model, load_tokenizer

from coordinator.dataplane.link import WorkerLink
from coordinator.decoding.generate import generate, open_remote_model
from coordinator.ops.heat_record import fetch_readings
from coordinator.ops.migration_executor import Executor
from coordinator.ops.rebalancer import MIGRATION_FILE, migrate, observe
from engine.auth import load_secret
from engine.errors import CorruptData, ShoalError
from engine.heat import difference
from engine.manifest import MANIFEST_NAME, read_manifest
from engine.migration import MigrationPlan, Step
from engine.placement import load_imbalance
from engine.sharding import shard
from worker.store import scan_stores

REPO = Path(__file__).resolve().parents[2]
# Prompts whose routing is skewed: a few experts of each layer take most of the tokens.
PROMPTS = [[5, 17, 42, 99, 7, 250, 33, 64], [100, 101, 102, 103, 104, 105], [261, 267, 83, 268]]
NEW_TOKENS = 16
WORKERS = 3


def reference(source: Path) -> list[list[int]]:
    model, _ = load_model(source)
    tokenizer = load_tokenizer(source)
    return [generate(model, tokenizer, p, max_tokens=NEW_TOKENS).token_ids for p in PROMPTS]


def run_prompts(sharded: Path, addresses: list[str], secret: bytes) -> list[list[int]]:
    remote = open_remote_model(sharded, addresses, secret)
    try:
        return [generate(remote.model, remote.tokenizer, p, max_tokens=NEW_TOKENS).token_ids
                for p in PROMPTS]
    finally:
        remote.close()


def counts(links: list[WorkerLink]) -> dict[str, dict]:
    return {r.name: r.counts for r in fetch_readings(links)}


def served_by(links: list[WorkerLink]) -> dict[str, set]:
    """What each worker serves now, by its name."""
    return {w.name: set(w.serving) for w in observe(links)[0]}


def measured_imbalance(sharded, addresses, secret, links) -> tuple[float, list[list[int]]]:
    """Generate the prompts once; the imbalance of what each worker computed meanwhile."""
    before = counts(links)
    tokens = run_prompts(sharded, addresses, secret)
    after = counts(links)
    return load_imbalance({w: difference(after[w], before.get(w, {})) for w in after}), tokens


@pytest.fixture
def cluster(tiny_checkpoint, tmp_path, start_worker, secret_file):
    """OUT_DIR without expert files (so copies are relayed between workers), three workers
    on their own stores, and the reference tokens."""
    source = tiny_checkpoint("qwen3_moe")
    sharded = tmp_path / "out"
    shard(source, sharded, workers=WORKERS, progress=False)
    stores = []
    for k in range(WORKERS):
        stores.append(tmp_path / "stores" / f"w{k}")
        shutil.move(sharded / f"worker-{k}", stores[-1])
    workers = [start_worker([store], "--no-advertise", "--node-id", f"w{k}")
               for k, store in enumerate(stores)]
    secret = load_secret(secret_file)
    links = [WorkerLink(w.address, secret) for w in workers]
    yield {"source": source, "sharded": sharded, "stores": stores, "workers": workers,
           "secret": secret, "links": links, "expected": reference(source)}
    for link in links:
        link.close()


def generator_loop(sharded: str, config: str, secret_file: str, results: str, stop: str) -> None:
    """Run in another process: generate the prompts in turn through a cluster config
    (membership) until `stop` exists, one JSON line per generation."""
    from coordinator.cluster.discovery import read_cluster_config
    from coordinator.cluster.membership import Membership

    secret = load_secret(Path(secret_file))
    manifest = read_manifest(Path(sharded))
    membership = Membership(secret, cluster="test", manifest=manifest)
    membership.add_static(read_cluster_config(Path(config)).workers)
    remote = open_remote_model(Path(sharded), [], secret, membership=membership, wait=60)
    with open(results, "a") as out:
        turn = 0
        while not Path(stop).exists():
            started = time.time()
            prompt = turn % len(PROMPTS)
            tokens = generate(remote.model, remote.tokenizer, PROMPTS[prompt],
                              max_tokens=NEW_TOKENS).token_ids
            out.write(json.dumps({"start": started, "end": time.time(), "prompt": prompt,
                                  "tokens": tokens, "reloads": remote.cluster.reloads,
                                  "routing": remote.cluster.version}) + "\n")
            out.flush()
            turn += 1
    remote.close()
    membership.close()


def wait_for_lines(path: Path, count: int, timeout: float, proc: subprocess.Popen) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return [json.loads(line) for line in lines]
        assert proc.poll() is None, f"the generating process died: {proc.stderr.read()}"
        time.sleep(0.1)
    raise AssertionError(f"fewer than {count} generations within {timeout} s")


@pytest.mark.slow
def test_rebalance_while_another_process_generates(cluster, tmp_path, secret_file):
    sharded, links, secret = cluster["sharded"], cluster["links"], cluster["secret"]
    addresses = [w.address for w in cluster["workers"]]
    before, tokens = measured_imbalance(sharded, addresses, secret, links)
    assert tokens == cluster["expected"]

    config = tmp_path / "cluster.toml"
    config.write_text('name = "test"\n' + "".join(
        f'[[workers]]\naddress = "{a}"\n' for a in addresses))
    results, stop = tmp_path / "generations.jsonl", tmp_path / "stop"
    code = (f"from tests.integration.test_rebalance import generator_loop; generator_loop("
            f"{str(sharded)!r}, {str(config)!r}, {str(secret_file)!r}, {str(results)!r}, "
            f"{str(stop)!r})")
    generating = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, text=True,
                                  stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        (first, *_) = wait_for_lines(results, 1, 120, generating)
        started = time.time()
        run = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "rebalance", "--model", str(sharded),
             "--workers", ",".join(addresses), "--secret-file", str(secret_file), "--json"],
            capture_output=True, text=True, timeout=300, cwd=REPO)
        finished = time.time()
        assert run.returncode == 0, run.stderr
        report = json.loads(run.stdout)
        count = len(wait_for_lines(results, 1, 60, generating))
        lines = wait_for_lines(results, count + 3, 120, generating)  # three wholly after it
    finally:
        stop.touch()
        generating.wait(60)

    kinds = {s["kind"] for s in report["steps"]}
    assert {"copy", "verify"} <= kinds and report["imbalance_after"] < report["imbalance_now"], \
        json.dumps({k: v for k, v in report.items() if k not in ("steps", "target")})
    assert all(line["tokens"] == cluster["expected"][line["prompt"]] for line in lines)
    overlapping = [line for line in lines if line["start"] < finished and line["end"] > started]
    assert overlapping, "no generation ran while the experts moved"
    # it noticed the new placement: from a reply or a refusal (Cluster.reload), or from its
    # membership's periodic inventory refresh, whichever came first; both rebuild its routes
    assert lines[-1]["routing"] > first["routing"], \
        "the generating process never noticed a new inventory"

    # the cluster now holds the planned placement, and the measured load is more even
    served = served_by(links)
    target = {tuple(map(int, k.split("/"))): set(v) for k, v in report["target"].items()}
    assert all({w for w, held in served.items() if key in held} == names
               for key, names in target.items())
    assert not (sharded / MIGRATION_FILE).exists()
    after, tokens = measured_imbalance(sharded, addresses, secret, links)
    assert tokens == cluster["expected"]
    assert after < before, (before, after)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["copy", "drain"])
def test_a_worker_killed_mid_migration_loses_nothing_and_a_rerun_finishes(
    cluster, kill_at, start_worker, monkeypatch
):
    # About a migration cut short, not whether this short run's gain pays for its bytes.
    monkeypatch.setattr("engine.rebalance_plan.GAIN_PER_MOVED", 0.0)
    sharded, links, secret = cluster["sharded"], cluster["links"], cluster["secret"]
    workers, stores = cluster["workers"], cluster["stores"]
    addresses = [w.address for w in workers]
    run_prompts(sharded, addresses, secret)  # heat
    killed: list[str] = []

    def kill(event, step, sent):
        # mid-transfer of the second copy, or right after the first copy was drained
        copies = [e for e in events if e[0] == "step" and e[1].kind == "copy"]
        hit = (kill_at == "copy" and event == "chunk" and len(copies) == 2 and sent >= 16384
               or kill_at == "drain" and event == "done" and step.kind == "drain")
        events.append((event, step, sent))
        if hit and not killed:  # (on gRPC's thread that reads the chunks being pushed)
            killed.append(step.worker)
            victim = int(step.worker.removeprefix("w"))
            time.sleep(0.3)  # let the receiver write what it was sent
            workers[victim].proc.kill()
            workers[victim].proc.wait(10)

    events: list = []
    with pytest.raises(ShoalError, match="run the command again") as failure:
        migrate(sharded, links, deploy=False, progress=False, chunk_bytes=4096, quiet=0.3,
                on_event=kill)
    assert killed, failure.value
    workers[int(killed[0][1:])].proc.wait(10)
    assert (sharded / MIGRATION_FILE).exists()

    # no expert lost: every one has a verified file on some worker's drive
    manifest = read_manifest(sharded)
    on_disk = set()
    for store in stores:
        on_disk |= set(scan_stores([store]).held)
    assert on_disk == {(e.layer, e.expert) for e in manifest.experts}
    if kill_at == "copy":  # the receiver kept what had arrived, to resume from
        partial = list(stores[int(killed[0][1:])].rglob("*.incoming"))
        assert partial and partial[0].stat().st_size >= 4096

    # the worker comes back (on another port); running it again finishes the same target
    victim = int(killed[0][1:])
    workers[victim] = start_worker([stores[victim]], "--no-advertise", "--node-id", killed[0])
    links[victim] = WorkerLink(workers[victim].address, secret)
    target = json.loads((sharded / MIGRATION_FILE).read_text())["target"]
    events.clear()
    report = migrate(sharded, links, deploy=False, progress=False, quiet=0.3,
                     on_event=lambda *e: events.append(e))
    assert report.proposal.resumed and report.execution is not None
    if kill_at == "copy":
        assert any(e[0] == "resume" and e[2] >= 4096 for e in events)
    served = served_by(links)
    for layer, expert, names in target:
        assert {w for w, held in served.items() if (layer, expert) in held} == set(names)
    assert not (sharded / MIGRATION_FILE).exists()
    assert not [path for store in stores for path in store.rglob("*.incoming")]
    assert run_prompts(sharded, [w.address for w in workers], secret) == cluster["expected"]
    assert all((s / MANIFEST_NAME).exists() for s in stores)


@pytest.mark.slow
def test_a_copy_that_rotted_is_caught_before_the_other_copy_is_deleted(
    tiny_checkpoint, tmp_path, start_worker, secret_file
):
    """Two workers hold the same expert; the copy to be kept rots on disk after its worker
    started. Deleting the other copy must not happen: the rot is found right before the
    deletion, reported, the rotted copy is no longer served, the copy that was about to be
    deleted is still on its drive and served again, and the run fails saying so."""
    sharded = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), sharded, progress=False)
    stores = [tmp_path / "keep", tmp_path / "drop"]
    for store in stores:
        shutil.copytree(sharded / "experts", store)
    shutil.rmtree(sharded / "experts")  # no local copy to fall back on
    workers = [start_worker([store], "--no-advertise", "--node-id", store.name)
               for store in stores]
    secret = load_secret(secret_file)
    links = [WorkerLink(w.address, secret) for w in workers]
    try:
        manifest = read_manifest(sharded)
        key = (1, 5)
        name = manifest.expert(*key).file
        rotted = stores[0] / name
        data = bytearray(rotted.read_bytes())
        data[-100] ^= 0x01
        rotted.write_bytes(bytes(data))
        _, by_name = observe(links)
        plan = MigrationPlan((Step("drain", key, "drop"), Step("delete", key, "drop")), {})
        executor = Executor(manifest, by_name, {}, log=lambda m: None, quiet=0.2, progress=False)
        with pytest.raises(CorruptData, match="rotted on disk") as failure:
            executor.run(plan, "rebalance")
        assert "keep" in str(failure.value) and "not deleted" in str(failure.value)
        assert executor.done.rot and "checksum" in executor.done.rot[0]
        assert (stores[1] / name).exists()  # the intact copy is still there
        served = served_by(links)
        assert key in served["drop"] and key not in served["keep"]
        problems = links[0].fetch_stats().problems
        assert any(str(rotted) in p and "checksum" in p for p in problems), problems
    finally:
        for link in links:
            link.close()


@pytest.mark.slow
def test_a_source_whose_copy_rotted_is_told_and_stops_serving_it(
    tiny_checkpoint, tmp_path, start_worker, secret_file
):
    """A copy relayed from a worker whose file rotted fails the receiver's check; the sender
    is then asked to hash its own file, reports the rot and stops serving that copy."""
    sharded = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), sharded, progress=False)
    source, target = tmp_path / "source", tmp_path / "target"
    shutil.copytree(sharded / "experts", source)
    target.mkdir()
    shutil.copy(sharded / "experts" / MANIFEST_NAME, target / MANIFEST_NAME)
    shutil.rmtree(sharded / "experts")
    workers = [start_worker([store], "--no-advertise", "--node-id", store.name)
               for store in (source, target)]
    links = [WorkerLink(w.address, load_secret(secret_file)) for w in workers]
    try:
        manifest = read_manifest(sharded)
        key = (0, 3)
        rotted = source / manifest.expert(*key).file
        data = bytearray(rotted.read_bytes())
        data[-50] ^= 0x04
        rotted.write_bytes(bytes(data))
        step = Step("copy", key, "target", "source", manifest.expert(*key).bytes)
        executor = Executor(manifest, observe(links)[1], {}, log=lambda m: None, progress=False)
        with pytest.raises(ShoalError, match="could be sent"):
            executor.run(MigrationPlan((step,), {}), "rebalance")
        assert executor.done.rot and "source" in executor.done.rot[0]
        served = served_by(links)
        assert key not in served["source"] and key not in served["target"]
        assert not list(target.rglob("*.incoming"))  # the bad bytes were discarded
    finally:
        for link in links:
            link.close()


@pytest.mark.slow
def test_rebalance_moves_experts_onto_a_worker_that_joined_empty(
    tiny_checkpoint, tmp_path, start_worker, secret_file
):
    """Two workers hold the model; a third joins holding nothing but the manifest (a Mac just
    added). After some traffic, `shoal rebalance` gives it a share, the measured load is more
    even over the three, and generation through all three still equals mlx-lm's."""
    source = tiny_checkpoint("qwen3_moe")
    sharded = tmp_path / "out"
    shard(source, sharded, workers=2, progress=False)
    stores = []
    for k in range(2):
        stores.append(tmp_path / "stores" / f"w{k}")
        shutil.move(sharded / f"worker-{k}", stores[-1])
    stores.append(tmp_path / "stores" / "new")
    stores[-1].mkdir()
    shutil.copy(sharded / MANIFEST_NAME, stores[-1] / MANIFEST_NAME)
    names = ["w0", "w1", "new"]
    workers = [start_worker([store], "--no-advertise", "--node-id", name)
               for store, name in zip(stores, names, strict=True)]
    secret = load_secret(secret_file)
    links = [WorkerLink(w.address, secret) for w in workers]
    addresses = [w.address for w in workers]
    try:
        expected = reference(source)
        # heat from the two that hold the model; the newcomer is idle meanwhile
        before, tokens = measured_imbalance(sharded, addresses[:2], secret, links)
        assert tokens == expected
        assert served_by(links)["new"] == set()

        run = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "rebalance", "--model", str(sharded),
             "--workers", ",".join(addresses), "--secret-file", str(secret_file), "--json"],
            capture_output=True, text=True, timeout=120, cwd=REPO)
        assert run.returncode == 0, run.stderr
        report = json.loads(run.stdout)
        assert report["imbalance_now"] >= 1.4  # two of three workers carry everything
        assert report["imbalance_after"] < report["imbalance_now"]
        assert any(s["kind"] == "copy" and s["worker"] == "new" for s in report["steps"])

        served = served_by(links)
        target = {tuple(map(int, k.split("/"))): set(v) for k, v in report["target"].items()}
        assert served["new"] == {key for key, names in target.items() if "new" in names}
        assert served["new"]
        after, tokens = measured_imbalance(sharded, addresses, secret, links)
        assert tokens == expected
        assert after < before, (before, after)
    finally:
        for link in links:
            link.close()
