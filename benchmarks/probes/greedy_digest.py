"""mlx-lm in one process on `shoal bench`'s checkpoint, greedy, under the environment it is
given: the tokens, a digest of every step's logits' bits, and decode tokens/s; run it under
two settings and compare the digests to see whether a setting changes any bit."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from benchmarks.checkpoints import bench_checkpoint
from benchmarks.measure import bench_prompt


def run(quick: bool, tokens: int) -> dict:
    source, _ = bench_checkpoint(quick)
    model, tokenizer = load(str(source))
    prompt = mx.array(bench_prompt(tokenizer.vocab_size, 16))[None]
    digest = hashlib.sha256()
    out: list[int] = []
    for attempt in range(2):  # the first pass warms up; the second is digested and timed
        cache = make_prompt_cache(model)
        logits = model(prompt, cache=cache)[:, -1, :]
        started = time.perf_counter()
        for _ in range(tokens):
            token = mx.argmax(logits, axis=-1)
            mx.eval(token, logits)
            if attempt:
                digest.update(np.asarray(logits.astype(mx.float32)).tobytes())
                out.append(int(token.item()))
            logits = model(token[:, None], cache=cache)[:, -1, :]
        seconds = time.perf_counter() - started
    return {"device": str(mx.default_device()),
            "MLX_USE_CUDA_GRAPHS": os.environ.get("MLX_USE_CUDA_GRAPHS"),
            "tokens": out, "logits_sha256": digest.hexdigest(),
            "decode_tps": round(tokens / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny checkpoint")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    print(json.dumps(run(args.quick, args.tokens)))


if __name__ == "__main__":
    main()
