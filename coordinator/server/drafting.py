"""Drafts in `shoal serve`: a stream decoding alone leaves the batch for the speculative path
(a draft model or the model's MTP module), its KV cache carried over, and rejoins the batch when
another request comes; what the draft did, for /metrics and the dashboard."""
# Several streams decode in the batch without drafts: mlx-lm's BatchKVCache keeps one offset
# for every row and trims all rows alike, so rows that accept different numbers of drafted
# tokens cannot each keep their own cache; docs/serving.md says so.

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from coordinator.decoding.draft_policy import SpeculativeStats
from coordinator.decoding.mtp_draft import MtpDraft
from coordinator.decoding.speculative import Draft
from coordinator.server.answer_text import AnswerText
from coordinator.server.sampling import Sampling, make_request_sampler
from engine.errors import InvalidInput


@dataclass(frozen=True)
class DraftingStats:
    """What the draft did since the server started. A step is one forward of the model for
    the stream decoding alone: a verification step, or a plain one while drafting does not
    pay (the policy's timing steps and probes, docs/speculative.md)."""

    draft: str  # "model" (a draft model) or "mtp" (the model's own module)
    solo_runs: int = 0  # times a stream left the batch to decode with the draft
    verify_steps: int = 0
    plain_steps: int = 0
    proposed: int = 0  # drafted tokens offered to the model
    accepted: int = 0  # of those, the ones the model agreed with
    tokens: int = 0  # tokens decoded on this path

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        steps = self.verify_steps + self.plain_steps
        return self.tokens / steps if steps else 0.0

    def as_json(self) -> dict:
        return {**asdict(self), "acceptance_rate": self.acceptance,
                "tokens_per_step": self.tokens_per_step}


@dataclass(frozen=True)
class Row:
    """One token of the stream decoding alone, shaped as BatchGenerator's responses."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None
    prompt_cache: list | None = None  # on the last: the cache holding `all_tokens`
    all_tokens: list[int] | None = None


def may_draft(sampling: Sampling) -> bool:
    """Whether a request may decode through the draft: it did not turn drafts off, it has no
    logits processors (the speculative path applies none), and no seed (a seeded sampler's
    draws would depend on how many rows each step verifies)."""
    s = sampling
    return s.speculative and s.seed is None and not (
        s.logit_bias or s.repetition_penalty or s.presence_penalty or s.frequency_penalty
        or s.grammar is not None)


def _greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


class _Solo:
    """The stream decoding alone: the draft's token generator over its carried cache."""

    def __init__(self, uid: int, answer: AnswerText, tokens: list[int], cache: list,
                 tokens_of: Callable[..., Generator], model: nn.Module) -> None:
        self.uid, self.answer, self.cache = uid, answer, cache
        self.history = tokens  # every token of the stream; the cache holds all but the last
        self.left = answer.handle.sampling.max_tokens - answer.generated
        self.spec = SpeculativeStats()
        sampler = make_request_sampler(answer.handle.sampling) or _greedy
        self.tokens = tokens_of(mx.array(tokens[-1:], mx.uint32), model, max_tokens=self.left,
                                sampler=sampler, stats=self.spec, cache=cache,
                                context=tokens[:-1])

    def step(self, eos: set[int]) -> list[Row]:
        """The tokens of one verification (or plain) step, cut at the stream's end."""
        rows = []
        while True:
            token, logprobs, from_draft = next(self.tokens)
            self.history.append(token)
            self.left -= 1
            finish = "stop" if token in eos else "length" if self.left == 0 else None
            rows.append(Row(self.uid, token, logprobs, finish))
            if finish is not None or not from_draft:
                return rows

    def close(self) -> tuple[list, list[int]]:
        """Stop the generator: (the cache, the tokens it holds: all but the last)."""
        self.tokens.close()  # its own rewind: between steps it holds all but the last token
        extra = self.cache[0].offset - (len(self.history) - 1)
        if extra > 0:  # stopped inside a step, at an end token among the accepted guesses
            trim_prompt_cache(self.cache, extra)
        return self.cache, self.history[:-1]


class Drafting:
    """The draft of one server and the stream, if any, that decodes alone through it.
    Runs on the engine's thread only."""

    def __init__(self, model: nn.Module, draft: Draft | MtpDraft, eos: set[int]) -> None:
        if not can_trim_prompt_cache(make_prompt_cache(model)):
            raise InvalidInput("this model's KV cache cannot be trimmed back after a rejected "
                               "guess, so it cannot decode with a draft: leave out --draft "
                               "and --draft-model")
        self.model, self.draft, self.eos = model, draft, set(eos)
        self.stats = DraftingStats(draft=draft.kind)
        self._solo: _Solo | None = None
        # uid -> tokens it had generated when it rejoined: until it has one more, the batch
        # has not read its last token yet, and its cache is not the one _leave expects
        self._rejoined: dict[int, int] = {}

    @property
    def solo_uid(self) -> int | None:
        return None if self._solo is None else self._solo.uid

    def step(self, generator: BatchGenerator, live: dict[int, AnswerText]) -> list[Row] | None:
        """One step of the stream decoding alone, leaving the batch first if it has just
        become alone there; None when the batch should step instead."""
        if self._solo is None and not self._leave(generator, live):
            return None
        solo = self._solo
        s = solo.spec
        counted = (s.verify_steps, s.plain_steps, s.proposed, s.accepted)
        rows = solo.step(self.eos)
        t = self.stats
        self.stats = replace(
            t, verify_steps=t.verify_steps + s.verify_steps - counted[0],
            plain_steps=t.plain_steps + s.plain_steps - counted[1],
            proposed=t.proposed + s.proposed - counted[2],
            accepted=t.accepted + s.accepted - counted[3], tokens=t.tokens + len(rows))
        if rows[-1].finish_reason is not None:
            cache, tokens = self.take(solo.uid)
            rows[-1] = replace(rows[-1], prompt_cache=cache, all_tokens=tokens)
        return rows

    def take(self, uid: int) -> tuple[list, list[int]] | None:
        """End the stream decoding alone, if it is `uid`: (its cache, the tokens it holds)."""
        if self._solo is None or self._solo.uid != uid:
            return None
        solo, self._solo = self._solo, None
        return solo.close()

    def rejoin(self, generator: BatchGenerator, live: dict[int, AnswerText]) -> None:
        """Put the stream decoding alone back into the batch, under its new uid in `live`:
        its cache holds all its tokens but the last, which the batch reads next."""
        if self._solo is None:
            return
        solo = self._solo
        cache, tokens = self.take(solo.uid)
        answer = live.pop(solo.uid)
        (uid,) = generator.insert(
            [solo.history[-1:]], max_tokens=[solo.left], caches=[cache], all_tokens=[tokens],
            samplers=[make_request_sampler(answer.handle.sampling)], logits_processors=[[]])
        live[uid] = answer
        self._rejoined = {u: n for u, n in self._rejoined.items() if u in live}
        self._rejoined[uid] = answer.generated

    def reset(self) -> None:
        """Forget the stream decoding alone (a failed step: its cache cannot be trusted)."""
        self._solo = None

    def _leave(self, generator: BatchGenerator, live: dict[int, AnswerText]) -> bool:
        if len(live) != 1:
            return False
        ((uid, answer),) = live.items()
        if answer.last_token is None or not may_draft(answer.handle.sampling):
            return False  # still reading its prompt, or it may not draft
        if self._rejoined.get(uid) == answer.generated:
            return False  # it has just rejoined: the batch has not read its last token yet
        cache, tokens = generator.remove([uid], return_prompt_caches=True)[uid]
        # The batch has fed the stream's latest token and sampled the next, which is dropped:
        # the draft's path reads that token again as its first input.
        trim_prompt_cache(cache, 1)
        self._solo = _Solo(uid, answer, list(tokens), cache, self.draft.tokens, self.model)
        self.stats = replace(self.stats, solo_runs=self.stats.solo_runs + 1)
        return True
