"""The streamed path against the resident one, page cache warm: mlx-lm with every expert in
memory, the coordinator's own store and one worker over loopback at a memory budget, on the
bench's DeepSeek-V3- or qwen3_moe-shaped checkpoint, in alternated rounds.

    .venv/bin/python -m benchmarks.streamed_path [--family deepseek_v3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.measure import bench_prompt  # noqa: E402
from benchmarks.streaming import run_local, run_mlx_lm  # noqa: E402
from builders.demo_models import build_once, cache_root  # noqa: E402

PROMPT_TOKENS = 16


def checkpoint(family: str) -> tuple[Path, Path]:
    """The bench-sized, 4-bit checkpoint of `family` and its one store, built once."""
    from builders.synthetic import build_checkpoint
    from engine.sharding import shard

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
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from coordinator.generate import open_remote_model
    from coordinator.ops.local_processes import start_worker
    from engine.auth import ensure_secret, load_secret

    root = Path(sharded)
    secret = root.parent / "secret"
    ensure_secret(secret)
    worker = start_worker([root / "worker-0"], secret, root.parent / "worker.log",
                          ["--memory-budget", f"{share}%"])
    try:
        remote = open_remote_model(root, [worker.address], load_secret(secret))
        try:
            out, last = [], None
            for response in stream_generate(remote.model, remote.tokenizer, mx.array(ids),
                                            max_tokens=tokens, sampler=make_sampler(temp=0.0)):
                out.append(int(response.token))
                last = response
                if len(out) == 1:
                    remote.dispatcher.stats.reset()
        finally:
            remote.close()
    finally:
        worker.stop()
    breakdown = remote.dispatcher.stats.decode.breakdown()
    print(json.dumps({
        "share": share, "tokens": out, "decode_tps": last.generation_tps,
        "bookkeeping_us": breakdown["worker_bookkeeping_us"],
        "parse_us": breakdown.get("worker_parse_us", 0.0),
        "matrix_us": breakdown["worker_matrix_us"],
    }))


def run_worker(sharded: Path, share: int, ids: list[int], tokens: int) -> dict:
    code = ("from benchmarks.streamed_path import worker_once; "
            f"worker_once({str(sharded)!r}, {share}, {ids!r}, {tokens})")
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
    args = parser.parse_args()

    source, sharded = checkpoint(args.family)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    ids = bench_prompt(vocab, PROMPT_TOKENS)
    configs = ["mlx-lm", "local", "worker"]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for round_ in range(args.rounds):
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
          f"{args.rounds} alternated rounds (ratio: each run over its round's mlx-lm run)")
    for config in configs:
        rows = runs[config]
        ratios = [r["decode_tps"] / m["decode_tps"] for r, m in zip(rows, runs["mlx-lm"],
                                                                     strict=True)]
        extra = "".join(f" {key} {statistics.median(r[key] for r in rows):.0f}"
                        for key in ("bookkeeping_us", "parse_us", "matrix_us") if key in rows[0])
        print(f"{config:>8}: {statistics.median(r['decode_tps'] for r in rows):6.2f} tok/s, "
              f"x mlx-lm {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}), "
              f"same tokens {all(r['tokens'] == expected for r in rows)}{extra}")
    if args.json:
        args.json.write_text(json.dumps({"family": args.family, "share": args.share,
                                         "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
