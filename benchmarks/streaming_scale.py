"""`python -m benchmarks.streaming --scale 1,2,4`: one model split over 1, 2 and 4 members (the
coordinator's own store plus `shoal-worker`s), each one Mac with one SSD: the same memory
budget, its own read-bandwidth limit, the page cache dropped; beside mlx-lm and a prediction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.stream_limits import MemberLimits, block_device, drop_page_cache
from engine.cache_policy import format_bytes
from engine.manifest import read_manifest
from engine.stream_speed import StreamingMember, predict_streaming, skewed_heat

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Explain how rainbows form."
# Room beyond its expert budget that a member process needs (Python, MLX, gRPC, the dense
# model on the coordinator): the cgroup limit catches a member that grows past its budget.
WORKER_SLACK = 768 << 20
COORDINATOR_SLACK = 1536 << 20


def holders_of(sharded: Path, members: int) -> dict[tuple[int, int], tuple[str, ...]]:
    """Which member's store folder holds each expert file (member 0: the coordinator's)."""
    holders: dict[tuple[int, int], tuple[str, ...]] = {}
    for i in range(members):
        for path in (sharded / f"worker-{i}").glob("L*/E*.safetensors"):
            key = (int(path.parent.name[1:]), int(path.stem[1:]))
            holders[key] = (*holders.get(key, ()), f"member-{i}")
    return holders


def member_once(sharded: str, addresses: list[str], secret_file: str, budget: int,
                ids: list[int], tokens: int, lookahead: bool = True) -> None:
    """The coordinator, in a process (and cgroup) of its own: member 0's store here, the rest
    on the workers at `addresses`; prints one JSON line of decode-only figures."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from coordinator.decoding.generate import open_remote_model
    from coordinator.decoding.report import streaming_report
    from coordinator.ops.heat_record import fetch_readings
    from coordinator.ops.worker_stats import read_stats
    from engine.auth import load_secret

    remote = open_remote_model(Path(sharded), addresses, load_secret(Path(secret_file)),
                               local_stores=[Path(sharded) / "worker-0"],
                               memory_budget=str(budget))
    if not lookahead:
        remote.dispatcher.lookahead = None
    try:
        out = []
        for response in stream_generate(remote.model, remote.tokenizer, mx.array(ids),
                                        max_tokens=tokens, sampler=make_sampler(temp=0.0)):
            out.append(int(response.token))
            if len(out) == 1:
                before = read_stats(remote.cluster.links)
                counted = fetch_readings(remote.cluster.links)
                started = time.perf_counter()
        decode_seconds = time.perf_counter() - started
        after = read_stats(remote.cluster.links)
        heat: dict[tuple[int, int], int] = {}
        for reading in fetch_readings(remote.cluster.links):
            seen = next((r.counts for r in counted if r.name == reading.name), {})
            for key, count in reading.counts.items():
                heat[key] = heat.get(key, 0) + count - seen.get(key, 0)
    finally:
        remote.close()
    members = streaming_report(before, after, 0, None)["workers"]
    print(json.dumps({
        "tokens": out, "decode_seconds": decode_seconds,
        "heat": [[layer, expert, n] for (layer, expert), n in sorted(heat.items()) if n > 0],
        "members": {address: {"demands": s["demands"], "hit_rate": s["hit_rate"],
                              "bytes_read": s["bytes_read"],
                              "drive_seconds": sum(d["active_seconds"] for d in s["drives"])}
                    for address, s in members.items()},
    }))


def run_point(sharded: Path, members: int, budget: int, read_bps: int | None, ids: list[int],
              tokens: int, secret_file: Path, log_dir: Path, device: str | None,
              lookahead: bool = True) -> dict:
    """One member count: page cache dropped, each member in its own cgroup, decode timed."""
    from coordinator.ops.local_processes import start_worker

    how = drop_page_cache(sorted(sharded.glob("worker-*/L*/E*.safetensors")))
    limits, workers = [], []
    try:
        for i in range(1, members):
            limit = MemberLimits(f"shoal-scale-{i}", budget + WORKER_SLACK, read_bps, device)
            limits.append(limit)
            workers.append(start_worker([sharded / f"worker-{i}"], secret_file,
                                        log_dir / f"worker-{members}-{i}.log",
                                        ["--memory-budget", str(budget)], prefix=limit.wrap([])))
        coordinator = MemberLimits("shoal-scale-0", budget + COORDINATOR_SLACK, read_bps, device)
        limits.insert(0, coordinator)
        code = ("from benchmarks.streaming_scale import member_once; member_once("
                f"{str(sharded)!r}, {[w.address for w in workers]!r}, {str(secret_file)!r}, "
                f"{budget}, {ids!r}, {tokens}, {lookahead})")
        proc = subprocess.run(coordinator.wrap([sys.executable, "-c", code]), capture_output=True,
                              text=True, timeout=3600, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(f"{members} members: the coordinator failed: "
                             f"{proc.stderr.strip()[-600:]}")
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        drive_bytes = [limit.bytes_read() for limit in limits]
    finally:
        for worker in workers:
            worker.stop()
        for limit in limits:
            limit.close()
    decode = run["decode_seconds"]
    stats = list(run["members"].values())
    demands = sum(s["demands"] for s in stats)
    hits = sum((s["hit_rate"] or 0) * s["demands"] for s in stats)
    return {
        "members": members,
        "tokens": run["tokens"],
        "heat": {(layer, expert): float(n) for layer, expert, n in run["heat"]},
        "tok_s": (len(run["tokens"]) - 1) / decode,
        "hit_rate": hits / demands if demands else None,
        "read_bytes_per_token": sum(s["bytes_read"] for s in stats) / (len(run["tokens"]) - 1),
        "drive_busy": [s["drive_seconds"] / decode for s in stats],
        "cgroup_bytes_read": drive_bytes,
        "page_cache": how,
        "limits": sorted({kind for limit in limits for kind in limit.kinds}),
        "not_set": sorted({m for limit in limits for m in limit.missing}),
    }


def model_stores(model: str, counts: list[int]) -> tuple[Path, dict[int, Path]]:
    """The checkpoint and its stores split over each member count, built once in the cache:
    "demo" (SmolLM2-135M as 16 experts, top-4: a trained model's routing and varied text) or
    "bench" (the DeepSeek-V3-shaped random checkpoint; its greedy text repeats a few tokens,
    so its routing repeats too and caches hit far more than on real text)."""
    from benchmarks.bench import bench_checkpoint
    from builders.demo_models import build_once, cache_root, moe_folder, prepare
    from engine.sharding import shard

    if model == "demo":
        return moe_folder(16, 4), {n: prepare(16, 4, n, progress=False) for n in counts}
    if model != "bench":
        raise SystemExit(f"--model takes demo or bench, not {model!r}")
    source, _ = bench_checkpoint(False)
    return source, {n: build_once(cache_root() / "scale" / f"sharded-w{n}",
                                  lambda out, n=n: shard(source, out, workers=n, progress=False),
                                  f"{n} member stores") for n in counts}


def run_scale(counts: list[int], *, model: str, quick: bool, drive_mbps: float,
              budget_share: float, skew: float, json_path: Path | None,
              lookahead: bool = True) -> dict:
    """Every member count at `drive_mbps` (0: no read limit), then each again with every expert
    in memory and no read limit (what the prediction takes as a token's compute)."""
    from mlx_lm.utils import load_tokenizer

    from benchmarks.bench import bench_root
    from benchmarks.streaming import run_mlx_lm
    from coordinator.decoding.generate import encode_prompt
    from engine.auth import ensure_secret

    tokens = 8 if quick else 32
    source, sharded = model_stores(model, counts)
    manifest = read_manifest(sharded[counts[0]])
    sizes = {(e.layer, e.expert): e.bytes for e in manifest.experts}
    expert_total = sum(sizes.values())
    experts = manifest.layers[0].num_experts
    top_k = json.loads((source / "config.json").read_text())["num_experts_per_tok"]
    budget = int(expert_total * budget_share)
    read_bps = int(drive_mbps * 1e6) if drive_mbps > 0 else None
    device = block_device(sharded[counts[0]])
    secret_file = bench_root(False) / "secret"
    ensure_secret(secret_file)
    ids = encode_prompt(load_tokenizer(sharded[counts[0]] / "dense"), PROMPT, chat=True)
    print(f"model: {model} ({source.name}), {len({k[0] for k in sizes})} MoE layers "
          f"x {manifest.layers[0].num_experts} experts (top-{top_k}), experts "
          f"{format_bytes(expert_total)}; each member: memory budget {format_bytes(budget)} "
          f"({100 * budget_share:.0f}% of the experts), drive {drive_mbps:g} MB/s; decode "
          f"{tokens} tokens; load {os.getloadavg()[0]:.1f}", flush=True)
    drop_page_cache(sorted(source.glob("*.safetensors")))
    reference = run_mlx_lm(source, ids, tokens, None)
    rows, floors = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            floor = run_point(sharded[n], n, expert_total, None, ids, tokens, secret_file,
                              Path(tmp), device)
            floors[n] = 1.0 / floor["tok_s"]
            # The decode's own routing, counted by the members with every expert in memory
            # (the ids are the same at every point, so is the routing): the heat record.
            heat = floor["heat"] or skewed_heat({k[0]: experts for k in sizes}, skew)
            row = run_point(sharded[n], n, budget, read_bps, ids, tokens, secret_file,
                            Path(tmp), device, lookahead)
            row["exact"] = row["tokens"] == reference.get("tokens")
            row["all_in_memory_tok_s"] = floor["tok_s"]
            members = [StreamingMember(f"member-{i}", budget, read_bps or 1e15)
                       for i in range(n)]
            row["predicted"] = predict_streaming(
                holders_of(sharded[n], n), members, sizes,
                heat,
                top_k=top_k, compute_seconds=floors[n])
            row.pop("heat")
            rows.append(row)
            print(f"  {n} member(s): {row['tok_s']:.3f} tok/s (predicted "
                  f"{row['predicted']['tokens_per_second']:.3f}), load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    limited = mlx_lm_limited(source, ids, tokens, reference, expert_total, budget, read_bps,
                             device)
    report = {"model": model, "lookahead": lookahead, "drive_mbps": drive_mbps,
              "memory_budget": budget,
              "expert_bytes": expert_total,
              "decode_tokens": tokens, "skew_assumed": skew, "rows": rows,
              "mlx_lm": {k: v for k, v in reference.items() if k != "tokens"},
              "mlx_lm_limited": limited, "load_after": os.getloadavg()[0]}
    for row in rows:
        row["ratio"] = row["tok_s"] / rows[0]["tok_s"]
    print_scale(report)
    if json_path:
        json_path.write_text(json.dumps(report, indent=1))
    return report


def mlx_lm_limited(source: Path, ids: list[int], tokens: int, reference: dict, expert_total: int,
                   budget: int, read_bps: int | None, device: str | None) -> dict:
    """mlx-lm under one member's limits: its unlimited peak less the experts beyond the
    budget (plus 32 MiB), and the same read limit."""
    from benchmarks.streaming import run_mlx_lm

    if "peak_rss" not in reference:
        return {"error": reference.get("error", "no reference run")}
    memory = reference["peak_rss"] - expert_total + budget + (32 << 20)
    limit = MemberLimits("shoal-scale-mlx-lm", memory, read_bps, device)
    try:
        drop_page_cache(sorted(source.glob("*.safetensors")))
        row = run_mlx_lm(source, ids, tokens, limit)
        row.update(memory_limit=memory, limits=limit.kinds, not_set=limit.missing)
        if "tokens" in row:
            row["exact"] = row.pop("tokens") == reference["tokens"]
        return row
    finally:
        limit.close()


def print_scale(report: dict) -> None:
    print(f"\ndrive {report['drive_mbps']:g} MB/s and memory budget "
          f"{format_bytes(report['memory_budget'])} per member; predicted: engine/stream_speed.py "
          "(shoal plan's forecast) from the decode's heat and the all-in-memory run's speed")
    print(f"{'members':>7} {'tok/s':>7} {'x one':>6} {'predicted':>9} {'hit':>6} "
          f"{'read/tok':>10} {'drive busy':>18} {'exact':>6} {'all in memory':>13} "
          f"{'pred. hit':>9} {'pred. read':>10}")
    for row in report["rows"]:
        busy = ",".join(f"{100 * b:.0f}%" for b in row["drive_busy"])
        print(f"{row['members']:>7} {row['tok_s']:>7.3f} {row['ratio']:>6.2f} "
              f"{row['predicted']['tokens_per_second']:>9.3f} "
              f"{100 * (row['hit_rate'] or 0):>5.1f}% "
              f"{format_bytes(row['read_bytes_per_token']):>10} {busy:>18} "
              f"{str(row['exact']):>6} {row['all_in_memory_tok_s']:>13.3f} "
              f"{100 * row['predicted']['hit_rate']:>8.1f}% "
              f"{format_bytes(row['predicted']['read_bytes_per_token']):>10}")
    ref, lim = report["mlx_lm"], report["mlx_lm_limited"]
    print(f"mlx-lm, no limits: {ref.get('decode_tps', 0):.3f} tok/s; under one member's limits "
          f"({format_bytes(lim.get('memory_limit', 0))} memory, same read limit): "
          + (f"{lim['decode_tps']:.3f} tok/s" if "decode_tps" in lim else lim.get("error", "-")))
    not_set = sorted({m for row in report["rows"] for m in row["not_set"]})
    print("limits set: " + ", ".join(report["rows"][0]["limits"] or ["none"])
          + ("; could not set: " + "; ".join(not_set) if not_set else ""))
