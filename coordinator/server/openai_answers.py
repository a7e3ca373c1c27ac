"""The OpenAI API's answers, as pure functions of the batch engine's events: whole bodies,
streamed chunks, usage (with the prompt cache's part), log-probabilities, errors."""

from __future__ import annotations

import time
import uuid

from mlx_lm.tokenizer_utils import TokenizerWrapper

from coordinator.server.answer_text import Event, TokenLogprob
from coordinator.server.openai_api import CompletionRequest
from coordinator.server.tools import CallReader, ToolCall


def answer_meta(*, chat: bool, model: str) -> dict:
    """The fields every body and chunk of one answer shares."""
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "created": int(time.time()), "model": model}


def _token_text(tokenizer: TokenizerWrapper, token: int) -> str:
    return tokenizer.decode([token])


def chat_logprobs(tokenizer: TokenizerWrapper, scores: tuple[TokenLogprob, ...]) -> dict:
    def entry(token: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(s.token, s.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in s.top]} for s in scores]}


def text_logprobs(tokenizer: TokenizerWrapper, scores: tuple[TokenLogprob, ...]) -> dict:
    tokens = [_token_text(tokenizer, s.token) for s in scores]
    return {"tokens": tokens, "token_logprobs": [s.logprob for s in scores],
            "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in s.top}
                             for s in scores]}


def usage_json(event: Event) -> dict | None:
    u = event.usage
    if u is None:
        return None
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens,
                                      "cache_tier": u.cache_tier}}


def error_json(message: str, kind: str, status: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def finish_reason(reader: CallReader, event: Event) -> str | None:
    if event.finish_reason == "stop" and reader.made_calls:
        return "tool_calls"
    return event.finish_reason


def tool_calls_json(calls: tuple[ToolCall, ...], first_index: int | None = None) -> list[dict]:
    """Calls in the API's shape; streamed ones carry their index in the answer."""
    out = []
    for i, call in enumerate(calls):
        item = {"id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments_json}}
        if first_index is not None:
            item["index"] = first_index + i
        out.append(item)
    return out


def completion_json(tokenizer: TokenizerWrapper, request: CompletionRequest,
                    prompt: list[int], events: list[Event], meta: dict) -> dict:
    """A whole (not streamed) answer's body from all of its events, the last one finished."""
    last = events[-1]
    text = "".join(e.text for e in events)
    scores = tuple(s for e in events for s in e.logprobs)
    want_scores = request.sampling.top_logprobs is not None
    if request.chat:
        reader = CallReader(tokenizer, request.tools)
        piece = reader.feed(text, last=True)
        message: dict = {"role": "assistant", "content": piece.text}
        if piece.calls:
            message["content"] = piece.text or None
            message["tool_calls"] = tool_calls_json(piece.calls)
        choice = {"index": 0, "message": message,
                  "logprobs": chat_logprobs(tokenizer, scores) if want_scores else None,
                  "finish_reason": finish_reason(reader, last)}
        obj = "chat.completion"
    else:
        if request.echo:
            text = tokenizer.decode(prompt) + text
        choice = {"index": 0, "text": text,
                  "logprobs": text_logprobs(tokenizer, scores) if want_scores else None,
                  "finish_reason": last.finish_reason}
        obj = "text_completion"
    return {**meta, "object": obj, "choices": [choice], "usage": usage_json(last)}


def _chunk_object(request: CompletionRequest) -> str:
    return "chat.completion.chunk" if request.chat else "text_completion"


class Chunks:
    """A streamed answer's chunks, one per event: the first chat chunk names the role, tool
    calls go out as `tool_calls` deltas as each one completes."""

    def __init__(self, tokenizer: TokenizerWrapper, request: CompletionRequest,
                 meta: dict) -> None:
        self.tokenizer, self.request, self.meta = tokenizer, request, meta
        self.reader = CallReader(tokenizer, request.tools)
        self.first = True

    def chunk(self, event: Event) -> dict:
        request, tokenizer = self.request, self.tokenizer
        scores = None
        if request.sampling.top_logprobs is not None:
            scores = (chat_logprobs if request.chat else text_logprobs)(tokenizer,
                                                                         event.logprobs)
        if request.chat:
            sent = self.reader.made_calls
            piece = self.reader.feed(event.text, last=event.finish_reason is not None)
            delta: dict = {"role": "assistant", "content": piece.text} if self.first else (
                {"content": piece.text} if piece.text or not event.finish_reason else {})
            if piece.calls:
                delta["tool_calls"] = tool_calls_json(piece.calls, sent)
            choice = {"index": 0, "delta": delta, "logprobs": scores,
                      "finish_reason": finish_reason(self.reader, event)}
        else:
            choice = {"index": 0, "text": event.text, "logprobs": scores,
                      "finish_reason": event.finish_reason}
        self.first = False
        out = {**self.meta, "object": _chunk_object(request), "choices": [choice]}
        if request.include_usage:
            out["usage"] = None
        return out


def usage_chunk_json(request: CompletionRequest, event: Event, meta: dict) -> dict:
    """The chunk after the last one when the client asked for usage: no choices."""
    return {**meta, "object": _chunk_object(request), "choices": [], "usage": usage_json(event)}


def model_json(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "shoal"}
