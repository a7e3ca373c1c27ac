"""Speculative decoding's speed-up: the demo's 16-expert MoE on local workers with drafts (4-bit,
dense ceiling, random floor), or with --draft mtp the model's own MTP module (mtp_speedup.py),
each drafted run checked to give the plain run's greedy tokens (docs/speculative.md)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import load

from benchmarks import mtp_speedup
from benchmarks.draft_rows import figures, log, median_run, result_lines
from benchmarks.records import machine, write_record
from builders.demo_models import build_once, cache_root, prepare, prepare_dense, prepare_draft
from builders.synthetic import build_random_draft
from coordinator.cli.demo_command import demo_workers
from coordinator.decoding.draft_policy import DEFAULT_DRAFT_TOKENS, DraftPolicy
from coordinator.decoding.generate import encode_prompt, generate
from coordinator.decoding.speculative import Draft
from engine.errors import ShoalError

# The model's own answer to this runs past 64 tokens without stopping.
PROMPT = "Explain how rainbows form."
USELESS_TOLERANCE = 0.05  # a useless draft may cost at most this share of plain decode speed


def drafts(max_draft: int) -> dict[str, tuple[Path, DraftPolicy]]:
    """name -> (draft folder, policy), each built into the demo cache on first use."""
    dense = prepare_dense(progress=False)
    random_dir = build_once(cache_root() / "demo" / "random-draft",
                            lambda out: build_random_draft(out, dense), "a random draft model")
    quantized = prepare_draft(progress=False)
    adaptive, fixed = DraftPolicy(max_draft), DraftPolicy(max_draft, adaptive=False)
    return {
        "q4_adaptive": (quantized, adaptive),
        "q4_fixed": (quantized, fixed),
        "dense_adaptive": (dense, adaptive),
        "random_adaptive": (random_dir, adaptive),
        "random_fixed": (random_dir, fixed),
    }


def forward_cost(model, ids: list[int], rows: int, repeat: int = 3) -> dict:
    """Seconds of one target forward of 1 row and of `rows` rows after the prompt (the shape
    of a plain step and of a verification step), each the median of `repeat`."""
    cache = make_prompt_cache(model)
    model(mx.array(ids[:-1])[None], cache=cache)
    mx.eval([c.state for c in cache])

    def timed(count: int) -> float:
        seconds = []
        for _ in range(repeat):
            started = time.perf_counter()
            mx.eval(model(mx.array(ids[-1:] * count)[None], cache=cache))
            seconds.append(time.perf_counter() - started)
            trim_prompt_cache(cache, count)
        return statistics.median(seconds)

    one, many = timed(1), timed(rows)
    return {"rows": rows, "one_row_ms": 1e3 * one, "rows_ms": 1e3 * many,
            "ratio": many / one if one else None}


def run(*, runs: int = 3, tokens: int = 64, max_draft: int = DEFAULT_DRAFT_TOKENS,
        workers: int = 2, only: list[str] | None = None) -> dict:
    """Plain and drafted decoding, interleaved run by run so that a machine that slows down
    or speeds up during the benchmark affects every configuration alike."""
    sharded = prepare(16, 16, workers, progress=False)
    chosen = {name: spec for name, spec in drafts(max_draft).items()
              if only is None or name in only}
    loaded = {name: Draft(load(str(folder))[0], policy, folder)
              for name, (folder, policy) in chosen.items()}
    samples: dict[str, list[dict]] = {name: [] for name in ["plain", *loaded]}
    started = time.perf_counter()
    with demo_workers(sharded, workers) as (remote, _):
        ids = encode_prompt(remote.tokenizer, PROMPT, chat=True)
        log("warming up")
        generate(remote.model, remote.tokenizer, ids, max_tokens=4)
        log(f"timing a target forward of 1 and of {max_draft + 1} rows")
        verify_cost = forward_cost(remote.model, ids, max_draft + 1)
        for index in range(runs):
            log(f"run {index + 1} of {runs}: plain")
            plain = generate(remote.model, remote.tokenizer, ids, max_tokens=tokens)
            samples["plain"].append(figures(plain, None))
            for name, draft in loaded.items():
                log(f"run {index + 1} of {runs}: {name}")
                result = generate(remote.model, remote.tokenizer, ids, max_tokens=tokens,
                                  draft=draft)
                samples[name].append(figures(result, plain))
    report = {name: median_run(rows) for name, rows in samples.items()}
    base = report["plain"]["decode_tps"]
    for row in report.values():
        row["ratio_vs_plain"] = row["decode_tps"] / base if base else None
    targets = {}
    if "random_adaptive" in report:
        ratio = report["random_adaptive"]["ratio_vs_plain"]
        targets["useless_draft_within_5pct"] = ratio is not None and ratio >= 1 - USELESS_TOLERANCE
    targets["greedy_tokens_identical"] = all(row["same_tokens"] for row in report.values()
                                             if "same_tokens" in row)
    return {
        "machine": machine(),
        "settings": {"model": "SmolLM2-135M-Instruct as a 16-expert float32 MoE (top-16)",
                     "workers": workers, "prompt": PROMPT, "tokens": tokens, "runs": runs,
                     "num_draft_tokens": max_draft},
        "results": report,
        "verify_forward_cost": verify_cost,
        "targets": targets,
        "seconds": time.perf_counter() - started,
    }


def table(report: dict) -> str:
    lines = result_lines("speculative decoding", report, "draft", 16)
    cost = report["verify_forward_cost"]
    lines.append(f"  a target forward of {cost['rows']} rows costs {cost['ratio']:.2f}x one of 1 "
                 f"row ({cost['rows_ms']:.0f} ms against {cost['one_row_ms']:.0f} ms)")
    for name, met in report["targets"].items():
        lines.append(f"  target {name}: {'met' if met else 'MISSED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.draft_speedup",
        description="Decode tokens/s of the demo MoE on local workers, plainly and with "
        "draft models (the 4-bit dense model, the float32 dense model, a random model), "
        "the acceptance rate, and each one's ratio to plain decoding. Builds the demo model "
        "and the drafts into the cache on first use ($SHOAL_CACHE, else ~/.cache/shoal).",
    )
    parser.add_argument("--runs", type=int, default=3, metavar="R",
                        help="timed generations per configuration; the median is reported")
    parser.add_argument("--tokens", type=int, default=64, metavar="T",
                        help="tokens generated per run (default 64)")
    parser.add_argument("--num-draft-tokens", type=int, default=DEFAULT_DRAFT_TOKENS,
                        metavar="N", help=f"most drafted tokens per step (default "
                        f"{DEFAULT_DRAFT_TOKENS})")
    parser.add_argument("--workers", type=int, default=2, metavar="W")
    parser.add_argument("--only", nargs="+", metavar="DRAFT",
                        choices=["q4_adaptive", "q4_fixed", "dense_adaptive", "random_adaptive",
                                 "random_fixed"],
                        help="measure only these drafts (plain decoding is always measured)")
    parser.add_argument("--draft", choices=["models", "mtp"], default="models",
                        help="models: the demo model with draft models (default); mtp: a "
                        "synthetic DeepSeek-V3 with its own MTP module drafting "
                        "(benchmarks/mtp_speedup.py)")
    parser.add_argument("--size", choices=["tiny", "bench", "deep"], default="bench",
                        help="with --draft mtp: the synthetic model's size (default bench: 11 "
                        "MoE layers; deep: 24, narrow)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.tokens < 2 or not 1 <= args.workers <= 16:
        parser.error("--runs must be at least 1, --tokens at least 2, --workers 1 to 16")
    try:
        DraftPolicy(args.num_draft_tokens)  # checks N before anything is built
        if args.draft == "mtp":
            report = mtp_speedup.run(runs=args.runs, tokens=args.tokens,
                                     max_draft=args.num_draft_tokens, workers=args.workers,
                                     size=args.size)
            text = mtp_speedup.table(report)
        else:
            report = run(runs=args.runs, tokens=args.tokens, max_draft=args.num_draft_tokens,
                         workers=args.workers, only=args.only)
            text = table(report)
    except ShoalError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        sys.exit(2)
    what = "draft-speedup" if args.draft != "mtp" else \
        "mtp-speedup" + ("" if args.size == "bench" else f"-{args.size}")
    write_record(what=what,
                 figures=report["results"], **report)
    print(json.dumps(report, indent=1) if args.json else text)


if __name__ == "__main__":
    main()
