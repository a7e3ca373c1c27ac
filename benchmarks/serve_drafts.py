"""One stream through `shoal serve` with a draft model against the same server without one (the
demo MoE on two local workers; the 4-bit demo draft and a random one), text checked equal:
`python -m benchmarks.serve_drafts [--model demo|deep|quick] [--json]` (serve.py: batches)."""
# Each configuration gets its own server; the prompt is sent alone `runs` times after a
# warm-up, and the median decode speed is kept. --model quick uses the bench's tiny checkpoint
# with its own weights as the draft (always right) and a random one: it checks the harness.

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.checkpoints import WORKERS, bench_files
from benchmarks.draft_speedup import PROMPT
from benchmarks.measure import bench_prompt
from benchmarks.mtp_speedup import PROMPT as MTP_PROMPT
from benchmarks.mtp_speedup import prepared
from benchmarks.records import machine, write_record
from benchmarks.serve import decode_tps, stream_once
from builders.demo_models import build_once, cache_root, prepare, prepare_dense, prepare_draft
from builders.synthetic import build_random_draft
from coordinator.cli.demo_command import demo_secret_file
from coordinator.ops.local_processes import start_server, start_workers, stop_workers
from engine.auth import ensure_secret
from engine.errors import ShoalError
from engine.manifest import read_manifest

FAST_DRAFT_SPEEDUP = 1.8  # the 4-bit demo draft, one stream, against serve without it
USELESS_TOLERANCE = 0.05  # a useless draft may cost at most this share of plain speed


def log(message: str) -> None:
    print(f"bench serve drafts: {message}", file=sys.stderr, flush=True)


def draft_model(folder: Path) -> tuple[str, ...]:
    return ("--draft-model", str(folder))


def setup(shape: str) -> tuple[Path, Path, list[tuple[str, Path, str | list[int], dict]]]:
    """(secret file, log folder, groups): each group a model's split, the prompt, and its
    servers (name -> draft options; "plain" first, the others' baseline)."""
    if shape == "quick":
        source, sharded, secret_file, log_dir = bench_files(True, logs="serve-drafts-logs")
        vocab = int(read_manifest(sharded).config["vocab_size"])
        random_dir = build_once(source.parent / "random-draft",
                                lambda out: build_random_draft(out, source), "a random draft")
        return secret_file, log_dir, [("tiny", sharded, bench_prompt(vocab, 16), {
            "plain": (), "right": draft_model(source), "random": draft_model(random_dir)})]
    secret_file = demo_secret_file()
    ensure_secret(secret_file)
    log_dir = cache_root() / "demo" / "serve-drafts-logs"
    if shape == "deep":  # mtp_speedup.py's models: a random MTP module, and one right
        models = prepared("deep", "float32", WORKERS)
        (random_split, _), (right_split, right_draft) = models["random"], models["right"]
        return secret_file, log_dir, [
            ("right", right_split, MTP_PROMPT, {"plain": (), "model": draft_model(right_draft),
                                                "mtp": ("--draft", "mtp")}),
            ("random", random_split, MTP_PROMPT, {"plain": (), "mtp": ("--draft", "mtp")})]
    sharded = prepare(16, 16, WORKERS, progress=False)
    dense = prepare_dense(progress=False)
    random_dir = build_once(cache_root() / "demo" / "random-draft",
                            lambda out: build_random_draft(out, dense), "a random draft model")
    return secret_file, log_dir, [("demo", sharded, PROMPT, {
        "plain": (), "q4": draft_model(prepare_draft(progress=False)),
        "random": draft_model(random_dir)})]


def measure(url: str, prompt: str | list[int], tokens: int, runs: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    stream_once(client, prompt, 4)  # warm-up
    results = [stream_once(client, prompt, tokens) for _ in range(runs)]
    speeds = [decode_tps(r) for r in results]
    return {"decode_tps": statistics.median(speeds), "decode_tps_runs": speeds,
            "text": results[0]["text"], "tokens": len(results[0]["times"])}


def run(*, shape: str, tokens: int, runs: int, max_draft: int) -> dict:
    import httpx2

    secret_file, log_dir, groups = setup(shape)
    rows: dict[str, dict] = {}
    for group, sharded, prompt, servers in groups:
        workers = start_workers([[sharded / f"worker-{k}"] for k in range(WORKERS)],
                                secret_file, log_dir)
        try:
            for name, extra in servers.items():
                depth = ("--num-draft-tokens", str(max_draft)) if extra else ()
                log(f"{group} {name}: starting shoal serve ...")
                server = start_server(sharded, [w.address for w in workers], secret_file,
                                      log_dir / f"serve-{group}-{name}.log",
                                      ("--model-id", "bench", "--prompt-cache-disk", "0",
                                       *extra, *depth))
                try:
                    row = measure(server.url, prompt, tokens, runs)
                    row["drafting"] = httpx2.get(server.url + "/health", timeout=10).json()[
                        "drafting"]
                finally:
                    server.stop()
                rows[f"{group}_{name}"] = row
        finally:
            stop_workers(workers)
        plain = rows[f"{group}_plain"]
        for name in servers:
            row = rows[f"{group}_{name}"]
            row["ratio_vs_plain"] = row["decode_tps"] / plain["decode_tps"] \
                if plain["decode_tps"] else None
            row["same_text"] = row["text"] == plain["text"]
    targets = {"same_text": all(row["same_text"] for row in rows.values())}
    if shape == "demo":
        targets["q4_at_least_1_8x"] = (rows["demo_q4"]["ratio_vs_plain"] or 0) >= \
            FAST_DRAFT_SPEEDUP
    useless = "random_mtp" if shape == "deep" else f"{groups[0][0]}_random"
    targets["useless_within_5pct"] = (rows[useless]["ratio_vs_plain"] or 0) >= \
        1 - USELESS_TOLERANCE
    ratios = {}
    if shape == "deep":
        model, mtp = (rows[f"right_{k}"]["ratio_vs_plain"] for k in ("model", "mtp"))
        ratios["mtp_speedup_over_draft_model_speedup"] = mtp / model if mtp and model else None
    models = {"quick": "tiny bench checkpoint", "demo": "demo MoE (16 experts)",
              "deep": "synthetic deepseek_v3 (deep: 24 MoE layers) with an MTP module"}
    return {"machine": machine(),
            "settings": {"model": models[shape], "workers": WORKERS, "tokens": tokens,
                         "runs": runs, "num_draft_tokens": max_draft, "streams": 1},
            "results": rows, "ratios": ratios, "targets": targets}


def table(report: dict) -> str:
    s = report["settings"]
    lines = [f"shoal serve, one stream, {s['model']}, {s['workers']} local workers, "
             f"{s['tokens']} tokens, median of {s['runs']}, N <= {s['num_draft_tokens']}",
             f"  {'draft':<8} {'tok/s':>7} {'vs plain':>8} {'accepted':>9} {'tok/step':>8} "
             f"{'same text':>9}"]
    for name, row in report["results"].items():
        d = row["drafting"]
        accepted = f"{100 * d['acceptance_rate']:.0f}%" if d else "-"
        per_step = f"{d['tokens_per_step']:.2f}" if d else "-"
        lines.append(f"  {name:<8} {row['decode_tps']:>7.2f} {row['ratio_vs_plain']:>7.2f}x "
                     f"{accepted:>9} {per_step:>8} {'yes' if row['same_text'] else 'NO':>9}")
    for name, met in report["targets"].items():
        lines.append(f"  target {name}: {'met' if met else 'MISSED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serve_drafts",
        description="Decode tokens/s of one stream through `shoal serve` with a draft model "
        "(--draft-model) against the same server without one, and whether the text is the "
        "same. Builds the demo model and drafts into the cache on first use.")
    parser.add_argument("--model", choices=["demo", "deep", "quick"], default="demo",
                        help="demo: the demo MoE with the 4-bit demo draft and a random one "
                        "(default); deep: benchmarks/mtp_speedup.py's 24-MoE-layer synthetic "
                        "with its right draft model and --draft mtp (right and random "
                        "module); quick: the tiny checkpoint, which checks the harness")
    parser.add_argument("--tokens", type=int, default=64, metavar="N",
                        help="greedy tokens per run (default 64)")
    parser.add_argument("--runs", type=int, default=3, metavar="R",
                        help="runs per configuration; the median is kept (default 3)")
    parser.add_argument("--num-draft-tokens", type=int, default=3, metavar="N",
                        help="most drafted tokens per step (default 3)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.runs < 1:
        parser.error("--tokens must be at least 2 and --runs at least 1")
    try:
        report = run(shape=args.model, tokens=args.tokens, runs=args.runs,
                     max_draft=args.num_draft_tokens)
    except ShoalError as e:
        print(f"bench serve drafts: error: {e}", file=sys.stderr)
        sys.exit(2)
    write_record(what="serve-drafts" + ("" if args.model == "demo" else f"-{args.model}"),
                 figures=report["results"], **report)
    print(json.dumps(report, indent=1) if args.json else table(report))


if __name__ == "__main__":
    main()
