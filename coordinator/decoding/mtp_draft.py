"""`--draft mtp`: the model's own multi-token-prediction module (engine/mtp.py) proposes tokens
from the main model's last hidden states, its experts reached through the same dispatch, and
the main model verifies them in one forward by speculative.py's rule and depth."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, make_prompt_cache

from coordinator.decoding.draft_policy import (
    Acceptance,
    DraftPolicy,
    SpeculativeStats,
    draft_count,
    next_draft,
    observe,
)
from engine.errors import InvalidInput
from engine.mtp import LAYER_MODEL_TYPES, MTP, MtpModule, trunk

CHUNK = 512  # rows per forward while reading a prompt, for the model and for the module
# Rows the module may lag by (drafting stopped, a long prompt); beyond, it starts afresh on the
# last ones: its attention is rotary, so only distances between its rows matter.
MAX_LAG = 4096


@dataclass
class MtpDraft:
    """The model's MTP module as the draft, and the policy that paces it."""

    policy: DraftPolicy
    kind: str = "mtp"

    def tokens(self, prompt: mx.array, model: nn.Module, *, max_tokens: int,
               sampler: Callable[[mx.array], mx.array], stats: SpeculativeStats,
               cache: list | None = None, context: list[int] | None = None,
               ) -> Generator[tuple[int, mx.array, bool], None, None]:
        """`context`, the tokens in `cache`, is not needed: the module reads only `prompt`."""
        return mtp_tokens(prompt, model, self.policy, max_tokens=max_tokens, sampler=sampler,
                          stats=stats, cache=cache)


def mtp_draft(model: nn.Module, policy: DraftPolicy) -> MtpDraft:
    """The MTP draft of a loaded model, or a refusal that says why it has none."""
    if MTP not in model:
        raise InvalidInput(
            "--draft mtp needs the model's multi-token-prediction module, and this split has "
            "none: its checkpoint carries no MTP weights (mlx-lm conversions drop them: shard "
            "the original Hugging Face checkpoint), or it is not a model Shoal runs one for "
            f"({', '.join(LAYER_MODEL_TYPES)}), or it was split before Shoal kept the module "
            "(shard it again)"
        )
    return MtpDraft(policy)


def _sample(sampler: Callable[[mx.array], mx.array],
            logits: mx.array) -> tuple[mx.array, mx.array]:
    """mlx-lm's own step: log-probabilities, then the sampler (greedy: their argmax)."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sampler(logprobs), logprobs


class _Drafter:
    """The module's cache and the rows it has not read yet: (main model's hidden state at a
    position, the token after it)."""

    def __init__(self, module: MtpModule, model: nn.Module) -> None:
        self.module, self.model = module, model
        self.cache = KVCache()
        self.hidden: list[mx.array] = []  # (1, k, H) pieces
        self.next_tokens: list[int] = []
        self.forwards = 0  # each one round trip to the module's experts

    def add(self, hidden: mx.array, tokens: list[int]) -> None:
        self.hidden.append(hidden)
        self.next_tokens += tokens
        if len(self.next_tokens) > MAX_LAG:
            rows = mx.concatenate(self.hidden, axis=1)[:, -MAX_LAG:]
            self.hidden, self.next_tokens = [rows], self.next_tokens[-MAX_LAG:]
            self.cache = KVCache()

    @property
    def ready(self) -> bool:
        return bool(self.next_tokens)

    def draft(self, n: int, sampler: Callable[[mx.array], mx.array]) -> list[mx.array]:
        """Read the pending rows, then propose n tokens, each guess fed back with the module's
        own hidden state; the n - 1 rows so made are dropped at `rewind`."""
        hidden = mx.concatenate(self.hidden, axis=1)
        tokens = mx.array(self.next_tokens, mx.uint32)[None]
        self.hidden, self.next_tokens = [], []
        for start in range(0, tokens.shape[1], CHUNK):
            h, logits = self.module(self.model, hidden[:, start:start + CHUNK],
                                    tokens[:, start:start + CHUNK], self.cache)
            self.forwards += 1
        drafts = []
        for i in range(n):
            if i:
                h, logits = self.module(self.model, h[:, -1:], drafts[-1][None], self.cache)
                self.forwards += 1
            drafts.append(_sample(sampler, logits[:, -1, :])[0])
            mx.async_eval(drafts[-1])
        return drafts

    def rewind(self, n: int) -> None:
        if n > 1:
            self.cache.trim(n - 1)


def mtp_tokens(
    prompt: mx.array,
    model: nn.Module,
    policy: DraftPolicy,
    *,
    max_tokens: int,
    sampler: Callable[[mx.array], mx.array],
    stats: SpeculativeStats,
    cache: list | None = None,
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """(token, logprobs, from_draft) as speculative_tokens yields them, the MTP module drafting.
    The main model first reads the prompt (its hidden states are the module's input), so the
    first token is a plain step; then each step drafts up to N, verifies them and the token
    before them in one forward, and keeps what the main model's own samples agree with.

    `cache`, the main model's, may hold tokens before `prompt` (a conversation's earlier
    turns; the module then reads only `prompt`). However the consumer stops, it is left holding
    the prompt and every token handed on but the last, as mlx-lm's generate_step leaves it."""
    cache = make_prompt_cache(model) if cache is None else cache
    if not can_trim_prompt_cache(cache):
        raise InvalidInput("speculative decoding needs models whose KV cache can be trimmed; "
                           "this model's cache cannot")
    drafter = _Drafter(model[MTP], model)
    ids = [int(t) for t in prompt.tolist()]
    with mx.stream(generation_stream):
        for start in range(0, len(ids) - 1, CHUNK):  # as mlx-lm: all but the last token
            piece = ids[start:min(start + CHUNK, len(ids) - 1)]
            hidden, _ = trunk(model, mx.array(piece, mx.uint32)[None], cache)
            mx.eval(hidden, [c.state for c in cache])
            drafter.add(hidden, ids[start + 1:start + 1 + len(piece)])
    feed = mx.array(ids[-1:], mx.uint32)
    state, counted, made = Acceptance(), None, 0
    while made < max_tokens:
        n = next_draft(policy, state) if drafter.ready else 0
        n = min(n, max_tokens - made - 1)
        if draft_count(policy, state) != counted:  # timing steps are not changes
            counted = draft_count(policy, state)
            stats.changes.append((made, counted))
        started = time.perf_counter()
        with mx.stream(generation_stream):
            drafts = drafter.draft(n, sampler) if n else []
            hidden, logits = trunk(model, mx.concatenate([feed, *drafts])[None], cache)
            tokens, logprobs = _sample(sampler, logits[0])
            mx.eval(tokens, drafts, hidden)
        seconds = time.perf_counter() - started
        tokens, drafted = tokens.tolist(), [int(d.item()) for d in drafts]
        accepted = 0
        while accepted < n and tokens[accepted] == drafted[accepted]:
            accepted += 1
        with mx.stream(generation_stream):
            for c in cache:
                c.trim(n - accepted)
            drafter.rewind(n)
            drafter.add(hidden[:, :accepted + 1], drafted[:accepted] + [tokens[accepted]])
        feed = mx.array(tokens[accepted:accepted + 1], mx.uint32)
        # Counted before the tokens are handed on: the consumer may stop at any token.
        stats.proposed += n
        stats.draft_forwards = drafter.forwards
        stats.accepted += accepted
        if n:
            stats.verify_steps += 1
        else:
            stats.plain_steps += 1
        state = observe(policy, state, n, accepted, None if state.steps == 0 else seconds)
        given = 0
        try:
            for i in range(accepted + 1):
                made += 1
                given += 1
                yield tokens[i], logprobs[i], i < accepted
        finally:
            if given <= accepted:  # stopped inside the accepted guesses: drop those after
                for c in cache:
                    c.trim(accepted + 1 - given)
