"""Continuous batching for `shoal serve`: every request in flight decodes in the same forward
pass, so each MoE layer sends one request per involved worker carrying the rows of all of
them. mlx-lm's BatchGenerator does the batching itself (per-row KV caches merged with left
padding, per-row samplers, requests joining and leaving between steps); this module owns the
thread that drives it, each request's text (detokenizing, stop strings, log-probabilities),
the prompt cache that spares a multi-turn chat its earlier turns, and what a failed step
does to the requests in it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    StreamingDetokenizer,
    TokenizerWrapper,
)

from coordinator.server.grammars import Grammars
from engine.errors import ShoalError, Unavailable

log = logging.getLogger("shoal.serve")

IDLE_POLL = 0.5  # seconds an idle engine waits for work before checking it should stop


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


@dataclass(frozen=True)
class Event:
    """A piece of one request's answer; the last has a finish_reason or an error."""

    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # "stop" (end of text or a stop string), "length"
    stop: str | None = None  # the stop string that ended the answer, if one did
    error: ShoalError | None = None
    usage: Usage | None = None  # on the last event


@dataclass(frozen=True)
class EngineStats:
    """Counters since the engine started (for the benchmark and `/health`)."""

    decode_steps: int = 0
    decode_rows: int = 0  # rows over all decode steps: decode_rows / decode_steps = batch
    widest_step: int = 0  # the most rows one decode step carried
    prompt_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    cached_tokens: int = 0  # prompt tokens served from the prompt cache
    failed_steps: int = 0

    def as_json(self) -> dict:
        return asdict(self)


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


class Handle:
    """One submitted request as its caller sees it: cancel() frees its slot at once."""

    def __init__(self, prompt: list[int], sampling: Sampling, deliver: Callable[[Event], None],
                 wake: Callable[[], None]) -> None:
        self.prompt = prompt
        self.sampling = sampling
        self.deliver = deliver
        self.cancelled = False
        self.done = False
        self._wake = wake

    def cancel(self) -> None:
        if not self.done:
            self.cancelled = True
            self._wake()


class _Live:
    """A request inside the batch generator: its text so far and its counters."""

    def __init__(self, handle: Handle, tokenizer: TokenizerWrapper, cached: int) -> None:
        self.handle = handle
        self.tokenizer = tokenizer
        self.detokenizer = make_detokenizer(
            tokenizer, keep_leading_space=handle.sampling.keep_leading_space)
        self.pending = ""  # generated text held back: it may begin a stop string
        self.generated = 0
        self.cached = cached

    def usage(self) -> Usage:
        return Usage(len(self.handle.prompt), self.generated, self.cached)

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


class BatchEngine:
    """Drives mlx-lm's BatchGenerator over `model` on its own thread; thread-safe submit().

    A step that fails (a worker lost with no other copy of its experts) ends every request
    in that step with the error, and the next request starts a fresh batch: the KV caches
    of a half-computed step cannot be trusted, the prompt cache's copies can.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        *,
        cache_key: str,
        max_batch: int = 16,
        prompt_cache_bytes: int = 1 << 30,
        prefill_step_size: int = 512,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.prefill_step_size = prefill_step_size
        self.prompt_cache_bytes = prompt_cache_bytes
        self.stats = EngineStats()
        self._cache_key = cache_key
        self._grammars = Grammars(tokenizer)
        self._prompt_cache = LRUPromptCache(max_size=1 << 16, max_bytes=prompt_cache_bytes)
        self._inbox: queue.SimpleQueue[Handle | None] = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}
        self._in_flight = 0  # requests submitted and not finished: read by other threads
        self._lock = threading.Lock()
        self._closed = False
        self._stream: mx.Stream | None = None  # the engine thread's, set when it starts
        self._thread = threading.Thread(target=self._run, name="shoal batching", daemon=True)
        self._thread.start()

    @property
    def prompt_cache(self) -> dict:
        """Entries and bytes in the prompt cache, and its bound (a snapshot)."""
        return {"entries": len(self._prompt_cache), "bytes": self._prompt_cache.nbytes,
                "limit": self.prompt_cache_bytes}

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def submit(self, prompt: list[int], sampling: Sampling,
               deliver: Callable[[Event], None]) -> Handle:
        """Queue a request; `deliver` is called on the engine's thread with each Event."""
        if self._closed:
            raise Unavailable("the server is shutting down")
        handle = Handle(list(prompt), sampling, deliver, lambda: self._inbox.put(None))
        with self._lock:
            self._in_flight += 1
        self._inbox.put(handle)
        return handle

    def close(self, timeout: float = 10.0) -> None:
        self._closed = True
        self._inbox.put(None)
        self._thread.join(timeout)

    # the engine's thread ---------------------------------------------------------------

    def _run(self) -> None:
        # Generation runs on this thread's own stream, as mlx-lm's server does it.
        self._stream = mx.default_stream(mx.default_device())
        with mx.stream(self._stream):
            generator: BatchGenerator | None = None
            arrivals: list[Handle] = []
            while not self._closed:
                arrivals = self._take(block=not self._live)
                if self._closed:
                    break
                try:
                    if arrivals or any(live.handle.cancelled for live in self._live.values()):
                        if generator is None:
                            generator = self._new_generator()
                        self._admit(generator, arrivals)
                    if not self._live:
                        continue
                    self._step(generator)
                except Exception as e:  # noqa: BLE001 (every request must hear of it)
                    if not isinstance(e, ShoalError):
                        log.exception("a generation step failed")
                        e = ShoalError(f"generation failed: {type(e).__name__}: {e}")
                    self._count(failed_steps=1)
                    self._fail_all(e, arrivals)
                    if generator is not None:
                        generator.close()
                    generator = None
            self._fail_all(Unavailable("the server is shutting down"),
                           arrivals + self._take(block=False))
            if generator is not None:
                generator.close()

    def _take(self, *, block: bool) -> list[Handle]:
        arrivals = []
        try:
            item = self._inbox.get(timeout=IDLE_POLL) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    arrivals.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        return arrivals

    def _new_generator(self) -> BatchGenerator:
        stop = [[t] for t in sorted(self.tokenizer.eos_token_ids)]
        return BatchGenerator(
            self.model, stop_tokens=stop, completion_batch_size=self.max_batch,
            prefill_batch_size=self.max_batch, prefill_step_size=self.prefill_step_size,
            stream=self._stream,
        )

    def _admit(self, generator: BatchGenerator, arrivals: list[Handle]) -> None:
        gone = [uid for uid, live in self._live.items() if live.handle.cancelled]
        if gone:
            generator.remove(gone)
            for uid in gone:
                self._end(self._live.pop(uid).handle, None)
        for handle in arrivals:
            if handle.cancelled:
                self._end(handle, None)
                continue
            try:  # a request's own settings that fail end that request, not the batch
                processors = make_request_processors(handle.sampling, self._grammars)
            except ShoalError as e:
                self._end(handle, Event(error=e))
                continue
            cache, rest = self._prompt_cache.fetch_nearest_cache(self._cache_key, handle.prompt)
            if cache is not None and not rest:  # the whole prompt is cached: redo its last
                if can_trim_prompt_cache(cache):
                    trim_prompt_cache(cache, 1)
                    rest = handle.prompt[-1:]
                else:
                    cache, rest = None, handle.prompt
            cached = len(handle.prompt) - len(rest)
            (uid,) = generator.insert(
                [rest], max_tokens=[handle.sampling.max_tokens], caches=[cache],
                all_tokens=[handle.prompt[:cached]],
                samplers=[make_request_sampler(handle.sampling)],
                logits_processors=[processors],
            )
            self._live[uid] = _Live(handle, self.tokenizer, cached)
            self._count(prompt_tokens=len(rest), cached_tokens=cached)
        active = generator.prompt_cache_nbytes
        self._prompt_cache.trim_to(n_bytes=self.prompt_cache_bytes - active)

    def _step(self, generator: BatchGenerator) -> None:
        _, responses = generator.next()
        if responses:
            self._count(decode_steps=1, decode_rows=len(responses))
            if len(responses) > self.stats.widest_step:
                self.stats = replace(self.stats, widest_step=len(responses))
        stopped = []
        for r in responses:
            live = self._live.get(r.uid)
            if live is None:
                continue
            event = live.token_event(r.token, r.logprobs, r.finish_reason)
            if event.finish_reason is not None and r.finish_reason is None:
                stopped.append(r.uid)  # a stop string: mlx-lm does not know to stop it
            elif r.finish_reason is not None:
                self._keep(r.all_tokens, r.prompt_cache)
            if event.finish_reason is not None:
                del self._live[r.uid]
                self._end(live.handle, event)
            elif event.text or event.logprobs:
                live.handle.deliver(event)
        if stopped:
            kept = generator.remove(stopped, return_prompt_caches=True)
            for cache, tokens in kept.values():
                self._keep(tokens, cache)

    def _keep(self, tokens: list[int], cache: list) -> None:
        self._prompt_cache.insert_cache(self._cache_key, list(tokens), cache)

    def _fail_all(self, error: ShoalError, arrivals: list[Handle]) -> None:
        """End every request in the batch, and those that arrived but were not admitted,
        with `error`."""
        for live in list(self._live.values()):
            self._end(live.handle, Event(error=error, usage=live.usage()))
        self._live.clear()
        for handle in arrivals:
            self._end(handle, Event(error=error))

    def _end(self, handle: Handle, event: Event | None) -> None:
        """Deliver a request's last event (none for a cancelled one), once."""
        if handle.done:
            return
        if event is not None:
            try:
                handle.deliver(event)
            except Exception:  # noqa: BLE001 (a caller's bug must not stop the engine)
                log.exception("delivering a request's last event failed")
        self._done(handle)

    def _done(self, handle: Handle) -> None:
        if not handle.done:
            handle.done = True
            with self._lock:
                self._in_flight -= 1

    def _count(self, **added: int) -> None:
        values = {name: getattr(self.stats, name) + added.get(name, 0)
                  for name in EngineStats.__dataclass_fields__}
        self.stats = EngineStats(**values)

