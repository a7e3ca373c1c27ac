"""Ollama's HTTP API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`) over the same batch engine: a request becomes the CompletionRequest an OpenAI
one does, its events shaped as Ollama's answers (newline-delimited JSON when streamed)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from coordinator.server.answering import Service, events, gather, read_request, status_of
from coordinator.server.batching import Event, Sampling
from coordinator.server.grammars import json_schema_grammar
from coordinator.server.openai_api import (
    DEFAULT_MAX_TOKENS,
    CompletionRequest,
    check_fields,
    fit_to_context,
    json_field,
)
from coordinator.server.tools import CallReader, ToolCall, ToolUse, tool_use
from engine.errors import InvalidInput, NotFound, ShoalError

VERSION = "0.12.0"  # the Ollama API release these routes follow

# Ollama's request fields and `options`: "yes" honoured, a message: refused with 400 unless
# at a NEUTRAL value (Ollama's default, or one that asks for nothing Shoal does not do).
# Ollama's memory and hardware settings are refused: the cluster decides where the model runs.
_IMAGES = "image generation is not supported"
_COMMON = {"model": "yes", "format": "yes", "options": "yes", "stream": "yes", "think": "yes",
           "keep_alive": "yes",  # _check_keep_alive
           "logprobs": "'logprobs' is not supported here: /v1/chat/completions has them",
           "top_logprobs": "'top_logprobs' is not supported here: /v1/chat/completions "
           "has them"}
CHAT_FIELDS = {**_COMMON, "messages": "yes", "tools": "yes"}
GENERATE_FIELDS = {**_COMMON, "prompt": "yes", "system": "yes", "raw": "yes",
                   "suffix": "'suffix' (fill in the middle) is not supported",
                   "template": "a 'template' of Ollama's own is not supported: the model's "
                   "chat template is used",
                   "context": "'context' (token ids of an earlier answer) is not supported: "
                   "send the conversation to /api/chat",
                   "images": "'images': images are not supported",
                   "width": f"'width': {_IMAGES}", "height": f"'height': {_IMAGES}",
                   "steps": f"'steps': {_IMAGES}"}
_HARDWARE = "a setting of Ollama's runtime; the cluster decides how the model runs: leave it out"
OPTIONS = {
    "num_predict": "yes", "temperature": "yes", "top_p": "yes", "top_k": "yes",
    "min_p": "yes", "seed": "yes", "stop": "yes", "repeat_penalty": "yes",
    "repeat_last_n": "yes", "presence_penalty": "yes", "frequency_penalty": "yes",
    "num_ctx": "yes", "speculative": "yes",  # Shoal's own: false keeps it off the draft
    **{name: f"option '{name}': {_HARDWARE}" for name in (
        "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "numa", "use_mmap",
        "use_mlock", "num_thread", "logits_all", "vocab_only", "embedding_only")},
    "num_keep": "option 'num_keep': Shoal never shifts the context (a prompt that does not "
    "fit is refused), so it keeps no tokens: leave it out",
    "typical_p": "typical sampling ('typical_p') is not supported",
    "tfs_z": "tail-free sampling ('tfs_z') is not supported",
    "mirostat": "'mirostat' sampling is not supported",
    "mirostat_tau": "'mirostat_tau': mirostat sampling is not supported",
    "mirostat_eta": "'mirostat_eta': mirostat sampling is not supported",
    "penalize_newline": "'penalize_newline' is not supported",
}
NEUTRAL: dict[str, tuple] = {
    "logprobs": (False,), "top_logprobs": (0,), "typical_p": (1.0,), "tfs_z": (1.0,),
    "mirostat": (0,), "mirostat_tau": (5.0,), "mirostat_eta": (0.1,),
    **{name: (False,) for name in ("penalize_newline", "low_vram", "numa", "use_mlock",
                                   "logits_all", "vocab_only", "embedding_only")},
}


def _sampling(options: dict, grammar: str | None) -> tuple[Sampling, bool]:
    """Ollama's options as Shoal's sampling, and whether num_predict was given. Options
    not given take mlx-lm's defaults (the OpenAI routes' too), not a Modelfile's."""
    check_fields(options, OPTIONS, NEUTRAL, "option")
    limit = json_field(options, "num_predict", (int,), "an integer")
    given = limit is not None and limit > 0  # -1: no limit but the context's
    stop = options.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidInput("option 'stop' must be a list of non-empty strings")
    temperature = float(json_field(options, "temperature", (int, float), "a number", 1.0))
    if not 0 <= temperature <= 2:
        raise InvalidInput(f"option 'temperature' must be between 0 and 2, got {temperature}")
    top_p = float(json_field(options, "top_p", (int, float), "a number", 1.0))
    if not 0 < top_p <= 1:
        raise InvalidInput(f"option 'top_p' must be above 0 and at most 1, got {top_p}")
    repeat = float(json_field(options, "repeat_penalty", (int, float), "a number", 0.0))
    return Sampling(
        max_tokens=limit if given else DEFAULT_MAX_TOKENS, temperature=temperature,
        top_p=top_p, top_k=max(0, json_field(options, "top_k", (int,), "an integer", 0)),
        min_p=float(json_field(options, "min_p", (int, float), "a number", 0.0)),
        seed=json_field(options, "seed", (int,), "an integer"), stop=tuple(stop),
        repetition_penalty=0.0 if repeat == 1.0 else repeat,
        repetition_context_size=json_field(options, "repeat_last_n", (int,), "an integer", 64),
        presence_penalty=float(json_field(options, "presence_penalty", (int, float), "a number",
                                      0.0)),
        frequency_penalty=float(json_field(options, "frequency_penalty", (int, float), "a number",
                                       0.0)),
        grammar=grammar,
        speculative=json_field(options, "speculative", (bool,), "true or false", True)), given


def _format(value: object) -> str | None:
    """Ollama's `format`: "json", or a JSON Schema."""
    if value is None or value == "":
        return None
    if value == "json":
        return json_schema_grammar({"type": "object"}, "format")
    if isinstance(value, dict):
        return json_schema_grammar(value, "format")
    raise InvalidInput("'format' must be \"json\" or a JSON Schema object")


def _context(options: dict) -> int | None:
    """`num_ctx`: the context this request may fill, prompt and answer together (Shoal
    refuses a prompt that does not fit it, where Ollama would cut the prompt)."""
    size = json_field(options, "num_ctx", (int,), "an integer")
    if size is not None and size < 2:
        raise InvalidInput(f"option 'num_ctx' must be at least 2, got {size}")
    return size


def _check_keep_alive(value: object) -> None:
    """`keep_alive` asks to keep the model loaded that long after the answer (seconds, or a
    duration such as "5m"; negative: forever). Shoal keeps it loaded while it serves, which
    holds every such wish but zero: unloading at once it does not do."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InvalidInput("'keep_alive' must be seconds or a duration such as \"5m\"")
    if value == 0 or isinstance(value, str) and re.fullmatch(r"-?(?:0+\.?0*[a-zµ]*)+", value):
        raise InvalidInput("'keep_alive' 0 asks to unload the model after the answer: Shoal "
                           "keeps it loaded while it serves (leave it out)")


def _think(value: object) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, bool | str):
        raise InvalidInput("'think' must be true, false, or low, medium or high")
    return (("enable_thinking", value not in (False, "none")),)


def _messages(raw: object) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise InvalidInput("'messages' must be a non-empty list of {role, content}")
    out = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidInput(f"messages[{i}] must be an object with a string 'role'")
        if message.get("images"):
            raise InvalidInput(f"messages[{i}]: images are not supported")
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise InvalidInput(f"messages[{i}].content must be a string")
        entry: dict = {"role": message["role"], "content": content}
        calls = message.get("tool_calls")
        if calls:
            entry["tool_calls"] = [
                {"id": f"call_{i}_{j}", "type": "function",
                 "function": {"name": c.get("function", {}).get("name"),
                              "arguments": c.get("function", {}).get("arguments") or {}}}
                for j, c in enumerate(calls)]
        if message["role"] == "tool" and message.get("tool_name"):
            entry["name"] = message["tool_name"]
        out.append(entry)
    return out


def _tools(tools: object) -> ToolUse:
    return tool_use(tools or None, None, None)


def parse_chat(body: object) -> tuple[CompletionRequest, bool]:
    """An /api/chat request as Shoal's chat request, and whether it streams."""
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object")
    check_fields(body, CHAT_FIELDS, NEUTRAL)
    _check_keep_alive(body.get("keep_alive"))
    options = json_field(body, "options", (dict,), "an object", {})
    sampling, given = _sampling(options, _format(body.get("format")))
    request = CompletionRequest(
        chat=True, messages=tuple(_messages(body.get("messages"))), prompt="",
        sampling=sampling, max_tokens_given=given, stream=False, include_usage=True,
        tools=_tools(body.get("tools")), template_kwargs=_think(body.get("think")),
        context=_context(options))
    return request, json_field(body, "stream", (bool,), "true or false", True)


def parse_generate(body: object) -> tuple[CompletionRequest, bool]:
    """An /api/generate request: the prompt through the chat template as a user's message
    (after `system`), as Ollama does, or as it is with `raw`."""
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object")
    check_fields(body, GENERATE_FIELDS, NEUTRAL)
    _check_keep_alive(body.get("keep_alive"))
    prompt = json_field(body, "prompt", (str,), "a string", "")
    if not prompt:
        raise InvalidInput("'prompt' must be a non-empty string")
    options = json_field(body, "options", (dict,), "an object", {})
    sampling, given = _sampling(options, _format(body.get("format")))
    stream = json_field(body, "stream", (bool,), "true or false", True)
    if json_field(body, "raw", (bool,), "true or false", False):
        sampling = replace(sampling, keep_leading_space=True)  # it continues the prompt
        return CompletionRequest(chat=False, messages=(), prompt=prompt, sampling=sampling,
                                 max_tokens_given=given, stream=False, include_usage=True,
                                 context=_context(options)), stream
    system = json_field(body, "system", (str,), "a string")
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    return CompletionRequest(chat=True, messages=tuple(messages), prompt="", sampling=sampling,
                             max_tokens_given=given, stream=False, include_usage=True,
                             template_kwargs=_think(body.get("think")),
                             context=_context(options)), stream


# ---------------------------------------------------------------------------------------
# Answers


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _calls_json(calls: tuple[ToolCall, ...]) -> list[dict]:
    return [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def _done_json(event: Event, started: float) -> dict:
    u = event.usage
    reason = {"length": "length"}.get(event.finish_reason or "", "stop")
    return {"done": True, "done_reason": reason,
            "total_duration": int((time.monotonic() - started) * 1e9), "load_duration": 0,
            "prompt_eval_count": u.prompt_tokens if u else 0,
            "eval_count": u.completion_tokens if u else 0}


class Answer:
    """One answer's pieces in Ollama's shape: a message (chat) or a response (generate)."""

    def __init__(self, tokenizer, request: CompletionRequest, model: str, *,
                 chat: bool) -> None:
        self.reader = CallReader(tokenizer, request.tools)
        self.model, self.chat = model, chat
        self.started = time.monotonic()

    def json(self, event: Event, text: str) -> dict:
        piece = self.reader.feed(text, last=event.finish_reason is not None)
        out: dict = {"model": self.model, "created_at": _now()}
        if self.chat:
            out["message"] = {"role": "assistant", "content": piece.text}
            if piece.calls:
                out["message"]["tool_calls"] = _calls_json(piece.calls)
        else:
            out["response"] = piece.text
        if event.finish_reason is not None:
            return {**out, **_done_json(event, self.started)}
        return {**out, "done": False}


def error_json(message: str) -> dict:
    return {"error": message}


def model_entry(service: Service) -> dict:
    config = service.manifest.config
    return {"name": service.model_id, "model": service.model_id,
            "modified_at": datetime.fromtimestamp(service.started, UTC).isoformat(),
            # the model's bytes, as Ollama's size is its files': dense part and every expert
            "size": sum(f.bytes for f in (*service.manifest.dense_files,
                                          *service.manifest.experts)),
            "digest": service.manifest.fingerprint,
            "details": {"format": "safetensors", "family": config.get("model_type", ""),
                        "families": [config.get("model_type", "")], "parameter_size": "",
                        "quantization_level": ""}}


# ---------------------------------------------------------------------------------------
# Routes


def routes(service: Service, guard: Callable) -> list[Route]:
    async def answer(request: Request, *, chat: bool) -> Response:
        try:
            def bind(body: object) -> tuple[CompletionRequest, list[int], bool]:
                parsed, stream = (parse_chat if chat else parse_generate)(
                    service.check_model(body))
                return *service.prepare(parsed), stream

            parsed, prompt, stream = await read_request(service, request, bind)
            parsed = fit_to_context(parsed, len(prompt), service.context)
            service.check_serving()
            shape = Answer(service.tokenizer, parsed, service.model_id, chat=chat)
            if stream:
                return StreamingResponse(_lines(shape, parsed, prompt),
                                         media_type="application/x-ndjson")
            gathered = await gather(service.engine, request, prompt, parsed.sampling)
            if gathered is None:
                return Response(status_code=499)
            if gathered[-1].error is not None:
                raise gathered[-1].error
            return JSONResponse(shape.json(gathered[-1], "".join(e.text for e in gathered)))
        except ShoalError as e:
            return JSONResponse(error_json(str(e)), status_of(e))

    async def _lines(shape: Answer, parsed: CompletionRequest,
                     prompt: list[int]) -> AsyncIterator[bytes]:
        async for event in events(service.engine, prompt, parsed.sampling):
            if event is None:
                continue  # NDJSON has no keep-alive line; the connection stays open
            line = (error_json(str(event.error)) if event.error is not None
                    else shape.json(event, event.text))
            yield (json.dumps(line, ensure_ascii=False) + "\n").encode()

    async def chat(request: Request) -> Response:
        return await answer(request, chat=True)

    async def generate(request: Request) -> Response:
        return await answer(request, chat=False)

    async def tags(request: Request) -> Response:
        return JSONResponse({"models": [model_entry(service)]})

    async def ps(request: Request) -> Response:
        # null: it stays loaded while the server runs ("" is no time: ollama's client
        # refused the whole answer)
        return JSONResponse({"models": [{**model_entry(service), "expires_at": None,
                                         "size_vram": 0}]})

    async def show(request: Request) -> Response:
        try:
            body = await read_request(service, request, lambda body: body)
            name = body.get("model") or body.get("name") if isinstance(body, dict) else None
            if name not in (service.model_id, f"{service.model_id}:latest"):
                raise NotFound(f"model {name!r} not found: this server has "
                               f"{service.model_id!r}")
        except ShoalError as e:
            return JSONResponse(error_json(str(e)), status_of(e))
        entry = model_entry(service)
        capabilities = ["completion"] + (["tools"] if service.tokenizer.has_tool_calling
                                         else [])
        return JSONResponse({"modelfile": "", "parameters": "", "template": "",
                             "details": entry["details"], "model_info": service.manifest.config,
                             "capabilities": capabilities, "modified_at": entry["modified_at"]})

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    return [Route("/api/chat", guard(chat), methods=["POST"]),
            Route("/api/generate", guard(generate), methods=["POST"]),
            Route("/api/tags", guard(tags), methods=["GET"]),
            Route("/api/ps", guard(ps), methods=["GET"]),
            Route("/api/show", guard(show), methods=["POST"]),
            Route("/api/version", guard(version), methods=["GET"])]
