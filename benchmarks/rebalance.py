"""Rebalancing benchmark: record the heat of real traffic over W local workers, rebalance live
(`shoal rebalance`'s code), generate again (tokens must be identical), and measure the
imbalance before and after, and the planner alone for other worker counts."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.records import write_record
from builders.demo_models import prepare
from builders.synthetic import build_checkpoint
from coordinator.dataplane.link import WorkerLink
from coordinator.decoding.generate import encode_prompt, generate, open_remote_model
from coordinator.ops.heat_record import fetch_readings, load_record, record_path
from coordinator.ops.local_processes import start_workers, stop_workers
from coordinator.ops.rebalancer import migrate
from engine.auth import create_secret, load_secret
from engine.cache_policy import format_bytes, parse_budget
from engine.heat import difference
from engine.manifest import read_manifest
from engine.placement import WorkerCapacity, load_imbalance, plan_placement
from engine.sharding import shard

PROMPTS = [
    "Explain how rainbows form.",
    "Write a short poem about the sea.",
    "What is the capital of France, and why is it famous?",
    "List three uses of a paperclip.",
    "How do plants make food from sunlight?",
    "Give me a recipe for pancakes.",
]


def log(message: str) -> None:
    print(f"rebalance-bench: {message}", file=sys.stderr, flush=True)


def model_folder(args: argparse.Namespace, scratch: Path) -> Path:
    """A sharded model (OUT_DIR with worker-K stores) in `scratch`, which this run may change."""
    if args.quick:
        source = build_checkpoint(scratch / "source", "qwen3_moe")
        shard(source, scratch / "out", workers=args.workers, progress=False)
        return scratch / "out"
    cached = prepare(args.experts, args.top_k, args.workers)
    shutil.copytree(cached, scratch / "out")
    return scratch / "out"


def run_prompts(remote, tokens: int) -> tuple[list[list[int]], float]:
    out, decode = [], []
    for text in PROMPTS:
        ids = encode_prompt(remote.tokenizer, text, chat=True)
        result = generate(remote.model, remote.tokenizer, ids, max_tokens=tokens)
        out.append(result.token_ids)
        decode.append(result.decode_tps)
    return out, sum(decode) / len(decode)


def measure(sharded: Path, addresses: list[str], secret: bytes, links: list[WorkerLink],
            tokens: int) -> dict:
    before = {r.name: r.counts for r in fetch_readings(links)}
    remote = open_remote_model(sharded, addresses, secret)
    try:
        ids, decode_tps = run_prompts(remote, tokens)
    finally:
        remote.close()
    after = {r.name: r.counts for r in fetch_readings(links)}
    loads = {w: difference(after[w], before.get(w, {})) for w in after}
    per_worker = {w: sum(c.values()) for w, c in sorted(loads.items())}
    return {"tokens": ids, "imbalance": load_imbalance(loads), "pairs_per_worker": per_worker,
            "decode_tps": decode_tps}


def what_if(sharded: Path, heat: dict, counts: list[int]) -> list[dict]:
    """The planner alone on the recorded heat: predicted imbalance for other cluster sizes."""
    manifest = read_manifest(sharded)
    sizes = {(e.layer, e.expert): e.bytes for e in manifest.experts}
    rows = []
    for n in counts:
        workers = [WorkerCapacity(f"w{k}", 1 << 40) for k in range(n)]
        plan = plan_placement(workers, sizes, heat)
        rows.append({"workers": n, "imbalance_before": plan.imbalance_before,
                     "imbalance_after": plan.imbalance_after, "replicated": len(plan.replicas)})
    return rows


def run(args: argparse.Namespace) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="shoal-rebalance-bench-"))
    try:
        sharded = model_folder(args, scratch)
        stores = []
        for k in range(args.workers):  # the workers' stores, apart from OUT_DIR
            stores.append(scratch / "stores" / f"worker-{k}")
            shutil.move(sharded / f"worker-{k}", stores[-1])
        secret_file = create_secret(scratch / "secret")
        secret = load_secret(secret_file)
        workers = start_workers([[s] for s in stores], secret_file, scratch / "logs")
        links = [WorkerLink(w.address, secret) for w in workers]
        addresses = [w.address for w in workers]
        try:
            log(f"{args.workers} workers; generating {len(PROMPTS)} prompts x {args.tokens} "
                "tokens to record the heat")
            before = measure(sharded, addresses, secret, links, args.tokens)
            max_bytes = parse_budget(args.max_bytes).bytes if args.max_bytes else None
            log("rebalancing")
            started = time.perf_counter()
            report = migrate(sharded, links, deploy=False, max_bytes=max_bytes, progress=False,
                             log=log)
            seconds = time.perf_counter() - started
            log("generating again")
            after = measure(sharded, addresses, secret, links, args.tokens)
        finally:
            for link in links:
                link.close()
            stop_workers(workers)

        manifest = read_manifest(sharded)
        heat = load_record(record_path(sharded), manifest.fingerprint).total()
        plan = report.proposal.plan
        execution = report.execution
        return {
            "model": manifest.model_type + (" (tiny random)" if args.quick else
                                            f" (SmolLM2 MoE e{args.experts} k{args.top_k})"),
            "workers": args.workers,
            "expert_bytes": sum(e.bytes for e in manifest.experts),
            "recorded_pairs": int(sum(heat.values())),
            "tokens_identical": before["tokens"] == after["tokens"],
            "measured_imbalance_before": before["imbalance"],
            "measured_imbalance_after": after["imbalance"],
            "pairs_per_worker_before": before["pairs_per_worker"],
            "pairs_per_worker_after": after["pairs_per_worker"],
            "predicted_imbalance_before": report.proposal.imbalance_now,
            "predicted_imbalance_after": report.proposal.imbalance_after,
            "steps": len(plan.steps),
            "copies": plan.count("copy"),
            "drops": plan.count("delete"),
            "bytes_sent": execution.copied_bytes if execution else 0,
            "migration_seconds": seconds,
            "decode_tps_before": before["decode_tps"],
            "decode_tps_after": after["decode_tps"],
            "what_if": what_if(sharded, heat, [2, 3, 4, 6]),
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def table(r: dict) -> str:
    lines = [
        f"model {r['model']}, {r['workers']} workers, {format_bytes(r['expert_bytes'])} of "
        f"experts, heat of {r['recorded_pairs']} (token, expert) pairs",
        "imbalance (busiest worker / mean, per layer)   before   after",
        f"  predicted from the heat                    {r['predicted_imbalance_before']:>7.2f} "
        f"{r['predicted_imbalance_after']:>7.2f}",
        f"  measured by the workers                    {r['measured_imbalance_before']:>7.2f} "
        f"{r['measured_imbalance_after']:>7.2f}",
        f"pairs per worker before: {r['pairs_per_worker_before']}",
        f"pairs per worker after:  {r['pairs_per_worker_after']}",
        f"migration: {r['steps']} steps ({r['copies']} copies, {r['drops']} drops), "
        f"{format_bytes(r['bytes_sent'])} sent, {r['migration_seconds']:.1f} s",
        f"decode tok/s before {r['decode_tps_before']:.1f}, after {r['decode_tps_after']:.1f}; "
        f"tokens identical: {r['tokens_identical']}",
        "planner alone on this heat: workers, predicted imbalance before -> after, replicated",
    ]
    lines += [f"  {w['workers']:>2}: {w['imbalance_before']:.2f} -> {w['imbalance_after']:.2f}, "
              f"{w['replicated']} experts" for w in r["what_if"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--max-bytes", metavar="SIZE", help="as `shoal rebalance --max-bytes`")
    parser.add_argument("--quick", action="store_true", help="the tiny random checkpoint")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run(args)
    write_record(what="rebalance" + ("-quick" if args.quick else ""), figures=report)
    print(json.dumps(report, indent=1) if args.json else table(report))


if __name__ == "__main__":
    main()
