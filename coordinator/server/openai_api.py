"""The OpenAI API's requests, as pure functions of plain data: a chat or text completion
validated from its JSON body (each 400 with a message); openai_answers.py builds the answers.
No HTTP here: coordinator/server/http_server.py carries these over Starlette."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from coordinator.server.grammars import response_format_grammar
from coordinator.server.sampling import Sampling
from coordinator.server.tools import (
    ToolUse,
    check_function,
    tool_use,
)
from engine.errors import InvalidInput

DEFAULT_MAX_TOKENS = 512  # when a request gives none, at most this many (and the context)
MAX_STOP_STRINGS = 4  # as the OpenAI API allows
MAX_TOP_LOGPROBS = 20
# The APIs' own fields go 6 levels down (an Anthropic tool result's messages[i].content[j]
# .content[k].text); the rest is room for the JSON schemas of tools and response_format.
MAX_JSON_DEPTH = 32


# ---------------------------------------------------------------------------------------
# Requests: validated from the JSON body, before anything is tokenized


# The OpenAI API's request fields, each with what Shoal does with it: every field of the
# API's chat and completions schemas is here, so that none is silently dropped. "yes":
# honoured; "ignored": it only labels the request, and is taken without effect on the
# answer; a message: refused with 400 when given, unless at a neutral value (NEUTRAL), one
# that asks for nothing Shoal does not do. Fields marked mlx-lm are mlx-lm server's
# extensions, honoured the same way.
CHAT_FIELDS: dict[str, str] = {
    "messages": "yes", "model": "yes", "max_tokens": "yes", "max_completion_tokens": "yes",
    "temperature": "yes", "top_p": "yes", "seed": "yes", "stop": "yes", "logprobs": "yes",
    "top_logprobs": "yes", "stream": "yes", "stream_options": "yes", "n": "yes",
    "presence_penalty": "yes", "frequency_penalty": "yes", "logit_bias": "yes",
    "tools": "yes", "tool_choice": "yes", "parallel_tool_calls": "yes",
    "response_format": "yes", "reasoning_effort": "yes", "modalities": "yes",
    "user": "ignored", "metadata": "ignored", "safety_identifier": "ignored",
    "prompt_cache_key": "ignored",
    "store": "'store': Shoal keeps no answers: send false or leave it out",
    "service_tier": "'service_tier': Shoal has one tier: send auto or default, or leave it out",
    "prompt_cache_retention": "'prompt_cache_retention': Shoal's prompt cache (memory, then "
    "disk) is bounded by --prompt-cache-bytes and --prompt-cache-disk, and keeps nothing for "
    "a promised time: send in_memory or leave it out",
    "prompt_cache_options": "'prompt_cache_options': Shoal's prompt cache finds shared "
    "prefixes by itself (mode implicit); it takes no breakpoints and promises no lifetime",
    "prediction": "'prediction' (predicted outputs) is not supported: leave it out",
    "moderation": "'moderation' is not supported: leave it out",
    "audio": "'audio': audio output is not supported",
    "functions": "the deprecated 'functions' is not supported: send 'tools'",
    "function_call": "the deprecated 'function_call' is not supported: send 'tool_choice'",
    "verbosity": "'verbosity' is not supported: send medium or leave it out",
    "web_search_options": "'web_search_options': web search is not supported",
}
COMPLETION_FIELDS: dict[str, str] = {
    "prompt": "yes", "model": "yes", "max_tokens": "yes", "temperature": "yes", "top_p": "yes",
    "seed": "yes", "stop": "yes", "logprobs": "yes", "stream": "yes", "stream_options": "yes",
    "n": "yes", "best_of": "yes", "echo": "yes", "presence_penalty": "yes",
    "frequency_penalty": "yes", "logit_bias": "yes", "response_format": "yes",
    "user": "ignored",
    "suffix": "'suffix' (fill in the middle) is not supported: leave it out",
    "chat_template_kwargs": "'chat_template_kwargs' is for /v1/chat/completions",
}
MLX_LM_FIELDS: dict[str, str] = {  # mlx-lm's server takes these on both routes
    "top_k": "yes", "min_p": "yes", "repetition_penalty": "yes",
    "repetition_context_size": "yes", "presence_context_size": "yes",
    "frequency_context_size": "yes", "chat_template_kwargs": "yes",
    "speculative": "yes",  # Shoal's own: false keeps the request off the draft
}
NEUTRAL: dict[str, tuple] = {  # values of refused fields that ask for what Shoal does anyway
    "store": (False,), "service_tier": ("auto", "default"),
    "prompt_cache_retention": ("in_memory",), "verbosity": ("medium",),
    "prompt_cache_options": ({}, {"mode": "implicit"}, {"ttl": "30m"},
                             {"mode": "implicit", "ttl": "30m"}),
}
_CHAT_KNOWN = {**MLX_LM_FIELDS, **CHAT_FIELDS}
_TEXT_KNOWN = {**MLX_LM_FIELDS, **COMPLETION_FIELDS}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass(frozen=True)
class CompletionRequest:
    chat: bool
    messages: tuple[dict, ...]  # chat: role, text content, tool calls and their ids
    prompt: str | tuple[int, ...]  # text completions: text or token ids
    sampling: Sampling
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    echo: bool = False
    tools: ToolUse = ToolUse()
    template_kwargs: tuple[tuple[str, object], ...] = ()  # for the chat template
    reasoning_effort: str | None = None
    context: int | None = None  # a smaller context the request asks for (Ollama's num_ctx)


def decode_body(body: bytes) -> object:
    """A request body's JSON; refused (InvalidInput) when it is not JSON, nests deeper than
    MAX_JSON_DEPTH, or holds a string that is not Unicode (a lone surrogate such as
    "\\ud800", which JSON can spell and no tokenizer can encode)."""
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidInput(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # the decoder's own guard, about 1000 levels down
        raise InvalidInput(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    _check_tree(value)
    return value


def _check_tree(value: object) -> None:
    """Depth and Unicode of every node, walked without recursion (the point is to refuse
    what would exhaust the stack of code that recurses: json.dumps, templates)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise InvalidInput("the request holds a string that is not valid Unicode "
                                       "(a lone surrogate such as \\ud800)") from None
            continue
        if depth > MAX_JSON_DEPTH:
            raise InvalidInput(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((k, depth) for k in item)
            children = item.values()
        else:
            children = item
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (str, list, dict)))


def json_field(body: dict, name: str, kinds: tuple[type, ...], what: str, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    # JSON true/false are Python ints too: a number field must not take them
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise InvalidInput(f"'{name}' must be {what}, got {json.dumps(value)[:80]}")
    return value


def number_field(body: dict, name: str, default: float, low: float | None = None,
            high: float | None = None) -> float:
    value = float(json_field(body, name, (int, float), "a number", default))
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
        raise InvalidInput(f"'{name}' must be {bounds}, got {value:g}")
    return value


def _count(body: dict, name: str, default: int) -> int:
    value = json_field(body, name, (int,), "an integer", default)
    if value < 0:
        raise InvalidInput(f"'{name}' must be at least 0, got {value}")
    return value


def _text_content(content: object, where: str) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str
            ):
                raise InvalidInput(f"{where}: only text parts are supported "
                                   '({"type": "text", "text": "..."})')
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidInput(f"{where} must be a string or a list of text parts")


def _message(message: object, i: int) -> dict:
    """One chat message for the template: its role and text, an assistant's tool calls, a
    tool message's call id (and a name where given)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidInput(f"messages[{i}] must be an object with a string 'role'")
    role = "system" if message["role"] == "developer" else message["role"]
    out: dict = {"role": role, "content": _text_content(message.get("content"),
                                                        f"messages[{i}].content")}
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise InvalidInput(f"messages[{i}].tool_calls must be a list, on an assistant "
                               "message")
        for j, call in enumerate(calls):
            if not isinstance(call, dict):
                raise InvalidInput(f"messages[{i}].tool_calls[{j}] must be an object")
            check_function(call.get("function"), f"messages[{i}].tool_calls[{j}].function")
        out["tool_calls"] = calls
    for name in ("tool_call_id", "name"):
        if message.get(name) is not None:
            out[name] = json_field(message, name, (str,), "a string")
    if role == "tool" and "tool_call_id" not in out:
        raise InvalidInput(f"messages[{i}]: a tool message needs its 'tool_call_id'")
    return out


def check_fields(body: dict, known: dict[str, str], neutral: dict[str, tuple],
                 what: str = "field") -> None:
    """Refuse a field Shoal does not honour, naming it: one of the API's that Shoal cannot do
    (`known` gives the message), unless at one of its `neutral` values, or one the API does
    not have. The OpenAI, Anthropic and Ollama routes each check their table with this."""
    for name, value in body.items():
        status = known.get(name)
        if status is None:
            raise InvalidInput(f"unknown {what} '{name}': Shoal does not know it, so it "
                               "cannot honour it (docs/serving.md lists the fields)")
        if status not in ("yes", "ignored") and value is not None and not any(
            _same(value, n) for n in neutral.get(name, ())
        ):
            raise InvalidInput(status)


def _same(value: object, neutral: object) -> bool:
    """JSON equality: 1 and 1.0 are one number, true is not 1."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def _sampling_knobs(body: dict) -> dict:
    """mlx-lm's sampling fields and the API's penalties, validated as mlx-lm's server does."""
    bias = json_field(body, "logit_bias", (dict,), "an object of token id -> bias", {})
    try:
        logit_bias = tuple((int(k), float(v)) for k, v in bias.items())
    except (TypeError, ValueError):
        raise InvalidInput("'logit_bias' must map token ids to numbers") from None
    if any(t < 0 or not -100 <= b <= 100 for t, b in logit_bias):
        raise InvalidInput("'logit_bias' takes token ids (0 and up) to biases from -100 "
                           "to 100")
    return {
        "top_k": _count(body, "top_k", 0), "min_p": number_field(body, "min_p", 0.0, 0, 1),
        "logit_bias": logit_bias,
        "repetition_penalty": number_field(body, "repetition_penalty", 0.0, 0),
        "repetition_context_size": _count(body, "repetition_context_size", 20),
        "presence_penalty": number_field(body, "presence_penalty", 0.0, -2, 2),
        "presence_context_size": _count(body, "presence_context_size", 20),
        "frequency_penalty": number_field(body, "frequency_penalty", 0.0, -2, 2),
        "frequency_context_size": _count(body, "frequency_context_size", 20),
        "speculative": json_field(body, "speculative", (bool,), "true or false", True),
    }


def parse_request(body: object, *, chat: bool) -> CompletionRequest:
    """A chat (`/v1/chat/completions`) or text (`/v1/completions`) request from its JSON
    body; raises InvalidInput naming the first bad field. Every field is checked against the
    API's list (CHAT_FIELDS, COMPLETION_FIELDS, MLX_LM_FIELDS): honoured, a label taken
    without effect, or refused; a field in none of them is refused too."""
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object")
    check_fields(body, _CHAT_KNOWN if chat else _TEXT_KNOWN, NEUTRAL)
    messages: tuple[dict, ...] = ()
    prompt: str | tuple[int, ...] = ""
    if chat:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise InvalidInput("'messages' must be a non-empty list of {role, content}")
        messages = tuple(_message(m, i) for i, m in enumerate(raw))
        modalities = body.get("modalities")
        if modalities is not None and modalities != ["text"]:
            raise InvalidInput("'modalities' can only be [\"text\"]")
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
            raw = raw[0]
        if isinstance(raw, str):
            prompt = raw
        elif isinstance(raw, list) and raw and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in raw
        ):
            prompt = tuple(raw)
        else:
            raise InvalidInput("'prompt' must be a string, or a list of token ids")
    n = json_field(body, "n", (int,), "an integer", 1)
    if n != 1:
        raise InvalidInput("'n' must be 1: Shoal returns one choice per request")
    if json_field(body, "best_of", (int,), "an integer", 1) != 1:
        raise InvalidInput("'best_of' must be 1")
    limit = body.get("max_completion_tokens") if chat else None
    name = "max_completion_tokens" if limit is not None else "max_tokens"
    max_tokens = json_field(body, name, (int,), "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise InvalidInput(f"'{name}' must be at least 1, got {max_tokens}")
    temperature = number_field(body, "temperature", 1.0, 0, 2)
    top_p = json_field(body, "top_p", (int, float), "a number", 1.0)
    if not 0 < top_p <= 1:
        raise InvalidInput(f"'top_p' must be above 0 and at most 1, got {top_p}")
    seed = json_field(body, "seed", (int,), "an integer")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise InvalidInput("'stop' must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise InvalidInput(f"'stop' takes at most {MAX_STOP_STRINGS} non-empty strings")
    if chat:
        top = None
        if json_field(body, "logprobs", (bool,), "true or false", False):
            top = json_field(body, "top_logprobs", (int,), "an integer", 0)
        elif body.get("top_logprobs") is not None:
            raise InvalidInput("'top_logprobs' needs 'logprobs': true")
    else:
        top = json_field(body, "logprobs", (int,), "an integer")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidInput(f"top log-probabilities must be between 0 and {MAX_TOP_LOGPROBS}")
    stream = json_field(body, "stream", (bool,), "true or false", False)
    options = json_field(body, "stream_options", (dict,), "an object", {})
    include_usage = json_field(options, "include_usage", (bool,), "true or false", False)
    echo = False if chat else json_field(body, "echo", (bool,), "true or false", False)
    json_field(body, "model", (str,), "a string")
    grammar = None
    if body.get("response_format") is not None:
        grammar = response_format_grammar(body["response_format"])
    tools = tool_use(body.get("tools"), body.get("tool_choice"),
                     body.get("parallel_tool_calls")) if chat else ToolUse()
    if grammar is not None and tools.choice in ("required", "function"):
        raise InvalidInput("'response_format' and a forced 'tool_choice' cannot both hold "
                           "the answer: send one of them")
    kwargs = json_field(body, "chat_template_kwargs", (dict,), "an object", {})
    effort = json_field(body, "reasoning_effort", (str,), "a string")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise InvalidInput(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}")
    sampling = Sampling(max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
                        temperature=temperature, top_p=float(top_p), seed=seed,
                        stop=stops, top_logprobs=top, grammar=grammar,
                        keep_leading_space=not chat, **_sampling_knobs(body))
    return CompletionRequest(chat, messages, prompt, sampling, max_tokens is not None,
                             stream, include_usage, echo, tools,
                             tuple(sorted(kwargs.items())), effort)


def fit_to_context(request: CompletionRequest, prompt_tokens: int,
                   context: int) -> CompletionRequest:
    """Refuse a prompt that leaves no room to answer, and a max_tokens past the context (the
    model's, or the smaller one the request asks for); a request that gave no max_tokens gets
    what is left, up to DEFAULT_MAX_TOKENS."""
    holder = "this model's context"
    if request.context is not None and request.context < context:
        context, holder = request.context, "the context this request asks for ('num_ctx')"
    room = context - prompt_tokens
    if room < 1:
        raise InvalidInput(f"the prompt has {prompt_tokens} tokens; {holder} holds {context}, "
                           "the prompt and the answer together")
    asked = request.sampling.max_tokens
    if request.max_tokens_given and asked > room:
        raise InvalidInput(f"max_tokens {asked} does not fit: the prompt has {prompt_tokens} "
                           f"tokens of the context's {context}, leaving {room}")
    return replace(request, sampling=replace(request.sampling, max_tokens=min(asked, room)))
