"""Long prompts through `shoal serve` on two local workers: time to first token cold, from the
prompt cache in memory and from its files after a restart, and the gaps between four running
streams' tokens while a long prompt is prefilled, against its time alone (`--help`)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time

from benchmarks.checkpoints import FAMILY, FULL, QUICK, WORKERS, bench_files
from benchmarks.measure import bench_prompt
from benchmarks.records import machine, write_record
from coordinator.ops.local_processes import start_server, start_workers, stop_workers
from coordinator.server.prefill_pacing import BUDGET_STEPS
from engine.errors import ShoalError
from engine.manifest import read_manifest

STREAMS = 4
FAMILIES = (FAMILY, "qwen3_moe")


def log(message: str) -> None:
    print(f"bench long prompts: {message}", file=sys.stderr, flush=True)


def first_token(client, prompt: list[int], tokens: int = 2) -> dict:
    """Seconds to the first streamed token of a greedy completion, and its cache usage."""
    started = time.perf_counter()
    ttft, usage = None, None
    for chunk in client.completions.create(model="bench", prompt=prompt, max_tokens=tokens,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices and ttft is None:
            ttft = time.perf_counter() - started
        usage = chunk.usage or usage
    details = usage.prompt_tokens_details
    return {"ttft_s": ttft, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": details.cached_tokens,
            "cache_tier": (details.model_extra or {}).get("cache_tier")}


def percentiles(gaps: list[float]) -> dict:
    if not gaps:
        return {"count": 0}
    ordered = sorted(gaps)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return {"count": len(gaps), "p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99),
            "max_ms": ordered[-1] * 1000}


def gaps_during_prefill(client, long_prompt: list[int], vocab: int, ends: set[int]) -> dict:
    """Four streams decode (their end tokens barred, so none stops early); a long prompt
    arrives: their gaps before it and until its first token."""
    times: list[list[float]] = [[] for _ in range(STREAMS)]
    stop = threading.Event()
    failed: list[Exception] = []

    def stream(i: int) -> None:
        try:
            with client.completions.create(
                    model="bench", prompt=bench_prompt(vocab, 16 + i)[i:],
                    max_tokens=len(long_prompt), temperature=0, stream=True, logprobs=0,
                    logit_bias={str(t): -100 for t in ends}) as chunks:
                for _ in chunks:
                    times[i].append(time.perf_counter())
                    if stop.is_set():
                        break
        except Exception as e:  # noqa: BLE001 (reported below)
            failed.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    try:
        deadline = time.perf_counter() + 120
        while min(map(len, times)) < 50 and time.perf_counter() < deadline and not failed:
            time.sleep(0.05)
        if failed:
            raise ShoalError(f"a stream failed: {failed[0]}")
        arrival = time.perf_counter()
        arriving = first_token(client, long_prompt)
        end = arrival + arriving["ttft_s"]
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    before, during = [], []
    for stamps in times:
        for a, b in zip(stamps, stamps[1:], strict=False):
            (before if b < arrival else during if b <= end else []).append(b - a)
    return {"arriving": arriving, "before": percentiles(before), "during": percentiles(during)}


def run(*, quick: bool, tokens: int | None, prefill_step: int, budget: float,
        family: str = FAMILY) -> dict:
    import openai

    settings = dict(QUICK if quick else FULL, family=family)
    tokens = tokens or (4096 if quick else 8192)
    from mlx_lm.utils import load_tokenizer

    source, sharded, secret_file, log_dir = bench_files(quick, settings=settings)
    ends = set(load_tokenizer(source).eos_token_ids)
    vocab = int(read_manifest(sharded).config["vocab_size"])
    cache_dir = log_dir / "prompt-cache"
    shutil.rmtree(cache_dir, ignore_errors=True)
    options = ("--model-id", "bench", "--context", str(2 * tokens + 64), "--prefill-step",
               str(prefill_step), "--prefill-budget", str(budget), "--prompt-cache-dir",
               str(cache_dir))
    document = bench_prompt(vocab, tokens)
    questions = [bench_prompt(vocab, 8 + k)[-8:] for k in (1, 2, 3)]  # three new endings
    workers = start_workers([[sharded / f"worker-{k}"] for k in range(WORKERS)], secret_file,
                            log_dir)
    servers = []
    rows = {}

    def serve(name: str):
        log(f"starting shoal serve ({name}) over {WORKERS} local workers ...")
        servers.append(start_server(sharded, [w.address for w in workers], secret_file,
                                    log_dir / f"serve-{name}.log", options))
        return openai.OpenAI(base_url=servers[-1].url + "/v1", api_key="none",
                             max_retries=0, timeout=1200)

    try:
        client = serve("first")
        first_token(client, bench_prompt(vocab, 9)[1:])  # warm-up: no prefix of the rest
        log(f"a {tokens}-token prompt, cold ...")
        rows["cold"] = first_token(client, document + questions[0])
        log("the same prompt and a new question: from memory ...")
        rows["warm_memory"] = first_token(client, document + questions[1])
        servers.pop().stop()
        client = serve("restarted")
        log("after a restart: from disk ...")
        rows["warm_disk"] = first_token(client, document + questions[2])
        log(f"{STREAMS} streams decoding while another {tokens}-token prompt arrives ...")
        load = os.getloadavg()[0]
        gaps = gaps_during_prefill(client, bench_prompt(vocab, tokens + 1)[1:], vocab,
                                   ends)
        log(f"a third {tokens}-token prompt alone ...")  # no prefix shared with the others
        gaps["alone"] = first_token(client, bench_prompt(vocab, tokens + 2)[2:])
        gaps["load_average"] = [load, os.getloadavg()[0]]
    finally:
        for server in servers:
            server.stop()
        stop_workers(workers)
    return {"machine": machine(),
            "checkpoint": {"family": family, "size": settings["size"],
                           "bits": settings["bits"], "workers": WORKERS},
            "prompt_tokens": tokens, "prefill_step": prefill_step, "prefill_budget": budget,
            "first_token": rows,
            "streams": STREAMS, "gaps": gaps}


def table(report: dict) -> str:
    lines = [f"shoal serve, {report['checkpoint']['size']} checkpoint, "
             f"{report['checkpoint']['workers']} local workers, a {report['prompt_tokens']}-"
             f"token prompt, --prefill-step {report['prefill_step']} --prefill-budget "
             f"{report['prefill_budget']:g}",
             f"{'first token':>12} {'seconds':>8} {'cached tokens':>14} {'tier':>7}"]
    for name, row in report["first_token"].items():
        lines.append(f"{name:>12} {row['ttft_s']:>8.2f} {row['cached_tokens']:>14} "
                     f"{row['cache_tier'] or '-':>7}")
    g = report["gaps"]
    lines.append(f"{report['streams']} streams' gaps between tokens (ms), before and while "
                 f"the prompt is prefilled ({g['arriving']['ttft_s']:.2f} s to its first token)")
    lines.append(f"{'':>12} {'count':>6} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>7}")
    for name in ("before", "during"):
        p = g[name]
        if p["count"]:
            lines.append(f"{name:>12} {p['count']:>6} {p['p50_ms']:>7.1f} {p['p90_ms']:>7.1f} "
                         f"{p['p99_ms']:>7.1f} {p['max_ms']:>7.1f}")
    ratio = g["during"].get("max_ms", 0) / max(g["before"].get("p50_ms", 0), 1e-9)
    lines.append(f"longest gap while prefilling / median gap before: {ratio:.1f}x")
    alone = g["alone"]["ttft_s"]
    lines.append(f"its first token beside the streams {g['arriving']['ttft_s']:.2f} s, alone "
                 f"{alone:.2f} s: {g['arriving']['ttft_s'] / alone:.2f}x (load average "
                 f"{g['load_average'][0]:.1f} before, {g['load_average'][1]:.1f} after)")
    return "\n".join(lines)


def interleave_figures(report: dict) -> tuple[dict, dict]:
    """A report's figures and ratios as a record holds them (docs/benchmarks.md's rows)."""
    g = report["gaps"]
    figures = {"ttft_alone_s": g["alone"]["ttft_s"], "ttft_beside_streams_s":
               g["arriving"]["ttft_s"], "gap_median_before_ms": g["before"]["p50_ms"],
               "gap_median_during_ms": g["during"]["p50_ms"],
               "gap_longest_during_ms": g["during"]["max_ms"],
               "cold_ttft_s": report["first_token"]["cold"]["ttft_s"],
               "load_average": g["load_average"]}
    ratios = {"longest_gap_vs_median_before":
              figures["gap_longest_during_ms"] / figures["gap_median_before_ms"],
              "ttft_beside_streams_vs_alone":
              figures["ttft_beside_streams_s"] / figures["ttft_alone_s"]}
    return figures, ratios


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.long_prompts",
        description="Time to first token of a long prompt through `shoal serve` cold, from "
        "the prompt cache in memory and from its files after a restart; and the gaps between "
        "running streams' tokens while a long prompt is prefilled.")
    parser.add_argument("--quick", action="store_true",
                        help="the tiny checkpoint: checks the harness, not the speed")
    parser.add_argument("--tokens", type=int, metavar="N",
                        help="the long prompt's tokens (default 8192; 4096 with --quick)")
    parser.add_argument("--prefill-step", type=int, default=256, metavar="N",
                        help="shoal serve's --prefill-step (default 256)")
    parser.add_argument("--prefill-budget", type=float, default=BUDGET_STEPS, metavar="STEPS",
                        help=f"shoal serve's --prefill-budget (default {BUDGET_STEPS:g})")
    parser.add_argument("--family", choices=FAMILIES, default=FAMILY,
                        help=f"the checkpoint's architecture (default {FAMILY}, the bench's: "
                        "multi-head latent attention; qwen3_moe: grouped-query attention)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.tokens is not None and args.tokens < 512:
        parser.error("--tokens must be at least 512")
    if args.prefill_step < 1:
        parser.error("--prefill-step must be at least 1")
    if not args.prefill_budget > 0:
        parser.error("--prefill-budget must be above 0")
    try:
        report = run(quick=args.quick, tokens=args.tokens, prefill_step=args.prefill_step,
                     budget=args.prefill_budget, family=args.family)
    except ShoalError as e:
        print(f"bench long prompts: error: {e}", file=sys.stderr)
        sys.exit(2)
    figures, ratios = interleave_figures(report)
    budget = "" if args.prefill_budget == BUDGET_STEPS else f"-budget{args.prefill_budget:g}"
    family = "" if args.family == FAMILY else f"-{args.family}"
    write_record(what="long-prompts" + ("-quick" if args.quick else "") + family + budget,
                 figures=figures, ratios=ratios, report=report)
    print(json.dumps(report, indent=1) if args.json else table(report))


if __name__ == "__main__":
    main()
