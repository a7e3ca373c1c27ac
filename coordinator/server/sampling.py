"""What one request asks of generation (Sampling) and how it becomes mlx-lm's per-request
sampler and logits processors, so a request decodes the same in any batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

from coordinator.server.grammars import Grammars


@dataclass(frozen=True)
class Sampling:
    """What one request asks of generation (already validated). The knobs are mlx-lm's
    (sample_utils.make_sampler and make_logits_processors), with mlx-lm's defaults."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int | None = None  # None: no log-probabilities; 0: the chosen token's only
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    repetition_penalty: float = 0.0  # 0: off (mlx-lm's convention)
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    grammar: str | None = None  # an llguidance grammar the answer must match
    # A text completion continues its prompt, so the first token's leading space is part of
    # the answer; a chat reply's is not (mlx-lm's detokenizers drop it).
    keep_leading_space: bool = False
    speculative: bool = True  # False: never through the draft (`shoal serve --draft`)


def make_request_sampler(sampling: Sampling) -> Callable[[mx.array], mx.array] | None:
    """The request's sampler, or None for greedy (the batch then shares one argmax). With a
    seed, the request draws from its own key, so its samples do not depend on the requests
    it happens to share a batch with; the filters are mlx-lm's, in make_sampler's order."""
    s = sampling
    if s.temperature == 0:
        return None
    if s.seed is None:
        return make_sampler(temp=s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k)
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0 < s.top_p < 1:
        filters.append(lambda x: apply_top_p(x, s.top_p))
    if s.min_p != 0:
        filters.append(lambda x: apply_min_p(x, s.min_p))
    if s.top_k > 0:
        filters.append(lambda x: apply_top_k(x, s.top_k))
    key = mx.random.key(s.seed)
    scale = 1 / s.temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, draw = mx.random.split(key)
        for f in filters:
            logprobs = f(logprobs)
        return mx.random.categorical(logprobs * scale, key=draw)

    return sample


def make_request_processors(sampling: Sampling, grammars: Grammars) -> list[Callable]:
    """The request's logits processors: mlx-lm's (bias and penalties) and then its grammar,
    so that a constraint has the last word. Empty for a request that asked for none, which
    then decodes exactly as without them."""
    s = sampling
    processors = make_logits_processors(
        dict(s.logit_bias) or None, s.repetition_penalty, s.repetition_context_size,
        s.presence_penalty, s.presence_context_size, s.frequency_penalty,
        s.frequency_context_size)
    if s.grammar is not None:
        processors.append(grammars.processor(s.grammar))
    return processors
