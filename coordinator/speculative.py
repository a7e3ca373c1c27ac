"""Speculative decoding for a sharded model: a draft proposes tokens, the target checks them all
in one forward (one request per worker per MoE layer), the number proposed follows how often
the target agrees; the rule and figures are docs/speculative.md's."""
# The verification is mlx-lm's own `speculative_generate_step`, run in segments of constant N:
# when the acceptance estimate asks for another N, the segment is closed at the end of a
# verification step (its `finally` rewinds the caches as its loop would) and the next starts
# on the same caches. N = 0 is plain decoding through the same step; while it lasts the draft
# sees nothing, and it catches up from the token history when drafting resumes.

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse, generation_stream, speculative_generate_step
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load

from engine.errors import InvalidInput, NotFound

if TYPE_CHECKING:
    from coordinator.mtp_draft import MtpDraft

DEFAULT_DRAFT_TOKENS = 3


@dataclass(frozen=True)
class DraftPolicy:
    """How many tokens to draft, from the acceptance and the step times seen so far.

    `alpha` estimates the chance that a drafted token is accepted given that the ones before
    it were, so the n-th drafted token is used with chance alpha**n. It is worth proposing when
    that exceeds what it costs, in plain decode steps: the measured extra time of a drafting
    step per drafted token (the draft's forward and one more row for the target), and never
    less than `min_gain` (the default stops drafting at an acceptance of 25% or less, as
    deltafin's drafter does on general chat). Drafting starts at one token and grows as the
    draft proves itself. While stopped, one token is drafted every `probe_every` tokens, the
    wait doubling after each failed probe, so that a draft that becomes useful is noticed and
    a useless one costs little; a probe first feeds the draft what it missed (at most the last
    `probe_every` tokens), so where drafting is dear the wait is also long enough for a probe
    to cost at most `probe_budget` of the time between probes. Every `measure_every` drafting
    steps one plain step keeps the plain step time current.
    """

    max_draft: int = DEFAULT_DRAFT_TOKENS
    min_gain: float = 0.25
    decay: float = 0.8  # per verification step: older steps count less
    probe_every: int = 32
    probe_budget: float = 0.02
    measure_every: int = 32
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.max_draft <= 64:
            raise InvalidInput(f"--num-draft-tokens must be between 1 and 64, "
                               f"got {self.max_draft}")


@dataclass(frozen=True)
class Acceptance:
    """What the policy knows: decayed counts of accepted drafted tokens and of rejections (one
    per step that did not accept all it was offered), step times, and where plain decoding
    stands while drafting is stopped."""

    accepted: float = 0.0
    rejected: float = 0.0
    plain_seconds: float | None = None  # a plain step's time (moving average)
    cost: float | None = None  # a drafting step's extra time per drafted token, in plain steps
    steps: int = 0
    since_measure: int = 0  # drafting steps since the last plain step
    plain_tokens: int = 0  # generated without drafting since drafting last stopped
    probe_wait: int = 0  # plain tokens before the next probe

    @property
    def alpha(self) -> float:
        """Accepted over offered, with one accepted and one rejected token of prior belief,
        so that one unlucky step does not stop drafting."""
        return (self.accepted + 1) / (self.accepted + self.rejected + 2)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (old + new) / 2


def observe(
    policy: DraftPolicy, state: Acceptance, proposed: int, accepted: int,
    seconds: float | None = None,
) -> Acceptance:
    """Fold one target forward into the estimate: `proposed` 0 is a plain step; `seconds`,
    its time (None for the first, which also read the prompt)."""
    state = replace(state, steps=state.steps + 1)
    if proposed == 0:
        return replace(state, plain_tokens=state.plain_tokens + 1, since_measure=0,
                       plain_seconds=state.plain_seconds if seconds is None
                       else _average(state.plain_seconds, seconds))
    was_drafting = draft_count(policy, state) > 0
    if seconds is not None and state.plain_seconds:
        extra = max(0.0, seconds - state.plain_seconds) / (proposed * state.plain_seconds)
        state = replace(state, cost=_average(state.cost, extra))
    rejected = 1.0 if accepted < proposed else 0.0
    state = replace(state, accepted=state.accepted * policy.decay + accepted,
                    rejected=state.rejected * policy.decay + rejected, plain_tokens=0,
                    since_measure=state.since_measure + 1)
    if draft_count(policy, state) == 0:  # stopped: wait before probing again
        first = was_drafting or state.probe_wait == 0
        wait = policy.probe_every if first else 2 * state.probe_wait
        # a probe reads up to probe_every + 1 tokens into the draft, each at most `cost`
        dear = math.ceil((policy.probe_every + 1) * (state.cost or 0.0) / policy.probe_budget)
        state = replace(state, probe_wait=max(wait, dear))
    return state


def draft_count(policy: DraftPolicy, state: Acceptance) -> int:
    """Tokens worth drafting for the next step: the most n with alpha**n above the cost."""
    if not policy.adaptive:
        return policy.max_draft
    alpha = state.alpha
    threshold = max(policy.min_gain, state.cost or 0.0)
    if alpha <= threshold:
        return 0
    n = math.ceil(math.log(threshold) / math.log(alpha)) - 1 if threshold < 1 else 0
    return max(0, min(policy.max_draft, n))


def next_draft(policy: DraftPolicy, state: Acceptance) -> int:
    """Tokens to draft in the next step: draft_count; or a plain step to time when the plain
    step time is unknown or old; or one token as a probe when drafting is stopped and its wait
    is over."""
    n = draft_count(policy, state)
    if not policy.adaptive:
        return n
    if n > 0 and state.steps > 0 and (
        state.plain_seconds is None or state.since_measure >= policy.measure_every
    ):
        return 0
    if n == 0 and state.plain_tokens >= state.probe_wait:
        return 1
    return n


@dataclass
class SpeculativeStats:
    """What the draft did in one generation, for --stats and --json."""

    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0  # target forwards that checked drafted tokens
    plain_steps: int = 0  # target forwards without drafted tokens (drafting stopped)
    changes: list[tuple[int, int]] = field(default_factory=list)  # (token index, new N)
    draft: str = "model"  # what drafted: "model" (a draft model) or "mtp" (the model's own)
    draft_forwards: int = 0  # the MTP module's forwards: one round trip to its experts each

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def report(self, generated: int) -> dict:
        steps = self.verify_steps + self.plain_steps
        return {
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance,
            "verify_steps": self.verify_steps,
            "plain_steps": self.plain_steps,
            "tokens_per_step": generated / steps if steps else 0.0,
            "draft": self.draft,
            "draft_forwards": self.draft_forwards,
            "draft_changes": [{"token": t, "num_draft_tokens": n} for t, n in self.changes],
        }


@dataclass
class Draft:
    """A draft model loaded on the coordinator, and the policy that paces it."""

    model: nn.Module
    policy: DraftPolicy
    path: Path | None = None
    kind: str = "model"

    def tokens(self, prompt: mx.array, model: nn.Module, *, max_tokens: int,
               sampler: Callable[[mx.array], mx.array], stats: SpeculativeStats,
               cache: list | None = None) -> Generator[tuple[int, mx.array, bool], None, None]:
        if cache is not None:
            raise InvalidInput("a draft model starts from an empty KV cache; the MTP module "
                               "(--draft mtp) can continue one")
        return speculative_tokens(prompt, model, self, max_tokens=max_tokens, sampler=sampler,
                                  stats=stats)


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
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """(token, logprobs, from_draft), as mlx-lm's speculative_generate_step yields them, with
    the number of drafted tokens chosen again after every verification step."""
    target_cache = make_prompt_cache(model)
    draft_cache = make_prompt_cache(draft.model)
    if len(target_cache) != len(model.layers):  # mlx-lm splits the joint cache by layers
        raise InvalidInput("speculative decoding needs one KV cache per layer of the model")
    if not can_trim_prompt_cache(target_cache) or not can_trim_prompt_cache(draft_cache):
        raise InvalidInput("speculative decoding needs models whose KV cache can be trimmed; "
                           "this model's cache cannot")
    history = [int(t) for t in prompt.tolist()]  # every token either model will have seen
    draft_start = 0  # the draft's cache holds history[draft_start:]
    pending = mx.array(history, mx.uint32)  # not yet in the target's cache
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
                window=draft.policy.probe_every,
            )
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
    coordinator/mtp_draft.py's for the MTP module, which can continue a `prompt_cache`): the
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
