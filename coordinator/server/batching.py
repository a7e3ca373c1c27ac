"""Continuous batching for `shoal serve`: the thread that drives mlx-lm's BatchGenerator (every
request in flight in one forward pass, long prompts prefilled in pieces between decode steps),
the tiered prompt cache around it, and what a failed step does to the requests in it."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator
from mlx_lm.tokenizer_utils import (
    TokenizerWrapper,
)

from coordinator.dataplane.merged_calls import MergedCalls
from coordinator.server.answer_text import AnswerText, Event, Handle
from coordinator.server.drafting import Drafting
from coordinator.server.grammars import Grammars
from coordinator.server.latency import Latencies
from coordinator.server.prefill_overlap import overlapped_step
from coordinator.server.prefill_pacing import BUDGET_STEPS, PrefillPacer, paced_step
from coordinator.server.prompt_cache_tiers import DiskTier, PromptCache
from coordinator.server.sampling import (
    Sampling,
    make_request_processors,
    make_request_sampler,
)
from engine.errors import ShoalError, Unavailable

log = logging.getLogger("shoal.serve")

IDLE_POLL = 0.5  # seconds an idle engine waits for work before checking it should stop


@dataclass(frozen=True)
class EngineStats:
    """Counters since the engine started (for the benchmark and `/health`)."""

    decode_steps: int = 0
    decode_rows: int = 0  # tokens of all decode steps (a drafted step gives one row several)
    widest_step: int = 0  # the most rows one decode step carried
    prompt_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    cached_tokens: int = 0  # prompt tokens served from the prompt cache (either tier)
    disk_cached_tokens: int = 0  # of those, read back from disk
    failed_steps: int = 0

    def as_json(self) -> dict:
        return asdict(self)


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
        prompt_cache_disk: DiskTier | None = None,
        prefill_step_size: int = 512,
        prefill_budget: float = BUDGET_STEPS,
        drafting: Drafting | None = None,
        merged: MergedCalls | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.prefill_step_size = prefill_step_size  # tokens in one pass of a prompt
        # tokens of prompt between two decode steps: `prefill_budget` decode steps' time
        self.pacer = PrefillPacer(budget_steps=prefill_budget)
        self.prompt_cache_bytes = prompt_cache_bytes
        self.stats = EngineStats()
        self.drafting = drafting  # a stream alone decodes through the draft (drafting.py)
        # the model's dispatcher merges the layer calls of forwards taking part: a prompt
        # piece then runs beside the decode step, one round trip a layer (prefill_overlap.py)
        self.merged = merged
        self._decoder = None if merged is None else ThreadPoolExecutor(
            1, thread_name_prefix="shoal decode step")
        self.latencies = Latencies()
        self._grammars = Grammars(tokenizer)
        self._prompt_cache = PromptCache(cache_key, prompt_cache_bytes, prompt_cache_disk)
        self._inbox: queue.SimpleQueue[Handle | None] = queue.SimpleQueue()
        self._live: dict[int, AnswerText] = {}
        self._in_flight = 0  # requests submitted and not finished: read by other threads
        self._lock = threading.Lock()
        self._closed = False
        self._stream: mx.Stream | None = None  # the engine thread's, set when it starts
        self._thread = threading.Thread(target=self._run, name="shoal batching", daemon=True)
        self._thread.start()

    @property
    def prompt_cache(self) -> dict:
        """Entries and bytes in the prompt cache's tiers, and their bounds (a snapshot)."""
        return self._prompt_cache.stats()

    def drafting_stats(self) -> dict | None:
        """What the draft did (drafting.py's DraftingStats), None without a draft."""
        return None if self.drafting is None else self.drafting.stats.as_json()

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
        self._prompt_cache.close(timeout)  # the files of the last requests, written
        if self._decoder is not None:
            self._decoder.shutdown(wait=False)

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
        if self.drafting is not None:
            self.drafting.rejoin(generator, self._live)
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
            hit = self._prompt_cache.fetch(handle.prompt)
            cache, rest = hit.cache, hit.rest
            cached = len(handle.prompt) - len(rest)
            (uid,) = generator.insert(
                [rest], max_tokens=[handle.sampling.max_tokens], caches=[cache],
                all_tokens=[handle.prompt[:cached]],
                samplers=[make_request_sampler(handle.sampling)],
                logits_processors=[processors],
            )
            self._live[uid] = AnswerText(handle, self.tokenizer, cached, hit.tier)
            self._count(prompt_tokens=len(rest), cached_tokens=cached,
                        disk_cached_tokens=cached if hit.tier == "disk" else 0)
        active = generator.prompt_cache_nbytes
        self._prompt_cache.trim_to(self.prompt_cache_bytes - active)

    def _step(self, generator: BatchGenerator) -> None:
        rows = None if self.drafting is None else self.drafting.step(generator, self._live)
        if rows is None:
            streams = any(live.last_token is not None for live in self._live.values())
            responses = (paced_step(self.pacer, generator, streams=streams)
                         if self.merged is None else
                         overlapped_step(self.pacer, generator, self.merged, self._decoder,
                                         streams=streams))
        else:
            responses = rows
        if responses:
            self._count(decode_steps=1, decode_rows=len(responses))
            width = len({r.uid for r in responses})  # a drafted step gives one row several
            if width > self.stats.widest_step:
                self.stats = replace(self.stats, widest_step=width)
        stopped = []
        now = time.monotonic()
        for r in responses:
            live = self._live.get(r.uid)
            if live is None:
                continue
            if live.last_token is None:
                self.latencies.observe(first_token=now - live.handle.submitted)
            else:
                self.latencies.observe(gap=now - live.last_token)
            live.last_token = now
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
            if self.drafting is not None:
                kept.update({uid: taken for uid in stopped
                             if (taken := self.drafting.take(uid)) is not None})
            for cache, tokens in kept.values():
                self._keep(tokens, cache)

    def _keep(self, tokens: list[int], cache: list) -> None:
        self._prompt_cache.keep(tokens, cache)

    def _fail_all(self, error: ShoalError, arrivals: list[Handle]) -> None:
        """End every request in the batch, and those that arrived but were not admitted,
        with `error`."""
        if self.drafting is not None:
            self.drafting.reset()
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

