"""Timing one model the same way for Shoal and for every baseline: mlx-lm's own figures."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper


def bench_prompt(vocab_size: int, length: int) -> list[int]:
    """A fixed, tokenizer-independent prompt of `length` ids (no special tokens at 0-4)."""
    return [(7 * i + 11) % (vocab_size - 10) + 5 for i in range(length)]


def timed_generation(
    model: nn.Module, tokenizer: TokenizerWrapper, prompt: list[int], max_tokens: int
) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of one greedy generation, as mlx-lm reports them."""
    responses = stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens)
    last = deque(responses, maxlen=1)[0]
    return last.prompt_tps, last.generation_tps


def decode_and_prefill(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    vocab_size: int,
    *,
    lengths: list[int],
    decode_tokens: int,
    runs: int,
    long_runs: int | None = None,
    after_each: Callable[[], None] = lambda: None,
) -> dict:
    """Prefill and decode tokens/s per prompt length, each after one warm-up generation: the
    median of `runs` generations at the shortest prompt (whose decode speed is `decode_tps`)
    and of `long_runs` (default `runs`) at each longer one, where a generation is mostly
    prefill and takes long. `after_each` runs after every generation (distributed ranks
    synchronise there)."""
    prompt = bench_prompt(vocab_size, max(lengths))
    prefill, decode = {}, {}

    def timed(n: int, tokens: int) -> tuple[float, float]:
        figures = timed_generation(model, tokenizer, prompt[:n], tokens)
        after_each()
        return figures

    lengths = sorted(lengths)
    timed(lengths[0], 4)
    for n in lengths:
        # A first prompt of a new length pays one-time costs (the CUDA build compiles
        # kernels for new shapes), so each length is warmed up once before it is timed.
        if n != lengths[0]:
            timed(n, 2)
        count = runs if n == lengths[0] or long_runs is None else long_runs
        samples = [timed(n, decode_tokens) for _ in range(max(1, count))]
        prefill[str(n)] = statistics.median(p for p, _ in samples)
        decode[str(n)] = statistics.median(d for _, d in samples)
    return {"decode_tps": decode[str(lengths[0])], "decode_tps_by_prompt": decode,
            "prefill_tps": prefill}


@dataclass(frozen=True)
class Greedy:
    """One greedy generation: its ids, the seconds from the first token to the last (decode
    alone) and mlx-lm's own decode figure."""

    tokens: list[int]
    decode_seconds: float
    generation_tps: float

    @property
    def decode_tps(self) -> float:
        return (len(self.tokens) - 1) / self.decode_seconds if self.decode_seconds else 0.0


def greedy_generation(model: nn.Module, tokenizer: TokenizerWrapper, ids: list[int], tokens: int,
                      after_first: Callable[[], None] = lambda: None) -> Greedy:
    """A timed greedy generation with mlx-lm's `stream_generate`: `after_first` runs once the
    first token is out (the prompt's pass done: reset or read counters there), then the clock
    starts, so `decode_seconds` covers decode steps only."""
    out: list[int] = []
    started, last = time.perf_counter(), None
    for last in stream_generate(model, tokenizer, mx.array(ids), max_tokens=tokens,
                                sampler=make_sampler(temp=0.0)):
        out.append(int(last.token))
        if len(out) == 1:
            after_first()
            started = time.perf_counter()
    if last is None:
        raise ValueError("the generation produced no token")
    return Greedy(out, time.perf_counter() - started, last.generation_tps)
