"""Is a row computed in a batch bit-identical to the same row alone, on this machine's MLX? At
three levels: operations, mlx-lm's BatchGenerator in one process, and Shoal (two local workers)
under it, each against mlx-lm (docs/serving.md)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.utils import load_model

from benchmarks.checkpoints import FULL, QUICK, WORKERS, bench_files
from benchmarks.records import machine
from coordinator.decoding.generate import open_remote_model
from coordinator.ops.local_processes import start_workers, stop_workers
from engine.auth import load_secret
from engine.manifest import read_manifest

BATCHES = (2, 4, 7, 8, 16, 32)
PROMPT_LENGTHS = (16, 9, 23, 4, 16, 12, 5, 30)


def log(message: str) -> None:
    print(f"bench batch-invariance: {message}", file=sys.stderr, flush=True)


def largest_difference(a: mx.array, b: mx.array) -> float:
    """The largest |a - b|; 0 where both hold the same value, NaN and infinities included
    (a tiny checkpoint's long prompts can overflow), NaN where only one is NaN."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    same = (a == b) | (mx.isnan(a) & mx.isnan(b))
    return float(mx.max(mx.where(same, 0.0, mx.abs(a - b))).item())


def row_zero(f: Callable[[mx.array], mx.array], rows: mx.array) -> dict[int, float]:
    """B -> max |row 0 of f(first B rows) - f(row 0 alone)|."""
    alone = f(rows[:1])
    return {b: largest_difference(f(rows[:b])[:1], alone) for b in BATCHES}


def operations(width: int = 1024, hidden: int = 512, experts: int = 64, k: int = 8) -> dict:
    mx.random.seed(0)
    rows = mx.random.normal((max(BATCHES), width))
    out = {}
    for bits, name in ((4, "linear_4bit"), (None, "linear_float32")):
        for outputs in (512, 2048):
            layer = nn.Linear(width, outputs, bias=False)
            if bits:
                layer = nn.QuantizedLinear.from_linear(layer, group_size=64, bits=bits)
            out[f"{name}_{width}x{outputs}"] = row_zero(layer, rows)
    switch = SwitchGLU(width, hidden, experts)
    nn.quantize(switch, group_size=64, bits=4)
    chosen = mx.stack([mx.random.permutation(experts)[:k] for _ in range(len(rows))])
    chosen = chosen.astype(mx.int32)
    out["switch_glu_4bit (sorts from 64 pairs)"] = row_zero(
        lambda x: switch(x, chosen[: len(x)]), rows)
    heads, dim = 8, 64
    for keys in (5, 37, 300):
        q, kk, v = (mx.random.normal((1, heads, n, dim)) for n in (1, keys, keys))
        alone = mx.fast.scaled_dot_product_attention(q, kk, v, scale=dim ** -0.5)
        padded = {}
        for pad in (1, 3, 8):
            zeros = mx.zeros((1, heads, pad, dim))
            other = (1, heads, pad + keys, dim)  # a second sequence in the batch
            kb = mx.concatenate([mx.concatenate([zeros, kk], 2), mx.random.normal(other)])
            vb = mx.concatenate([mx.concatenate([zeros, v], 2), mx.random.normal(other)])
            qb = mx.concatenate([q, mx.random.normal(q.shape)])
            mask = mx.concatenate([mx.zeros((pad,), mx.bool_), mx.ones((keys,), mx.bool_)])
            y = mx.fast.scaled_dot_product_attention(
                qb, kb, vb, scale=dim ** -0.5, mask=mx.broadcast_to(mask, (2, 1, 1, pad + keys)))
            padded[pad] = largest_difference(y[:1], alone)
        out[f"attention_{keys}_keys_left_padded"] = padded
    return out


def generate(model: nn.Module, prompts: list[list[int]], tokens: int):
    """Greedy tokens and per-step log-probabilities of `prompts` decoded together."""
    generator = BatchGenerator(model, completion_batch_size=len(prompts),
                               prefill_batch_size=len(prompts))
    uids = generator.insert(prompts, max_tokens=[tokens] * len(prompts))
    ids = {u: [] for u in uids}
    logprobs = {u: [] for u in uids}
    for _ in range(4 * tokens + 16):  # bounded: one step per call, a few prompt steps
        _, responses = generator.next()
        for r in responses:
            ids[r.uid].append(r.token)
            logprobs[r.uid].append(r.logprobs)
        if all(len(t) >= tokens for t in ids.values()):
            break
    generator.close()
    return [(ids[u], mx.stack(logprobs[u])) for u in uids]


def compare(runs, reference) -> dict:
    return {"same_ids": sum(a[0] == b[0] for a, b in zip(runs, reference, strict=True)),
            "same_logprobs_bitwise": sum(bool(mx.array_equal(a[1], b[1]).item())
                                         for a, b in zip(runs, reference, strict=True)),
            "of": len(runs)}


def models(quick: bool, tokens: int) -> dict:
    settings = QUICK if quick else FULL
    source, sharded, secret, logs = bench_files(quick)
    vocab = read_manifest(sharded).config["vocab_size"]  # ids past it read outside the table
    prompts = [[(7 * i + 3 * j) % (vocab - 10) + 10 for j in range(n)]
               for i, n in enumerate(PROMPT_LENGTHS)]
    single, _ = load_model(source)
    log("mlx-lm in one process: each prompt alone, then all together")
    alone = [generate(single, [p], tokens)[0] for p in prompts]
    together = generate(single, prompts, tokens)
    workers = start_workers([[sharded / f"worker-{k}"] for k in range(WORKERS)], secret, logs)
    try:
        remote = open_remote_model(sharded, [w.address for w in workers], load_secret(secret))
        log(f"Shoal with {WORKERS} local workers: alone, then together")
        shoal_alone = [generate(remote.model, [p], tokens)[0] for p in prompts]
        shoal_together = generate(remote.model, prompts, tokens)
        remote.close()
    finally:
        stop_workers(workers)
    return {
        "prompts": len(prompts), "tokens": tokens, "size": settings["size"],
        "mlx_lm_together_vs_alone": compare(together, alone),
        "shoal_alone_vs_mlx_lm_alone": compare(shoal_alone, alone),
        "shoal_together_vs_mlx_lm_together": compare(shoal_together, together),
        "shoal_together_vs_shoal_alone": compare(shoal_together, shoal_alone),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.probes.batch_invariance",
        description="Whether a row in a batch is bit-identical to the same row alone, for "
                    "MLX's operations, mlx-lm's BatchGenerator, and Shoal")
    parser.add_argument("--quick", action="store_true", help="the tiny checkpoint")
    parser.add_argument("--tokens", type=int, default=16, metavar="T",
                        help="greedy tokens per prompt (default 16)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = {"machine": machine(), "device": str(mx.default_device()), "mlx": mx.__version__,
              "operations": operations(), "models": models(args.quick, args.tokens)}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for name, by_batch in report["operations"].items():
        print(f"{name}: " + ", ".join(f"B={b} {d:.2g}" for b, d in by_batch.items()))
    for name, result in report["models"].items():
        if isinstance(result, dict):
            print(f"{name}: ids {result['same_ids']}/{result['of']}, "
                  f"logprobs {result['same_logprobs_bitwise']}/{result['of']} bit-identical")


if __name__ == "__main__":
    main()
