"""What any design that leaves the device at every MoE layer can reach: mlx-lm in one process,
plain, synced at every switch module, and synced through host memory (what a network hop
needs); no workers, no network (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.generate import stream_generate
from mlx_lm.models import switch_layers
from mlx_lm.utils import load

from benchmarks.checkpoints import FULL, QUICK, bench_checkpoint
from benchmarks.measure import bench_prompt
from benchmarks.records import machine, write_record

MODES = ("plain", "sync", "sync_host")
SWITCHES = (switch_layers.SwitchGLU, switch_layers.SwitchMLP)


def log(message: str) -> None:
    print(f"bench sync-floor: {message}", file=sys.stderr, flush=True)


def with_mode(mode: dict[str, str]) -> None:
    """Make every switch module of mlx-lm honour `mode["now"]` (see the module docstring)."""
    for cls in SWITCHES:
        original = cls.__call__

        def call(self, x, indices, _original=original):
            if mode["now"] == "plain":
                return _original(self, x, indices)
            mx.eval(x, indices)
            if mode["now"] == "sync":
                y = _original(self, x, indices)
                mx.eval(y)
                return y
            y = _original(self, mx.array(np.array(x)), mx.array(np.array(indices)))
            return mx.array(np.array(y))

        cls.__call__ = call


def run(*, quick: bool, runs: int, tokens: int) -> dict:
    settings = QUICK if quick else FULL
    source, _ = bench_checkpoint(quick)
    model, tokenizer = load(str(source))
    prompt = bench_prompt(tokenizer.vocab_size, 16)
    mode = {"now": "plain"}
    with_mode(mode)
    results = {}
    for name in MODES:
        mode["now"] = name
        rates = []
        for _ in range(runs + 1):  # the first is a warm-up
            *_, last = stream_generate(model, tokenizer, prompt, max_tokens=tokens + 1)
            rates.append(last.generation_tps)
        results[name] = {"decode_tps": statistics.median(rates[1:]), "runs": rates[1:]}
        log(f"{name}: {results[name]['decode_tps']:.1f} tok/s")
    moe_layers = sum(isinstance(m, SWITCHES) for _, m in model.named_modules())
    for name in MODES[1:]:
        added = 1 / results[name]["decode_tps"] - 1 / results["plain"]["decode_tps"]
        results[name]["added_per_moe_layer_ms"] = 1e3 * added / max(moe_layers, 1)
    return {"machine": machine(), "device": str(mx.default_device()), "size": settings["size"],
            "moe_layers": moe_layers, "tokens": tokens, "results": results}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sync_floor",
        description="mlx-lm in one process, plain, with an evaluation at every MoE layer, "
                    "and with a host round trip there too: the floor under any "
                    "expert-sharded design on this machine")
    parser.add_argument("--quick", action="store_true",
                        help="the tiny checkpoint: checks the harness, not the speed")
    parser.add_argument("--runs", type=int, default=3, metavar="R",
                        help="timed runs per mode, after one warm-up (default 3)")
    parser.add_argument("--tokens", type=int, default=32, metavar="T",
                        help="decode tokens per run (default 32)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = run(quick=args.quick, runs=args.runs, tokens=args.tokens)
    write_record(what="sync-floor" + ("-quick" if args.quick else ""),
                 figures=report["results"], **report)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for name, r in report["results"].items():
        extra = (f", +{r['added_per_moe_layer_ms']:.2f} ms per MoE layer"
                 if "added_per_moe_layer_ms" in r else "")
        print(f"{name:>9}: {r['decode_tps']:.1f} tok/s{extra}")


if __name__ == "__main__":
    main()
