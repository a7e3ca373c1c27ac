"""One request's answer as it is decoded: the caller's handle on it, its text (mlx-lm's streaming
detokenizer, stop strings held back until they cannot match), log-probabilities, the events."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    StreamingDetokenizer,
    TokenizerWrapper,
)

from coordinator.server.sampling import Sampling
from engine.errors import ShoalError


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens, best first


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens taken from the prompt cache, not computed again
    cache_tier: str | None = None  # where they came from: "memory" or "disk"


@dataclass(frozen=True)
class Event:
    """A piece of one request's answer; the last has a finish_reason or an error."""

    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # "stop" (end of text or a stop string), "length"
    stop: str | None = None  # the stop string that ended the answer, if one did
    error: ShoalError | None = None
    usage: Usage | None = None  # on the last event


class Handle:
    """One submitted request as its caller sees it: cancel() frees its slot at once."""

    def __init__(self, prompt: list[int], sampling: Sampling, deliver: Callable[[Event], None],
                 wake: Callable[[], None]) -> None:
        self.prompt = prompt
        self.sampling = sampling
        self.deliver = deliver
        self.submitted = time.monotonic()
        self.cancelled = False
        self.done = False
        self._wake = wake

    def cancel(self) -> None:
        if not self.done:
            self.cancelled = True
            self._wake()


def split_at_stop(pending: str, stops: tuple[str, ...]) -> tuple[str, str, bool]:
    """(text safe to emit, text to hold back, whether a stop string was reached) for the
    text generated and not yet emitted. A stop string and what follows it are dropped; the
    longest tail that could still begin a stop string is held back, so that no part of a
    stop string is ever emitted."""
    found = [i for i in (pending.find(s) for s in stops) if i >= 0]
    if found:
        return pending[: min(found)], "", True
    hold = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(pending)), hold, -1):
            if pending.endswith(stop[:length]):
                hold = length
                break
    return pending[: len(pending) - hold], pending[len(pending) - hold:], False


def make_detokenizer(tokenizer: TokenizerWrapper, *,
                     keep_leading_space: bool) -> StreamingDetokenizer:
    """mlx-lm's streaming detokenizer for one answer. mlx-lm's BPE and SPM detokenizers drop
    the first token's leading space (right after a chat template's assistant header);
    `keep_leading_space` keeps it, for an answer that continues the prompt's text."""
    detokenizer = tokenizer.detokenizer  # a fresh copy
    if keep_leading_space:
        if isinstance(detokenizer, BPEStreamingDetokenizer):
            detokenizer._maybe_trim_space = lambda text: text  # the one place it trims
        elif isinstance(detokenizer, SPMStreamingDetokenizer):
            detokenizer.trim_space = False
    return detokenizer


class AnswerText:
    """A request inside the batch generator: its text so far and its counters."""

    def __init__(self, handle: Handle, tokenizer: TokenizerWrapper, cached: int,
                 tier: str | None = None) -> None:
        self.handle = handle
        self.tokenizer = tokenizer
        self.detokenizer = make_detokenizer(
            tokenizer, keep_leading_space=handle.sampling.keep_leading_space)
        self.pending = ""  # generated text held back: it may begin a stop string
        self.generated = 0
        self.cached = cached
        self.tier = tier if cached else None
        self.last_token: float | None = None  # when its latest token came (time.monotonic)

    def usage(self) -> Usage:
        return Usage(len(self.handle.prompt), self.generated, self.cached, self.tier)

    def token_event(self, token: int, logprobs: mx.array, finish: str | None) -> Event:
        """The event for one generated token. `finish` "stop" means it is an end token,
        which is not part of the text."""
        sampling = self.handle.sampling
        end_token = finish == "stop"
        if end_token:
            self.detokenizer.finalize()
        else:
            self.generated += 1
            self.detokenizer.add_token(token)
            if finish is not None:
                self.detokenizer.finalize()
        self.pending += self.detokenizer.last_segment
        pending = self.pending
        text, self.pending, stopped = split_at_stop(pending, sampling.stop)
        stop_string = None
        if stopped:
            finish = "stop"
            stop_string = min((s for s in sampling.stop if s in pending), key=pending.find)
        elif finish is not None:
            text, self.pending = text + self.pending, ""
        scores = ()
        if sampling.top_logprobs is not None and not end_token:
            scores = (self._logprob(token, logprobs),)
        return Event(text=text, logprobs=scores, finish_reason=finish, stop=stop_string,
                     usage=self.usage() if finish else None)

    def _logprob(self, token: int, logprobs: mx.array) -> TokenLogprob:
        n = self.handle.sampling.top_logprobs or 0
        top: tuple[tuple[int, float], ...] = ()
        if n:
            best = mx.argpartition(-logprobs, kth=n - 1)[:n]
            values = logprobs[best]
            order = mx.argsort(-values)
            top = tuple(zip(best[order].tolist(), values[order].tolist(), strict=True))
        return TokenLogprob(token, logprobs[token].item(), top)
