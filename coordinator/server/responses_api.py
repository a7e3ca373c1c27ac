"""OpenAI's Responses API (`POST /v1/responses`, streamed or not) on the same batch engine: a
request is read as the chat request it amounts to (openai_api.parse_request validates it),
its answer built as a Response, and kept for `previous_response_id` while the server runs."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from coordinator.server.answer_text import Event
from coordinator.server.answering import Service, events, gather, read_request, status_of
from coordinator.server.openai_answers import error_json
from coordinator.server.openai_api import (
    CompletionRequest,
    check_fields,
    fit_to_context,
    json_field,
    parse_request,
)
from coordinator.server.tools import CallReader, Piece
from engine.errors import InvalidInput, ShoalError

# Every field of the API's request (openai's ResponseCreateParams): "yes" honoured, "ignored"
# a label without effect on the answer, a message: refused with 400 unless at a NEUTRAL value.
FIELDS: dict[str, str] = {
    "model": "yes", "input": "yes", "instructions": "yes", "max_output_tokens": "yes",
    "temperature": "yes", "top_p": "yes", "tools": "yes", "tool_choice": "yes",
    "parallel_tool_calls": "yes", "previous_response_id": "yes", "stream": "yes",
    "stream_options": "yes", "store": "yes", "metadata": "yes", "text": "yes",
    "reasoning": "yes", "speculative": "yes",  # Shoal's own, as on /v1/chat/completions
    "user": "ignored", "safety_identifier": "ignored", "prompt_cache_key": "ignored",
    "top_logprobs": "'top_logprobs' is not supported on /v1/responses: "
    "/v1/chat/completions has log-probabilities",
    "include": "'include': Shoal adds nothing to the output: send [] or leave it out",
    "truncation": "'truncation': Shoal refuses a prompt past the context rather than drop "
    "its start: send disabled or leave it out",
    "background": "'background' responses are not supported: send false or leave it out",
    "background_options": "'background_options': background responses are not supported",
    "conversation": "'conversation': Shoal keeps no conversations: send "
    "previous_response_id",
    "prompt": "'prompt' (stored prompt templates) is not supported: send 'input'",
    "max_tool_calls": "'max_tool_calls' is not supported: leave it out",
    "service_tier": "'service_tier': Shoal has one tier: send auto or default, or leave it out",
    "prompt_cache_retention": "'prompt_cache_retention': Shoal's prompt cache keeps nothing "
    "for a promised time: send in_memory or leave it out",
    "prompt_cache_options": "'prompt_cache_options': Shoal's prompt cache finds shared "
    "prefixes by itself (mode implicit)",
    "context_management": "'context_management' is not supported: leave it out",
    "moderation": "'moderation' is not supported: leave it out",
    "access_programs": "'access_programs' is not supported: leave it out",
    "image": "'image': image generation is not supported",
}
NEUTRAL: dict[str, tuple] = {
    "include": ([],), "truncation": ("disabled",), "background": (False,),
    "service_tier": ("auto", "default"), "prompt_cache_retention": ("in_memory",),
    "prompt_cache_options": ({}, {"mode": "implicit"}),
}
KEPT = 1024  # responses kept for previous_response_id, the least recently used dropped


def _text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidInput(f"'{where}' must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            raise InvalidInput(f"'{where}[{j}]': only input_text and output_text parts are "
                               "supported")
        parts.append(json_field(part, "text", (str,), "a string", ""))
    return "".join(parts)


def input_messages(raw: object) -> list[dict]:
    """The `input` as chat messages: text, messages, function calls and their outputs."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise InvalidInput("'input' must be a string or a non-empty list of items")
    out: list[dict] = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = json_field(item, "role", (str,), "a string")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidInput(f"'input[{i}].role' must be user, assistant, system or "
                                   "developer")
            out.append({"role": role, "content": _text(item.get("content"),
                                                       f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": json_field(item, "call_id", (str,), "a string"), "type": "function",
                    "function": {"name": json_field(item, "name", (str,), "a string"),
                                 "arguments": json_field(item, "arguments", (str,),
                                                         "a string", "{}")}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool",
                        "tool_call_id": json_field(item, "call_id", (str,), "a string"),
                        "content": _text(output, f"input[{i}].output")})
        else:
            raise InvalidInput(f"'input[{i}].type' {json.dumps(kind)}: only message, "
                               "function_call and function_call_output items are supported")
    return out


def _tools(tools: object) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidInput("'tools' must be a list of function tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidInput(f"'tools[{i}].type': only function tools are supported")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: object) -> object:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidInput("'tool_choice' must be none, auto, required or "
                               '{"type": "function", "name": ...}')
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict) -> dict | None:
    for name in text:
        if name not in ("format", "verbosity"):
            raise InvalidInput(f"unknown field 'text.{name}'")
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidInput("'text.verbosity' is not supported: send medium or leave it out")
    form = json_field(text, "format", (dict,), "an object")
    if form is None or form.get("type") == "text":
        return None
    if form.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: form[k] for k in ("name", "schema", "strict", "description") if k in form}}
    return form  # json_object, or a type parse_request names in its refusal


def parse_response_request(body: object, history: list[dict]) -> CompletionRequest:
    """A Responses request as Shoal's chat request, after `history` (the conversation of
    its previous_response_id); InvalidInput names the first bad field."""
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object")
    check_fields(body, FIELDS, NEUTRAL)
    messages = list(history)
    instructions = json_field(body, "instructions", (str,), "a string")
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    messages += input_messages(body.get("input"))
    max_tokens = json_field(body, "max_output_tokens", (int,), "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise InvalidInput("'max_output_tokens' must be at least 1")
    reasoning = json_field(body, "reasoning", (dict,), "an object", {})
    if reasoning.get("summary") is not None or set(reasoning) - {"effort", "summary"}:
        raise InvalidInput("'reasoning' takes only 'effort' here")
    options = json_field(body, "stream_options", (dict,), "an object", {})
    if set(options) - {"include_obfuscation"}:
        raise InvalidInput("'stream_options' takes only include_obfuscation")
    chat = {"messages": messages, "max_tokens": max_tokens, "stream": body.get("stream"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": _tools(body.get("tools")), "tool_choice": _tool_choice(
                body.get("tool_choice")), "parallel_tool_calls": body.get("parallel_tool_calls"),
            "response_format": _response_format(json_field(body, "text", (dict,), "an object",
                                                           {})),
            "reasoning_effort": reasoning.get("effort"), "speculative": body.get("speculative")}
    return parse_request({k: v for k, v in chat.items() if v is not None}, chat=True)


# ---------------------------------------------------------------------------------------
# Answers


def _usage(event: Event | None, prompt_tokens: int) -> dict:
    u = event.usage if event is not None else None
    done = u.completion_tokens if u else 0
    return {"input_tokens": prompt_tokens, "output_tokens": done,
            "total_tokens": prompt_tokens + done,
            "input_tokens_details": {"cached_tokens": u.cached_tokens if u else 0,
                                     "cache_tier": u.cache_tier if u else None},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def _call_item(call, status: str = "completed") -> dict:
    return {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments_json, "status": status}


class Answer:
    """One response being made: its shell (the request's settings echoed), its output items
    as they come, and at the end the conversation kept for previous_response_id."""

    def __init__(self, service: Service, body: dict, request: CompletionRequest,
                 prompt_tokens: int) -> None:
        self.request, self.prompt_tokens = request, prompt_tokens
        self.reader = CallReader(service.tokenizer, request.tools)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex[:24]}"
        self.text, self.calls = "", []
        self.shell = {
            "id": self.id, "object": "response", "created_at": int(time.time()),
            "model": service.model_id, "status": "in_progress", "error": None,
            "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "output": [],
            "parallel_tool_calls": request.tools.parallel,
            "previous_response_id": body.get("previous_response_id"),
            "temperature": request.sampling.temperature, "top_p": request.sampling.top_p,
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "text": body.get("text") or {"format": {"type": "text"}},
            "reasoning": body.get("reasoning") or {}, "store": body.get("store", True),
            "truncation": "disabled", "usage": None,
        }

    def feed(self, event: Event) -> Piece:
        piece = self.reader.feed(event.text, last=event.finish_reason is not None)
        self.text += piece.text
        self.calls += piece.calls
        return piece

    def output(self) -> list[dict]:
        items = [_message_item(self.message_id, self.text, "completed")] if self.text else []
        return items + [_call_item(c) for c in self.calls]

    def final(self, last: Event) -> dict:
        length = last.finish_reason == "length"
        return {**self.shell, "status": "incomplete" if length else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if length else None,
                "output": self.output(), "usage": _usage(last, self.prompt_tokens)}

    def conversation(self) -> list[dict]:
        """The request's messages without its instructions, then this answer's."""
        said: dict = {"role": "assistant", "content": self.text}
        if self.calls:
            said["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments_json}} for c in self.calls]
        messages = list(self.request.messages)
        if self.shell["instructions"] and messages and messages[0]["role"] == "system":
            messages = messages[1:]
        return [*messages, said]


def _sse(kind: str, data: dict, sequence: int) -> bytes:
    body = {"type": kind, "sequence_number": sequence, **data}
    return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()


# ---------------------------------------------------------------------------------------
# Routes


def routes(service: Service, guard: Callable) -> list[Route]:
    kept: OrderedDict[str, list[dict]] = OrderedDict()

    def keep(answer: Answer) -> None:
        if answer.shell["store"] is not False:
            kept[answer.id] = answer.conversation()
            while len(kept) > KEPT:
                kept.popitem(last=False)

    def parse(body: object) -> tuple[CompletionRequest, list[int], dict]:
        history: list[dict] = []
        if isinstance(body, dict) and body.get("previous_response_id") is not None:
            previous = json_field(body, "previous_response_id", (str,), "a string")
            if previous not in kept:
                raise InvalidInput(f"'previous_response_id': no response {previous} is kept here "
                               "(responses are kept while the server runs)")
            history = kept[previous]
        parsed, prompt = service.prepare(parse_response_request(body, history))
        return parsed, prompt, body

    async def create(request: Request) -> Response:
        try:
            parsed, prompt, body = await read_request(service, request, parse)
            parsed = fit_to_context(parsed, len(prompt), service.context)
            service.check_serving()
            answer = Answer(service, body, parsed, len(prompt))
            if parsed.stream:
                return StreamingResponse(_stream(answer, prompt), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            gathered = await gather(service.engine, request, prompt, parsed.sampling)
            if gathered is None:
                return Response(status_code=499)
            if gathered[-1].error is not None:
                raise gathered[-1].error
            for event in gathered:
                answer.feed(event)
            keep(answer)
            return JSONResponse(answer.final(gathered[-1]))
        except ShoalError as e:
            kind = "invalid_request_error" if status_of(e) < 500 else "server_error"
            return JSONResponse(error_json(str(e), kind, status_of(e)), status_of(e))

    async def _stream(answer: Answer, prompt: list[int]) -> AsyncIterator[bytes]:
        n = 0

        def sse(kind: str, **data: object) -> bytes:
            nonlocal n
            n += 1
            return _sse(kind, data, n - 1)

        yield sse("response.created", response=answer.shell)
        yield sse("response.in_progress", response=answer.shell)
        mid, text_open = answer.message_id, False
        async for event in events(service.engine, prompt, answer.request.sampling):
            if event is None:
                continue
            if event.error is not None:
                yield sse("error", code=str(status_of(event.error)),
                          message=str(event.error), param=None)
                return
            piece = answer.feed(event)
            where = {"item_id": mid, "output_index": 0, "content_index": 0}
            if piece.text and not text_open:
                text_open = True
                yield sse("response.output_item.added", output_index=0,
                          item=_message_item(mid, "", "in_progress") | {"content": []})
                yield sse("response.content_part.added", **where, part={
                    "type": "output_text", "text": "", "annotations": [], "logprobs": []})
            if piece.text:
                yield sse("response.output_text.delta", **where, delta=piece.text, logprobs=[])
            if event.finish_reason is None:
                continue
            final = answer.final(event)
            if text_open:
                item = final["output"][0]
                yield sse("response.output_text.done", **where, text=answer.text, logprobs=[])
                yield sse("response.content_part.done", **where, part=item["content"][0])
                yield sse("response.output_item.done", output_index=0, item=item)
            for i, call in enumerate(answer.calls, start=int(text_open)):
                item = _call_item(call)
                yield sse("response.output_item.added", output_index=i,
                          item=item | {"arguments": "", "status": "in_progress"})
                yield sse("response.function_call_arguments.delta", item_id=item["id"],
                          output_index=i, delta=item["arguments"])
                yield sse("response.function_call_arguments.done", item_id=item["id"],
                          output_index=i, arguments=item["arguments"], name=call.name)
                yield sse("response.output_item.done", output_index=i, item=item)
            keep(answer)
            kind = "response.completed" if final["status"] == "completed" else (
                "response.incomplete")
            yield sse(kind, response=final)

    return [Route("/v1/responses", guard(create), methods=["POST"])]
