"""Aggregate decode tokens/s of 1, 2, 4 and 8 concurrent streams through `shoal serve` on two
local workers, and whether each stream's greedy output is the one it gets alone:
`python -m benchmarks.serve [--quick] [--json] [--tokens N] [--streams 1,2,4,8]`."""
# Each prompt is first sent alone (its text and log-probabilities the reference, its speed the
# one-stream figure); then for each concurrency C the first C prompts at once. The aggregate is
# the tokens all streams received while every one was decoding, over that window.

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

from benchmarks.checkpoints import FULL, QUICK, WORKERS, bench_files
from benchmarks.measure import bench_prompt
from benchmarks.records import machine, write_record
from coordinator.ops.local_processes import start_server, start_workers, stop_workers
from engine.errors import ShoalError
from engine.manifest import read_manifest

STREAMS = (1, 2, 4, 8)
PROMPT_TOKENS = 16


def log(message: str) -> None:
    print(f"bench serve: {message}", file=sys.stderr, flush=True)


def stream_once(client, prompt: list[int], tokens: int) -> dict:
    """One greedy streamed completion: its text, per-token log-probabilities and times."""
    started = time.perf_counter()
    times, text, scores = [], "", []
    for chunk in client.completions.create(model="bench", prompt=prompt, max_tokens=tokens,
                                           temperature=0, stream=True, logprobs=0):
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs and choice.logprobs.token_logprobs:
            now = time.perf_counter()
            times += [now] * len(choice.logprobs.token_logprobs)
            scores += choice.logprobs.token_logprobs
    return {"started": started, "times": times, "text": text, "logprobs": scores}


def concurrent(client, prompts: list[list[int]], tokens: int) -> list[dict]:
    results: list[dict | Exception] = [ShoalError("did not finish")] * len(prompts)

    def run(i: int) -> None:
        try:
            results[i] = stream_once(client, prompts[i], tokens)
        except Exception as e:  # noqa: BLE001 (reported below)
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for r in results:
        if isinstance(r, Exception):
            raise ShoalError(f"a stream failed: {r}")
    return results


def decode_tps(result: dict) -> float:
    times = result["times"]
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def aggregate_tps(results: list[dict]) -> float:
    """Tokens received by all streams while all of them were decoding, per second."""
    start = max(r["times"][0] for r in results)
    end = min(r["times"][-1] for r in results)
    if end <= start:
        return 0.0
    count = sum(sum(1 for t in r["times"] if start < t <= end) for r in results)
    return count / (end - start)


def run(*, quick: bool, tokens: int | None, streams: tuple[int, ...]) -> dict:
    import httpx2
    import openai

    settings = QUICK if quick else FULL
    tokens = tokens or (16 if quick else 48)
    _, sharded, secret_file, log_dir = bench_files(quick)
    vocab = int(read_manifest(sharded).config["vocab_size"])
    # Distinct prompts: each stream must answer its own question.
    prompts = [bench_prompt(vocab, PROMPT_TOKENS + 3 * i)[i:] for i in range(max(streams))]
    workers = start_workers([[sharded / f"worker-{k}"] for k in range(WORKERS)], secret_file,
                            log_dir)
    server = None
    try:
        log(f"starting shoal serve over {WORKERS} local workers ...")
        server = start_server(sharded, [w.address for w in workers], secret_file,
                              log_dir / "serve.log", ("--model-id", "bench"))
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                               timeout=600)
        stream_once(client, prompts[0], 4)  # warm-up
        log(f"each of {len(prompts)} prompts alone, {tokens} tokens ...")
        alone = [stream_once(client, p, tokens) for p in prompts]
        rows = []
        for count in streams:
            log(f"{count} concurrent streams ...")
            results = alone[:1] if count == 1 else concurrent(client, prompts[:count], tokens)
            same = [r["text"] == a["text"] and r["logprobs"] == a["logprobs"]
                    for r, a in zip(results, alone, strict=False)]
            rows.append({
                "streams": count,
                "aggregate_decode_tps": aggregate_tps(results) if count > 1
                else decode_tps(results[0]),
                "per_stream_decode_tps": [decode_tps(r) for r in results],
                "tokens_per_stream": [len(r["times"]) for r in results],
                "outputs_equal_alone": all(same),
            })
        batching = httpx2.get(server.url + "/health", timeout=10).json()["batching"]
    finally:
        if server is not None:
            server.stop()
        stop_workers(workers)
    one = rows[0]["aggregate_decode_tps"] if rows[0]["streams"] == 1 else None
    for row in rows:
        row["speedup_vs_one_stream"] = row["aggregate_decode_tps"] / one if one else None
    return {
        "machine": machine(),
        "checkpoint": {"family": "deepseek_v3", "size": settings["size"],
                       "bits": settings["bits"], "workers": WORKERS},
        "tokens_per_stream": tokens,
        "prompt_tokens": [len(p) for p in prompts],
        "one_stream_decode_tps_median": statistics.median(decode_tps(a) for a in alone),
        "streams": rows,
        "batching": batching,
    }


def table(report: dict) -> str:
    lines = [f"shoal serve, {report['checkpoint']['size']} checkpoint, "
             f"{report['checkpoint']['workers']} local workers, {report['tokens_per_stream']} "
             "greedy tokens per stream",
             f"{'streams':>7} {'aggregate tok/s':>16} {'x one stream':>12} "
             f"{'per-stream tok/s (median)':>26} {'output = alone':>14}"]
    for row in report["streams"]:
        speedup = row["speedup_vs_one_stream"]
        lines.append(
            f"{row['streams']:>7} {row['aggregate_decode_tps']:>16.1f} "
            f"{speedup if speedup is None else f'{speedup:.2f}':>12} "
            f"{statistics.median(row['per_stream_decode_tps']):>26.1f} "
            f"{'yes' if row['outputs_equal_alone'] else 'NO':>14}")
    b = report["batching"]
    lines.append(f"decode steps {b['decode_steps']}, rows per step "
                 f"{b['decode_rows'] / max(b['decode_steps'], 1):.2f}, widest {b['widest_step']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serve",
        description="Aggregate decode tokens/s of concurrent streams through `shoal serve` "
        "(two local workers, the `shoal bench` checkpoint), and whether each stream's greedy "
        "output equals the one it gets alone.")
    parser.add_argument("--quick", action="store_true",
                        help="the tiny checkpoint: checks the harness, not the speed")
    parser.add_argument("--tokens", type=int, metavar="N",
                        help="greedy tokens per stream (default 48; 16 with --quick)")
    parser.add_argument("--streams", default=",".join(map(str, STREAMS)), metavar="C,C,...",
                        help="concurrencies to measure, 1 first (default 1,2,4,8)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        streams = tuple(int(c) for c in args.streams.split(","))
        if not streams or streams[0] != 1 or min(streams) < 1:
            raise ValueError
    except ValueError:
        parser.error("--streams takes counts such as 1,2,4,8, starting with 1")
    if args.tokens is not None and args.tokens < 2:
        parser.error("--tokens must be at least 2")
    try:
        report = run(quick=args.quick, tokens=args.tokens, streams=streams)
    except ShoalError as e:
        print(f"bench serve: error: {e}", file=sys.stderr)
        sys.exit(2)
    write_record(what="serve" + ("-quick" if args.quick else ""), figures=report)
    print(json.dumps(report, indent=1) if args.json else table(report))


if __name__ == "__main__":
    main()
