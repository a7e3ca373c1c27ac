"""A conversation with the cluster, as `shoal chat` holds it: the history through the chat
template each turn, and one KV cache that carries over, trimmed back to the longest prefix it
shares with the new prompt, so a turn computes only the new message."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from coordinator.decoding.draft_policy import SpeculativeStats
from coordinator.decoding.generate import encode_messages
from coordinator.decoding.mtp_draft import MtpDraft
from coordinator.decoding.speculative import stream_speculative


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Turn:
    """One reply's figures."""

    text: str
    prompt_tokens: int
    cached_tokens: int  # of the prompt, taken from the cache
    tokens: int
    tokens_per_second: float
    seconds: float
    speculative: SpeculativeStats | None = None  # with --draft
    stopped: bool = False  # the user stopped the reply before its end


class Conversation:
    def __init__(self, model: nn.Module, tokenizer: TokenizerWrapper, *,
                 system: str | None = None, max_tokens: int = 256,
                 temperature: float = 0.0, top_p: float = 1.0,
                 kv_cache: dict | None = None, draft: MtpDraft | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.draft = draft  # the MTP module drafting, each turn afresh on the new tokens
        self.kv_cache = kv_cache or {}  # mlx-lm's KV-cache quantization, if asked
        self.system, self.max_tokens = system, max_tokens
        self.sampler = make_sampler(temp=temperature, top_p=top_p)
        self.reset()

    def reset(self) -> None:
        """Forget the history and the cache."""
        self.messages: list[dict] = ([{"role": "system", "content": self.system}]
                                     if self.system else [])
        self.cache = make_prompt_cache(self.model)
        self.cached: list[int] = []  # the tokens the cache holds

    def say(self, text: str, on_text: Callable[[str], None],
            stop: Callable[[], bool] = lambda: False) -> Turn:
        """The reply to the user's `text`, streamed to `on_text` as it comes; cut short, and
        kept so far, once `stop()` says so (checked before each token is shown, never inside
        a layer call, so no worker is left with a request half read). When the reply fails (a
        worker lost), the conversation stays as it was before `text` and the cache starts
        again: a turn cut inside a forward pass may have left some layers' KV a token ahead."""
        try:
            return self._say(text, on_text, stop)
        except BaseException:
            self.cache, self.cached = make_prompt_cache(self.model), []
            raise

    def _say(self, text: str, on_text: Callable[[str], None],
             stop: Callable[[], bool]) -> Turn:
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt = encode_messages(self.tokenizer, messages)
        keep = shared_prefix(self.cached, prompt)
        if keep == len(prompt):  # the model needs at least one new token to answer
            keep -= 1
        if keep < len(self.cached):
            if can_trim_prompt_cache(self.cache):
                trim_prompt_cache(self.cache, len(self.cached) - keep)
            else:  # a cache that cannot go back (some hybrid models'): start it again
                self.cache, keep = make_prompt_cache(self.model), 0
        started = time.perf_counter()
        reply, tokens, speed, stopped = "", list(prompt), 0.0, False
        speculative = None
        if self.draft is None:
            responses = stream_generate(self.model, self.tokenizer, mx.array(prompt[keep:]),
                                        max_tokens=self.max_tokens, sampler=self.sampler,
                                        prompt_cache=self.cache, **self.kv_cache)
        else:
            speculative = SpeculativeStats()
            responses = stream_speculative(self.model, self.tokenizer, mx.array(prompt[keep:]),
                                           self.draft, max_tokens=self.max_tokens,
                                           sampler=self.sampler, stats=speculative,
                                           prompt_cache=self.cache)
        for r in responses:
            tokens.append(int(r.token))  # in the cache either way: see self.cached below
            if stop():  # Ctrl-C came while this token was computed: it is not shown
                stopped = True
                break
            speed = r.generation_tps
            if r.text:
                reply += r.text
                on_text(r.text)
        # the cache holds every token fed to the model, which (mlx-lm computes a step
        # ahead) may or may not include the reply's last: ask it
        self.cached = tokens[:max(c.offset for c in self.cache)]
        self.messages = [*messages, {"role": "assistant", "content": reply}]
        return Turn(reply, len(prompt), keep, len(tokens) - len(prompt), speed,
                    time.perf_counter() - started, speculative, stopped)
