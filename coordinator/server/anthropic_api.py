"""Anthropic's Messages API (`POST /v1/messages`, streamed or not, with tools, and
`/v1/messages/count_tokens`): a request becomes the CompletionRequest an OpenAI chat request
does (one template, tools, sampling and context path), its events shaped as Anthropic's."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from coordinator.server.answering import Service, events, gather, read_request, status_of
from coordinator.server.batching import Event, Sampling
from coordinator.server.grammars import response_format_grammar
from coordinator.server.openai_api import (
    DEFAULT_MAX_TOKENS,
    MAX_STOP_STRINGS,
    CompletionRequest,
    check_fields,
    fit_to_context,
    json_field,
    number_field,
)
from coordinator.server.tools import CallReader, Piece, ToolUse, tool_use
from engine.errors import InvalidInput, ShoalError

# Every field of the Messages API's request: "yes" honoured, "ignored" a label taken without
# effect on the answer, a message: refused with 400 unless at a NEUTRAL value, one that asks
# for nothing Shoal does not do.
FIELDS: dict[str, str] = {
    "model": "yes", "messages": "yes", "max_tokens": "yes", "system": "yes",
    "stop_sequences": "yes", "stream": "yes", "temperature": "yes", "top_p": "yes",
    "top_k": "yes", "tools": "yes", "tool_choice": "yes", "thinking": "yes",
    "output_config": "yes", "speculative": "yes",  # Shoal's own: false keeps it off the draft
    "metadata": "ignored", "user_profile_id": "ignored", "workspace_id": "ignored",
    "service_tier": "'service_tier': Shoal has one tier: send auto or standard_only",
    "cache_control": "'cache_control': Shoal's prompt cache keeps shared prefixes while "
    "memory allows (--prompt-cache-bytes), for no promised time: leave out the ttl of 1h",
    "diagnostics": "'diagnostics' (prompt-cache reports) is not supported: leave it out",
    "inference_geo": "'inference_geo' is not supported: the answer is computed on this "
    "cluster, wherever it is",
    "speed": "'speed': fast mode is not supported: send standard or leave it out",
    "container": "'container': code execution is not supported",
    "mcp_servers": "'mcp_servers' is not supported: give the tools in 'tools'",
    "context_management": "'context_management' is not supported",
}
NEUTRAL: dict[str, tuple] = {
    "service_tier": ("auto", "standard_only"), "speed": ("standard",),
    "cache_control": ({"type": "ephemeral"}, {"type": "ephemeral", "ttl": "5m"}),
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def _text_blocks(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidInput(f"{where} must be a string or a list of content blocks")
    texts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(
            block.get("text"), str
        ):
            raise InvalidInput(f"{where}[{i}]: only text blocks are supported here")
        texts.append(block["text"])
    return "".join(texts)


def _messages(system: object, raw: object) -> list[dict]:
    """Anthropic's messages as the chat template's (OpenAI's) messages: tool_use blocks
    become an assistant's tool calls, tool_result blocks tool messages with their ids."""
    out = []
    if system is not None:
        out.append({"role": "system", "content": _text_blocks(system, "system")})
    if not isinstance(raw, list) or not raw:
        raise InvalidInput("'messages' must be a non-empty list of {role, content}")
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise InvalidInput(f"{where} must be an object with role user or assistant")
        role, content = message["role"], message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise InvalidInput(f"{where}.content must be a string or a list of blocks")
        texts, calls = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(block.get("id")), "type": "function",
                              "function": {"name": str(block.get("name")),
                                           "arguments": block.get("input") or {}}})
            elif kind == "tool_result" and role == "user":
                result = block.get("content", "")
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id")),
                            "content": _text_blocks(result, f"{where}.content[{j}].content")})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier reasoning: chat templates leave it out of the prompt too
            else:
                raise InvalidInput(f"{where}.content[{j}]: a {json.dumps(kind)} block is not "
                                   f"supported in a {role} message")
        if texts or calls or not content:
            entry: dict = {"role": role, "content": "".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def _tools(tools: object, choice: object) -> ToolUse:
    if tools is None:
        return tool_use(None, None, None)
    if not isinstance(tools, list):
        raise InvalidInput("'tools' must be a list of {name, description, input_schema}")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            raise InvalidInput(f"tools[{i}]: only custom tools ({{name, input_schema}}) are "
                               "supported")
        functions.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description", ""),
            "parameters": tool.get("input_schema")}})
    parallel = True
    openai_choice: object = None
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool",
                                                                      "none"):
            raise InvalidInput("'tool_choice' must be {type: auto | any | tool | none}")
        parallel = not choice.get("disable_parallel_tool_use", False)
        openai_choice = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice["type"]) or {"type": "function", "function": {"name": choice.get("name")}}
    return tool_use(functions, openai_choice, parallel)


def parse_messages(body: object) -> CompletionRequest:
    """A Messages request as Shoal's chat request; InvalidInput names the first bad field."""
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object")
    check_fields(body, FIELDS, NEUTRAL)
    max_tokens = json_field(body, "max_tokens", (int,), "an integer")
    if max_tokens is None or max_tokens < 1:
        raise InvalidInput("'max_tokens' is required, and at least 1")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidInput("'stop_sequences' must be a list of non-empty strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidInput(f"'stop_sequences' takes at most {MAX_STOP_STRINGS} strings here")
    top_p = number_field(body, "top_p", 1.0, 0, 1)
    if top_p == 0:
        raise InvalidInput("'top_p' must be above 0")
    thinking = json_field(body, "thinking", (dict,), "an object")
    kwargs: tuple = ()
    if thinking is not None:
        if thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise InvalidInput("'thinking.type' must be enabled, disabled or adaptive")
        kwargs = (("enable_thinking", thinking["type"] != "disabled"),)
    top_k = json_field(body, "top_k", (int,), "an integer", 0)
    if top_k < 0:
        raise InvalidInput("'top_k' must be at least 0")
    sampling = Sampling(max_tokens=max_tokens, temperature=number_field(body, "temperature", 1.0,
                                                                   0, 1),
                        top_p=top_p, top_k=top_k, stop=tuple(stops),
                        speculative=json_field(body, "speculative", (bool,), "true or false",
                                               True))
    json_field(body, "model", (str,), "a string")
    output = json_field(body, "output_config", (dict,), "an object", {})
    for name in output:
        if name not in ("format", "effort"):
            raise InvalidInput(f"unknown field 'output_config.{name}'")
    if output.get("format") is not None:
        sampling = replace(sampling, grammar=response_format_grammar(
            {"type": "json_schema", "json_schema": output["format"]}))
    effort = json_field(output, "effort", (str,), "a string")
    return CompletionRequest(
        chat=True, messages=tuple(_messages(body.get("system"), body.get("messages"))),
        prompt="", sampling=sampling, max_tokens_given=True,
        stream=json_field(body, "stream", (bool,), "true or false", False), include_usage=True,
        tools=_tools(body.get("tools"), body.get("tool_choice")), template_kwargs=kwargs,
        reasoning_effort=effort)


# ---------------------------------------------------------------------------------------
# Answers


def error_json(message: str, status: int) -> dict:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            408: "invalid_request_error", 413: "request_too_large",
            503: "overloaded_error"}.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _usage(event: Event, prompt_tokens: int) -> dict:
    u = event.usage
    return {"input_tokens": u.prompt_tokens if u else prompt_tokens,
            "output_tokens": u.completion_tokens if u else 0,
            "cache_read_input_tokens": u.cached_tokens if u else 0,
            "cache_tier": u.cache_tier if u else None}


def _stop(reader: CallReader, event: Event, request: CompletionRequest) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if reader.made_calls and event.finish_reason == "stop":
        return "tool_use", None
    if event.stop is not None and event.stop in request.sampling.stop:
        return "stop_sequence", event.stop
    return STOP_REASONS.get(event.finish_reason or "", "end_turn"), None


def _blocks(piece: Piece) -> list[dict]:
    blocks = [{"type": "text", "text": piece.text}] if piece.text else []
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments}
               for c in piece.calls]
    return blocks


def message_json(tokenizer, request: CompletionRequest, events_: list[Event], model: str,
                 prompt_tokens: int) -> dict:
    last = events_[-1]
    reader = CallReader(tokenizer, request.tools)
    piece = reader.feed("".join(e.text for e in events_), last=True)
    reason, sequence = _stop(reader, last, request)
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": model, "content": _blocks(piece), "stop_reason": reason,
            "stop_sequence": sequence, "usage": _usage(last, prompt_tokens)}


def _event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


class MessageStream:
    """A streamed answer's server-sent events in Anthropic's order: message_start, then per
    content block a start, its deltas and a stop, then message_delta and message_stop."""

    def __init__(self, tokenizer, request: CompletionRequest, model: str,
                 prompt_tokens: int) -> None:
        self.request, self.prompt_tokens = request, prompt_tokens
        self.reader = CallReader(tokenizer, request.tools)
        self.index = 0
        self.text_open = False
        self.start = _event("message_start", {"message": {
            "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})

    def _close_text(self) -> list[bytes]:
        if not self.text_open:
            return []
        self.text_open = False
        self.index += 1
        return [_event("content_block_stop", {"index": self.index - 1})]

    def feed(self, event: Event) -> list[bytes]:
        out: list[bytes] = []
        piece = self.reader.feed(event.text, last=event.finish_reason is not None)
        if piece.text:
            if not self.text_open:
                out.append(_event("content_block_start", {
                    "index": self.index, "content_block": {"type": "text", "text": ""}}))
                self.text_open = True
            out.append(_event("content_block_delta", {
                "index": self.index, "delta": {"type": "text_delta", "text": piece.text}}))
        for call in piece.calls:
            out += self._close_text()
            out.append(_event("content_block_start", {"index": self.index, "content_block": {
                "type": "tool_use", "id": call.id, "name": call.name, "input": {}}}))
            out.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": call.arguments_json}}))
            out.append(_event("content_block_stop", {"index": self.index}))
            self.index += 1
        if event.finish_reason is not None:
            out += self._close_text()
            reason, sequence = _stop(self.reader, event, self.request)
            out.append(_event("message_delta", {
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": _usage(event, self.prompt_tokens)["output_tokens"]}}))
            out.append(_event("message_stop", {}))
        return out


# ---------------------------------------------------------------------------------------
# Routes


def routes(service: Service, guard: Callable) -> list[Route]:
    async def messages(request: Request) -> Response:
        try:
            parsed, prompt = await read_request(
                service, request,
                lambda body: service.prepare(parse_messages(service.check_model(body))))
            parsed = fit_to_context(parsed, len(prompt), service.context)
            service.check_serving()
            if parsed.stream:
                return StreamingResponse(_stream(parsed, prompt),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            gathered = await gather(service.engine, request, prompt, parsed.sampling)
            if gathered is None:
                return Response(status_code=499)
            if gathered[-1].error is not None:
                raise gathered[-1].error
            return JSONResponse(message_json(service.tokenizer, parsed, gathered,
                                             service.model_id, len(prompt)))
        except ShoalError as e:
            return JSONResponse(error_json(str(e), status_of(e)), status_of(e))

    async def _stream(parsed: CompletionRequest, prompt: list[int]) -> AsyncIterator[bytes]:
        stream = MessageStream(service.tokenizer, parsed, service.model_id, len(prompt))
        yield stream.start
        async for event in events(service.engine, prompt, parsed.sampling):
            if event is None:
                yield _event("ping", {})
            elif event.error is not None:
                yield _event("error", error_json(str(event.error), status_of(event.error)))
            else:
                for chunk in stream.feed(event):
                    yield chunk

    async def count_tokens(request: Request) -> Response:
        def count(body: object) -> list[int]:
            if isinstance(body, dict):  # counting needs no max_tokens
                body = {"max_tokens": DEFAULT_MAX_TOKENS, **body}
            return service.prepare(parse_messages(body))[1]

        try:
            prompt = await read_request(service, request, count)
        except ShoalError as e:
            return JSONResponse(error_json(str(e), status_of(e)), status_of(e))
        return JSONResponse({"input_tokens": len(prompt)})

    return [Route("/v1/messages", guard(messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", guard(count_tokens), methods=["POST"])]
