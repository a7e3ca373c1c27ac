"""The streamed path against the resident one, page cache warm: mlx-lm with every expert in
memory, the coordinator's own store and one worker at a memory budget, alternated rounds:
`python -m benchmarks.streamed_path [--family deepseek_v3] [--rounds 3] [--interleaved]`."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlx_lm import load  # noqa: E402

from benchmarks.measure import bench_prompt, greedy_generation  # noqa: E402
from benchmarks.mlx_lm_process import run_mlx_lm  # noqa: E402
from benchmarks.streaming import run_local  # noqa: E402
from builders.demo_models import build_once, cache_root  # noqa: E402
from builders.synthetic import build_checkpoint  # noqa: E402
from coordinator.dataplane.dispatch_stats import DispatchStats  # noqa: E402
from coordinator.decoding.generate import open_remote_model  # noqa: E402
from coordinator.ops.local_processes import start_worker  # noqa: E402
from engine.auth import ensure_secret, load_secret  # noqa: E402
from engine.sharding import shard  # noqa: E402
from engine.store_lock import LOCK_NAME, SERVING_NAME  # noqa: E402

PROMPT_TOKENS = 16


def checkpoint(family: str) -> tuple[Path, Path]:
    """The bench-sized, 4-bit checkpoint of `family` and its one store, built once."""
    root = cache_root() / "streamed-path"
    source = build_once(root / f"{family}-source",
                        lambda out: build_checkpoint(out, family, size="bench", quantize_bits=4,
                                                     group_size=64),
                        f"the bench-sized {family} checkpoint")
    sharded = build_once(root / f"{family}-sharded",
                         lambda out: shard(source, out, workers=1, progress=False),
                         "its store")
    return source, sharded


def worker_once(sharded: str, share: int, ids: list[int], tokens: int) -> None:
    """Run in a process of its own: one `shoal-worker` over loopback serving every expert at
    `share`% of their bytes; prints one JSON line as `local_once` does."""
    root = Path(sharded)
    secret = root.parent / "secret"
    ensure_secret(secret)
    worker = start_worker([root / "worker-0"], secret, root.parent / "worker.log",
                          ["--memory-budget", f"{share}%"])
    try:
        remote = open_remote_model(root, [worker.address], load_secret(secret))
        try:
            run = greedy_generation(remote.model, remote.tokenizer, ids, tokens,
                                    remote.dispatcher.stats.reset)
        finally:
            remote.close()
    finally:
        worker.stop()
    breakdown = remote.dispatcher.stats.decode.breakdown()
    print(json.dumps({
        "share": share, "tokens": run.tokens, "decode_tps": run.generation_tps,
        "bookkeeping_us": breakdown["worker_bookkeeping_us"],
        "parse_us": breakdown.get("worker_parse_us", 0.0),
        "matrix_us": breakdown["worker_matrix_us"],
    }))


def own_breakdown(stats: DispatchStats) -> dict:
    """The own store's streamed decode layer calls as `--stats` breaks them down, us a call:
    the router's picks evaluated (sync), the waits for reads, the rest (bookkeeping)."""
    parts = stats.decode.breakdown()
    return {"calls": stats.decode.calls, "sync_us": parts["sync_us"],
            "reads_us": parts["worker_reads_us"], "bookkeeping_us": parts["worker_bookkeeping_us"]}


def local_bookkeeping_once(sharded: str, share: int, ids: list[int], tokens: int) -> None:
    """Run in a process of its own: the coordinator's own store at `share`%, its decode layer
    calls' breakdown (none at 100%: every layer's call is mlx-lm's, lazy); one JSON line."""
    root = Path(sharded)
    remote = open_remote_model(root, [], b"", local_stores=[root / "worker-0"],
                               memory_budget=f"{share}%")
    try:
        run = greedy_generation(remote.model, remote.tokenizer, ids, tokens,
                                remote.dispatcher.stats.reset)
    finally:
        remote.close()
    print(json.dumps({"share": share, "tokens": run.tokens, "decode_tps": run.generation_tps,
                      **own_breakdown(remote.dispatcher.stats)}))


def run_worker(sharded: Path, share: int, ids: list[int], tokens: int,
               what: str = "worker_once") -> dict:
    code = (f"from benchmarks.streamed_path import {what}; "
            f"{what}({str(sharded)!r}, {share}, {ids!r}, {tokens})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=1800, cwd=REPO)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-300:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="deepseek_v3", choices=["deepseek_v3", "qwen3_moe"])
    parser.add_argument("--share", type=int, default=25, help="memory budget, %% (default 25)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    parser.add_argument("--interleaved", action="store_true",
                        help="all three in one process, a generation each in turn (for a "
                        "machine whose load swings from minute to minute)")
    parser.add_argument("--bookkeeping", action="store_true",
                        help="instead: the time per decode layer call outside MLX and reads, "
                        "own store and worker, at 100%% and at the budget, alternated")
    args = parser.parse_args()

    source, sharded = checkpoint(args.family)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    ids = bench_prompt(vocab, PROMPT_TOKENS)
    if args.bookkeeping:
        bookkeeping(sharded, args.share, ids, args.tokens, args.rounds)
        return
    configs = ["mlx-lm", "local", "worker"]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    if args.interleaved:
        runs = interleaved(source, sharded, args.share, ids, args.tokens, args.rounds)
    for round_ in range(0 if args.interleaved else args.rounds):
        for config in configs[round_ % 3:] + configs[:round_ % 3]:
            started = time.perf_counter()
            row = (run_mlx_lm(source, ids, args.tokens, None) if config == "mlx-lm" else
                   run_local(sharded, sharded / "worker-0", args.share, ids, args.tokens)
                   if config == "local" else run_worker(sharded, args.share, ids, args.tokens))
            if "error" in row:
                raise SystemExit(f"{config}: {row['error']}")
            runs[config].append(row)
            print(f"  round {round_ + 1}: {config} {row['decode_tps']:.2f} tok/s "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    expected = runs["mlx-lm"][0]["tokens"]
    print(f"\n{args.family}, bench size, 4-bit, {args.share}% budget, {args.tokens} tokens, "
          f"{args.rounds} alternated rounds{', in one process' if args.interleaved else ''} "
          "(ratio: each run over its round's mlx-lm run)")
    for config in configs:
        rows = runs[config]
        ratios = [r["decode_tps"] / m["decode_tps"] for r, m in zip(rows, runs["mlx-lm"],
                                                                     strict=True)]
        extra = "".join(f" {key} {statistics.median(r[key] for r in rows):.0f}"
                        for key in ("sync_us", "reads_us", "bookkeeping_us", "parse_us",
                                    "matrix_us") if key in rows[0])
        print(f"{config:>8}: {statistics.median(r['decode_tps'] for r in rows):6.2f} tok/s, "
              f"x mlx-lm {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}), "
              f"same tokens {all(r['tokens'] == expected for r in rows)}{extra}")
    if args.json:
        args.json.write_text(json.dumps({"family": args.family, "share": args.share,
                                         "runs": runs}, indent=1))


def worker_store(sharded: Path) -> Path:
    """worker-0's files hard-linked into a folder of its own (its locks left out) for the
    worker that runs beside the own store: one process serves a store at a time."""
    copy = sharded.parent / f"{sharded.name}-worker-store"
    if not copy.exists():
        shutil.copytree(sharded / "worker-0", copy, copy_function=os.link,
                        ignore=shutil.ignore_patterns(LOCK_NAME, SERVING_NAME))
    return copy


def interleaved(source: Path, sharded: Path, share: int, ids: list[int], tokens: int,
                rounds: int) -> dict:
    """mlx-lm, the own store and a worker in one process, one generation each in turn, the
    order turned every round: on a machine whose load swings, each ratio is taken between
    generations seconds apart."""
    secret = sharded.parent / "secret"
    ensure_secret(secret)
    worker = start_worker([worker_store(sharded)], secret, sharded.parent / "worker.log",
                          ["--memory-budget", f"{share}%"])
    models = {"mlx-lm": load(str(source))}
    try:
        own = open_remote_model(sharded, [], b"", local_stores=[sharded / "worker-0"],
                                memory_budget=f"{share}%")
        remote = open_remote_model(sharded, [worker.address], load_secret(secret))
        models["local"], models["worker"] = (own.model, own.tokenizer), (remote.model,
                                                                         remote.tokenizer)
        runs: dict[str, list[dict]] = {name: [] for name in models}
        names = list(models)
        for round_ in range(rounds + 1):  # the first round warms up and is not kept
            for name in names[round_ % 3:] + names[:round_ % 3]:
                model, tokenizer = models[name]
                run = greedy_generation(model, tokenizer, ids, tokens, own.dispatcher.stats.reset)
                if round_:
                    runs[name].append({"tokens": run.tokens, "decode_tps": run.generation_tps,
                                       **(own_breakdown(own.dispatcher.stats)
                                          if name == "local" else {})})
        own.close()
        remote.close()
    finally:
        worker.stop()
    return runs


def bookkeeping(sharded: Path, share: int, ids: list[int], tokens: int, rounds: int) -> None:
    """Each member kind's bookkeeping per decode layer call at 100% and at `share`%."""
    configs = [(what, budget) for what in ("local_bookkeeping_once", "worker_once")
               for budget in (100, share)]
    runs: dict = {c: [] for c in configs}
    for round_ in range(rounds):
        for what, budget in configs[round_ % 4:] + configs[:round_ % 4]:
            row = run_worker(sharded, budget, ids, tokens, what)
            if "error" in row:
                raise SystemExit(f"{what} {budget}%: {row['error']}")
            runs[(what, budget)].append(row)
    print(f"bookkeeping per decode layer call (us), {rounds} alternated rounds, median (each):")
    for (what, budget), rows in runs.items():
        name = "own store" if what.startswith("local") else "worker"
        if rows[0].get("calls") == 0:
            print(f"{name:>10} at {budget:>3}%: no streamed call (mlx-lm's own, lazy)")
            continue
        each = [round(r["bookkeeping_us"]) for r in rows]
        print(f"{name:>10} at {budget:>3}%: {statistics.median(each):6.0f}  {each}  "
              f"same tokens {all(r['tokens'] == rows[0]['tokens'] for r in rows)}")


if __name__ == "__main__":
    main()
