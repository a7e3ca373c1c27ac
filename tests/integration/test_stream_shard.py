"""Placement for streaming through the real commands on a tiny model: `shoal shard --member`
writes a store per member whose hot set fits its budget, with the cold reads by drive speed
(40 and 80 MB/s); workers serve those stores within their budgets with mlx-lm's tokens; then
`shoal rebalance --member`, from the heat they counted, keeps that placement."""

import json
import subprocess
import sys
from pathlib import Path

from mlx_lm.utils import load_model, load_tokenizer

from coordinator.dataplane.cache_guess import CacheGuess
from coordinator.decoding.generate import generate, open_remote_model
from coordinator.ops.heat_record import load_record, record_path
from engine.auth import load_secret
from engine.manifest import read_manifest
from engine.stream_placement import cold_reads, member_hot_sets

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 42, 99, 7, 250, 33, 64], [100, 101, 102, 103, 104, 105]]
BUDGET = 96 << 10  # each member's memory for experts: a sixth of the tiny model's
SPEEDS = {"a": "40MB/s", "b": "80MB/s"}


def shoal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True,
                          text=True, timeout=180, cwd=REPO)


def holders(out: Path, stores: dict[str, Path]) -> tuple[dict, dict]:
    files = {(e.layer, e.expert): e for e in read_manifest(out).experts}
    sizes = {key: e.bytes for key, e in files.items()}
    return sizes, {key: tuple(n for n, store in stores.items() if (store / e.file).is_file())
                   for key, e in files.items()}


def check_streamed(sizes: dict, held: dict, heat: dict, top_k: int) -> float:
    """Every expert held; each member's hot set within its budget less the spare; the fast
    drive's share of the cold reads (returned)."""
    assert all(held.values())
    memory = dict.fromkeys(SPEEDS, int(BUDGET * 0.9))
    hot = member_hot_sets(held, memory, sizes, heat, top_k=top_k)
    assert all(sum(sizes[k] for k in hot[n]) <= memory[n] for n in SPEEDS)
    assert sum(sizes[k] for k in hot["a"] | hot["b"]) < sum(sizes.values()) / 2  # it streams
    reads = cold_reads(held, memory, sizes, heat, top_k=top_k)
    cold = {n: sum(layer[n] for layer in reads.values()) for n in SPEEDS}
    return cold["b"] / sum(cold.values())


def test_shard_and_rebalance_place_a_streamed_model_by_memory_and_drive_speed(
        tiny_checkpoint, tmp_path, start_worker, secret_file):
    source, out = tiny_checkpoint("qwen3_moe"), tmp_path / "out"
    members = [arg for n, speed in SPEEDS.items() for arg in ("--member", f"{n}={BUDGET}:{speed}")]
    run = shoal("shard", str(source), str(out), *members, "--quiet")
    assert run.returncode == 0, run.stderr
    assert f"a: shoal-worker --store {out / 'worker-0'} --memory-budget 96K" in run.stdout
    stores = {"a": out / "worker-0", "b": out / "worker-1"}
    sizes, held = holders(out, stores)
    top_k = read_manifest(out).config["num_experts_per_tok"]
    uniform = dict.fromkeys(sizes, 1.0)
    assert 0.58 <= check_streamed(sizes, held, uniform, top_k) <= 0.75  # ideally 2/3

    workers = {n: start_worker([store], "--memory-budget", "96K", "--no-advertise",
                               "--node-id", n) for n, store in stores.items()}
    addresses = [w.address for w in workers.values()]
    secret = load_secret(secret_file)
    model, _ = load_model(source)
    tokenizer = load_tokenizer(source)
    expected = [generate(model, tokenizer, p, max_tokens=12).token_ids for p in PROMPTS]

    def tokens() -> list[list[int]]:
        remote = open_remote_model(out, addresses, secret)
        try:
            return [generate(remote.model, remote.tokenizer, p, max_tokens=12).token_ids
                    for p in PROMPTS]
        finally:
            remote.close()

    assert tokens() == expected
    live = ["--model", str(out), "--workers", ",".join(addresses), "--secret-file",
            str(secret_file), *[a for n, s in SPEEDS.items() for a in ("--member", f"{n}=:{s}")]]
    run = shoal("rebalance", *live, "--json", "--quiet")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["imbalance_of"] == "reads" and report["imbalance_after"] < 1.3
    assert report["imbalance_after"] <= report["imbalance_now"]
    heat = {k: float(v) for k, v in
            load_record(record_path(out), read_manifest(out).fingerprint).total().items()}
    sizes, held = holders(out, stores)
    assert 0.58 <= check_streamed(sizes, held, heat, top_k) <= 0.8
    assert tokens() == expected
    # right after it, nothing more is worth moving
    again = json.loads(shoal("rebalance", *live, "--json", "--dry-run").stdout)
    assert again["steps"] == []


def test_two_drive_copies_of_each_cold_expert_give_mlx_lms_tokens(
        tiny_checkpoint, tmp_path, start_worker, secret_file):
    source, out = tiny_checkpoint("qwen3_moe"), tmp_path / "out"
    members = [arg for n, speed in SPEEDS.items() for arg in ("--member", f"{n}={BUDGET}:{speed}")]
    run = shoal("shard", str(source), str(out), *members, "--drive-copies", "2", "--quiet")
    assert run.returncode == 0, run.stderr
    stores = {"a": out / "worker-0", "b": out / "worker-1"}
    sizes, held = holders(out, stores)
    top_k = read_manifest(out).config["num_experts_per_tok"]
    memory = dict.fromkeys(SPEEDS, int(BUDGET * 0.9))
    hot = member_hot_sets(held, memory, sizes, dict.fromkeys(sizes, 1.0), top_k=top_k)
    assert all(sum(sizes[k] for k in hot[n]) <= memory[n] for n in SPEEDS)
    in_memory = hot["a"] | hot["b"]
    assert all(len(held[k]) == 2 for k in sizes if k not in in_memory)  # cold: on both drives
    workers = [start_worker([store], "--memory-budget", "96K", "--no-advertise")
               for store in stores.values()]
    model, _ = load_model(source)
    tokenizer = load_tokenizer(source)
    remote = open_remote_model(out, [w.address for w in workers], load_secret(secret_file))
    try:
        assert all(CacheGuess.streams(link) for link in remote.cluster.current.links)
        for prompt in PROMPTS:  # any copy computes the same bits
            assert generate(remote.model, remote.tokenizer, prompt, max_tokens=12).token_ids \
                == generate(model, tokenizer, prompt, max_tokens=12).token_ids
    finally:
        remote.close()
    bad = shoal("shard", str(source), str(tmp_path / "x"), *members, "--drive-copies", "0")
    assert bad.returncode != 0 and "drive copies must be 1 or more" in bad.stderr
    assert "Traceback" not in bad.stderr
