"""A/B of Shoal's decode under environment variants: each variant in its own processes
(coordinator and two local workers) on the bench checkpoint, one RESULT line each (decode
tok/s and the per-layer breakdown) and one record for the whole run."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.checkpoints import bench_files
from benchmarks.measure import bench_prompt, timed_generation
from benchmarks.records import from_variants, write_record
from benchmarks.shoal_runs import decode_dispatch
from coordinator.dataplane.link import Transport
from coordinator.decoding.generate import open_remote_model
from coordinator.ops.local_processes import start_workers, stop_workers
from engine.auth import load_secret
from engine.process import launch_directly

VARIANTS_HELP = """\
A variant is LABEL:VAR=VALUE[,VAR=VALUE...] (nothing after the colon: the environment as it
is); workers.VAR=VALUE sets VAR for the two workers only, coordinator.VAR=VALUE for the
coordinator only. SHOAL_TRANSPORT (lane or grpc), SHOAL_SPIN_US and SHOAL_WORKER_ARGS (more
shoal-worker arguments) are the coordinator's --transport and --spin-us and the workers'.
Run them alternately (a b a b): the spread between runs of one variant is the error bar.

    python -m benchmarks.variants advice: noadvice:SHOAL_CUDA_ADVICE=0
    python -m benchmarks.variants both: coordinator:coordinator.MLX_USE_CUDA_GRAPHS=0
    python -m benchmarks.variants --prefill 512 lane: grpc:SHOAL_TRANSPORT=grpc \\
        lane: grpc:SHOAL_TRANSPORT=grpc
"""
RESULT = "RESULT "
WORKER_ENV = "SHOAL_VARIANT_WORKER_ENV"  # parent -> child: the workers' own settings (JSON)
SCOPES = ("workers", "coordinator")


def measure(quick: bool, runs: int, prefill: int = 0) -> dict:
    _, sharded, secret, logs = bench_files(quick, "variant-logs")
    workers = start_workers([[sharded / f"worker-{k}"] for k in range(2)], secret, logs,
                            places=[(worker_prefix(), "127.0.0.1")] * 2,
                            extra=os.environ.get("SHOAL_WORKER_ARGS", "").split())
    try:
        transport = Transport(os.environ.get("SHOAL_TRANSPORT", "lane"),
                              float(os.environ.get("SHOAL_SPIN_US", "0")) / 1e6)
        remote = open_remote_model(sharded, [w.address for w in workers], load_secret(secret),
                                   transport=transport)
        try:
            vocab = remote.manifest.config["vocab_size"]
            prompt = bench_prompt(vocab, 16)
            timed_generation(remote.model, remote.tokenizer, prompt, 8)  # warm-up
            speeds = [timed_generation(remote.model, remote.tokenizer, prompt, 32)[1]
                      for _ in range(runs)]
            dispatch = decode_dispatch(remote, vocab, 32, 16)
            prompt_pass = {}
            if prefill:
                long_prompt = bench_prompt(vocab, prefill)
                timed_generation(remote.model, remote.tokenizer, long_prompt, 1)  # warm-up
                stats = remote.dispatcher.stats
                stats.reset()
                rates = [timed_generation(remote.model, remote.tokenizer, long_prompt, 1)[0]
                         for _ in range(runs)]
                prompt_pass = {
                    f"prefill{prefill}_tok_s": round(statistics.median(rates), 1),
                    f"prefill{prefill}_runs": [round(r, 1) for r in rates],
                    "prefill_breakdown": {k: round(v) for k, v in
                                          stats.prefill.breakdown().items()}}
        finally:
            remote.close()
    finally:
        stop_workers(workers)
    return {"tok_s": round(statistics.median(speeds), 1),
            "runs": [round(s, 1) for s in speeds],
            "breakdown": {k: round(v) for k, v in dispatch["breakdown"].items()}, **prompt_pass}


def worker_prefix() -> list[str]:
    """`env` with the workers' own settings (a value of None: unset for them)."""
    settings = json.loads(os.environ.get(WORKER_ENV, "{}"))
    prefix = ["env"]
    for name, value in settings.items():
        prefix += ["-u", name] if value is None else [f"{name}={value}"]
    return prefix


def parse_variant(text: str) -> tuple[str, dict[str, str], dict[str, str | None]]:
    """(label, the coordinator's environment changes, the workers' own settings)."""
    label, _, assignments = text.partition(":")
    env: dict[str, str] = {}
    workers: dict[str, str | None] = {}
    for item in filter(None, assignments.split(",")):
        name, equals, value = item.partition("=")
        scope, dot, bare = name.partition(".")
        if not equals or not name or (dot and scope not in SCOPES) or (dot and not bare):
            raise SystemExit(f"variant {text!r}: expected LABEL:[SCOPE.]VAR=VALUE[,...] with "
                             f"SCOPE one of {', '.join(SCOPES)}")
        if scope == "workers":
            workers[bare] = value
        elif scope == "coordinator":
            env[bare] = value
            workers.setdefault(bare, os.environ.get(bare))  # as it was, for the workers
        else:
            env[name] = value
    return label, env, workers


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Shoal's decode speed and per-layer breakdown under environment variants, "
                    "each in its own process.", epilog=VARIANTS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", metavar="LABEL:VAR=VALUE,...",
                        help="one run per variant, in the order given")
    parser.add_argument("--quick", action="store_true", help="the tiny checkpoint")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=0, metavar="N",
                        help="also time the prompt pass of an N-token prompt (--runs times)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    if args.one:
        launch_directly()  # as `shoal` does, before any kernel (engine/process.py)
        print(RESULT + json.dumps(measure(args.quick, args.runs, args.prefill)), flush=True)
        return
    results = []
    for text in args.variants:
        label, env, workers = parse_variant(text)
        command = [sys.executable, "-m", "benchmarks.variants", "--one", "--runs",
                   str(args.runs), "--prefill", str(args.prefill),
                   *(["--quick"] if args.quick else [])]
        child = subprocess.run(command, env={**os.environ, **env, WORKER_ENV: json.dumps(workers)},
                               capture_output=True, text=True, timeout=900,
                               cwd=Path(__file__).parent.parent)
        lines = [line for line in child.stdout.splitlines() if line.startswith(RESULT)]
        if not lines:
            print(f"{label}: failed ({child.returncode}): {child.stderr[-1500:]}", flush=True)
            continue
        result = {"variant": label, **json.loads(lines[-1][len(RESULT):])}
        print(RESULT + json.dumps(result), flush=True)
        results.append(result)
    if results:
        figures, baselines = from_variants(results)
        write_record(what="variants-" + "-".join(dict.fromkeys(r["variant"] for r in results)),
                     figures=figures, baselines=baselines)


if __name__ == "__main__":
    main()
