"""mlx-lm's own distributed generation as a baseline for `shoal bench`: run under `mlx.launch
-n 2 --backend ring`, every rank loads its part with `sharded_load` (tensor or pipeline
parallel) and runs the same generation; rank 0 writes the figures as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import sharded_load

from benchmarks.measure import decode_and_prefill


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--mode", choices=["tensor", "pipeline"], required=True)
    parser.add_argument("--prompt-lengths", default="16,128,512")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--long-runs", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    group = mx.distributed.init()
    if args.mode == "tensor":
        model, tokenizer = sharded_load(str(args.model), tensor_group=group)
    else:
        model, tokenizer = sharded_load(str(args.model), pipeline_group=group)
    figures = decode_and_prefill(
        model, tokenizer, model.args.vocab_size,
        lengths=[int(n) for n in args.prompt_lengths.split(",")],
        decode_tokens=args.decode_tokens, runs=args.runs, long_runs=args.long_runs,
        # generate_step keeps one step in flight when the loop stops; without a barrier a rank
        # can leave for the next generation (or exit) while its peer still waits on that step.
        after_each=lambda: mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu)),
    )
    if group.rank() == 0:
        args.out.write_text(json.dumps({"mode": args.mode, "ranks": group.size(), **figures}))


if __name__ == "__main__":
    main()
