"""Speculative decoding for a sharded model: a draft proposes tokens, the target checks them all
in one forward (one request per worker per MoE layer), the number proposed follows how often
the target agrees; the rule and figures are docs/speculative.md's."""
# The verification is mlx-lm's own `speculative_generate_step`, run in segments of constant N:
# when the acceptance estimate asks for another N, the segment is closed at the end of a
# verification step (its `finally` rewinds the caches as its loop would) and the next starts
# on the same caches. N = 0 is plain decoding through the same step; while it lasts the draft
# sees nothing, and it catches up from the token history when drafting resumes.

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse, generation_stream, speculative_generate_step
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load

from coordinator.decoding.draft_policy import (
    Acceptance,
    DraftPolicy,
    SpeculativeStats,
    draft_count,
    next_draft,
    observe,
)
from coordinator.decoding.mtp_draft import MtpDraft
from engine.errors import InvalidInput, NotFound

CONTEXT_WINDOW = 4096  # the most tokens of a continued cache's context the draft reads first


@dataclass
class Draft:
    """A draft model loaded on the coordinator, and the policy that paces it."""

    model: nn.Module
    policy: DraftPolicy
    path: Path | None = None
    kind: str = "model"

    def tokens(self, prompt: mx.array, model: nn.Module, *, max_tokens: int,
               sampler: Callable[[mx.array], mx.array], stats: SpeculativeStats,
               cache: list | None = None, context: list[int] | None = None,
               ) -> Generator[tuple[int, mx.array, bool], None, None]:
        """`cache`, the target's, may hold `context` (the tokens before `prompt`), which the
        draft reads first: without them it cannot continue a cache."""
        if cache is not None and context is None:
            raise InvalidInput("a draft model starts from an empty KV cache; the MTP module "
                               "(--draft mtp) can continue one")
        return speculative_tokens(prompt, model, self, max_tokens=max_tokens, sampler=sampler,
                                  stats=stats, cache=cache, context=context)


def load_draft(path: Path, tokenizer: TokenizerWrapper, policy: DraftPolicy) -> Draft:
    """Load an mlx-lm model as the draft, refusing one whose tokenizer differs from the
    target's (the verification compares token ids)."""
    path = Path(path)
    if not path.is_dir():
        raise NotFound(f"draft model folder {path} does not exist")
    model, draft_tokenizer = load(str(path))
    if draft_tokenizer.vocab_size != tokenizer.vocab_size or (
        draft_tokenizer.get_vocab() != tokenizer.get_vocab()
    ):
        raise InvalidInput(
            f"the draft model {path} has another tokenizer than the target "
            f"({draft_tokenizer.vocab_size} tokens against {tokenizer.vocab_size}, or other "
            "ids); pick a draft of the same family (docs/speculative.md)"
        )
    return Draft(model, policy, path)


def speculative_tokens(
    prompt: mx.array,
    model: nn.Module,
    draft: Draft,
    *,
    max_tokens: int,
    sampler: Callable[[mx.array], mx.array],
    stats: SpeculativeStats,
    cache: list | None = None,
    context: list[int] | None = None,
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """(token, logprobs, from_draft), as mlx-lm's speculative_generate_step yields them, with
    the number of drafted tokens chosen again after every verification step. `cache`, the
    target's, holds `context` when given (serve's stream leaving its batch); however the
    consumer stops between steps, it is left holding every token but the last handed on."""
    target_cache = make_prompt_cache(model) if cache is None else cache
    draft_cache = make_prompt_cache(draft.model)
    if len(target_cache) != len(model.layers):  # mlx-lm splits the joint cache by layers
        raise InvalidInput("speculative decoding needs one KV cache per layer of the model")
    if not can_trim_prompt_cache(target_cache) or not can_trim_prompt_cache(draft_cache):
        raise InvalidInput("speculative decoding needs models whose KV cache can be trimmed; "
                           "this model's cache cannot")
    # every token either model will have seen
    history = list(context or []) + [int(t) for t in prompt.tolist()]
    draft_start = 0  # the draft's cache holds history[draft_start:]
    pending = prompt.astype(mx.uint32)  # not yet in the target's cache
    window = CONTEXT_WINDOW  # the first catch-up reads the context, as a prompt is read
    state = Acceptance()
    counted = None
    made = 0
    while made < max_tokens:
        n = next_draft(draft.policy, state)
        if draft_count(draft.policy, state) != counted:  # timing steps are not changes
            counted = draft_count(draft.policy, state)
            stats.changes.append((made, counted))
        if n > 0:
            draft_cache, draft_start = catch_up(
                draft.model, draft_cache, draft_start, history, target_cache[0].offset,
                window=window,
            )
            window = draft.policy.probe_every
        segment = speculative_generate_step(
            pending, model, draft.model, num_draft_tokens=n, max_tokens=max_tokens - made,
            sampler=sampler, prompt_cache=target_cache + draft_cache,
        )
        try:
            while made < max_tokens:
                # Counted before the tokens are handed on: the consumer may stop at any token.
                proposed = min(n, max_tokens - made)
                stats.proposed += proposed
                if proposed:
                    stats.verify_steps += 1
                else:
                    stats.plain_steps += 1
                accepted = 0
                seconds = 0.0  # in the step itself, not in the consumer
                while True:
                    started = time.perf_counter()
                    token, logprobs, from_draft = next(segment)
                    seconds += time.perf_counter() - started
                    made += 1
                    history.append(int(token))
                    accepted += from_draft
                    stats.accepted += from_draft
                    yield int(token), logprobs, from_draft
                    if not from_draft or made == max_tokens:
                        break
                first = state.steps == 0  # its time includes reading the prompt
                state = observe(draft.policy, state, proposed, accepted,
                                None if first else seconds)
                if next_draft(draft.policy, state) != n:
                    break
        finally:
            segment.close()  # rewinds both caches to the end of the last step
        pending = mx.array(history[-1:], mx.uint32)


def catch_up(
    draft_model: nn.Module,
    draft_cache: list,
    start: int,
    history: list[int],
    want: int,
    *,
    window: int,
    step: int = 512,
) -> tuple[list, int]:
    """Feed the draft the tokens the target's cache holds (`history[:want]`) and its own does
    not: the last drafted token of a step that accepted all, or those generated while drafting
    was stopped. The draft holds `history[start:]`. When it lags by more than `window` tokens it
    starts afresh on the last `window` only: reading them all could cost more than a probe can
    win (a draft sees less context then; the output, verified by the target, is the same)."""
    have = start + draft_cache[0].offset
    if want - have > window:
        draft_cache, start = make_prompt_cache(draft_model), want - window
        have = start
    with mx.stream(generation_stream):
        while have < want:
            chunk = history[have:min(want, have + step)]
            draft_model(mx.array(chunk, mx.uint32)[None], cache=draft_cache)
            mx.eval([c.state for c in draft_cache])
            have += len(chunk)
    return draft_cache, start


def stream_speculative(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt: mx.array,
    draft: Draft | MtpDraft,
    *,
    max_tokens: int,
    sampler: Callable[[mx.array], mx.array],
    stats: SpeculativeStats,
    prompt_cache: list | None = None,
) -> Iterator[GenerationResponse]:
    """mlx-lm's stream_generate over the draft's tokens (speculative_tokens for a draft model,
    mtp_draft.py's for the MTP module, which can continue a `prompt_cache`): the
    same responses, text, stop on EOS and timing (mlx-lm's own stream_generate fixes N for
    the whole generation)."""
    detokenizer = tokenizer.detokenizer
    stats.draft = draft.kind
    tokens = draft.tokens(prompt, model, max_tokens=max_tokens, sampler=sampler, stats=stats,
                          cache=prompt_cache)
    tic = time.perf_counter()
    prompt_tps = 0.0
    try:
        for n, (token, logprobs, from_draft) in enumerate(tokens):
            if n == 0:
                prompt_tps = prompt.size / (time.perf_counter() - tic)
                tic = time.perf_counter()
            finished = token in tokenizer.eos_token_ids or n + 1 == max_tokens
            if token not in tokenizer.eos_token_ids:
                detokenizer.add_token(token)
            if finished:
                detokenizer.finalize()
            yield GenerationResponse(
                text=detokenizer.last_segment,
                token=token,
                logprobs=logprobs,
                from_draft=from_draft,
                prompt_tokens=prompt.size,
                prompt_tps=prompt_tps,
                generation_tokens=n + 1,
                generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=None if not finished else (
                    "stop" if token in tokenizer.eos_token_ids else "length"),
            )
            if finished:
                return
    finally:
        tokens.close()
