"""The OpenAI API's shapes, as pure functions of plain data: a chat or text completion
request validated from its JSON body (each 400 with a message), and the answers built from the
batch engine's events (whole bodies, streamed chunks, usage, log-probabilities, errors).
No HTTP here: coordinator/serve.py carries these over Starlette."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, replace

from mlx_lm.tokenizer_utils import TokenizerWrapper

from coordinator.batching import Event, Sampling, TokenLogprob
from coordinator.generate import encode_text, render_messages
from engine.errors import InvalidInput

DEFAULT_MAX_TOKENS = 512  # when a request gives none, at most this many (and the context)
MAX_STOP_STRINGS = 4  # as the OpenAI API allows
MAX_TOP_LOGPROBS = 20
MAX_JSON_DEPTH = 32  # the API's deepest field is 4 levels down (messages[i].content[j].text)


# ---------------------------------------------------------------------------------------
# Requests: validated from the JSON body, before anything is tokenized


@dataclass(frozen=True)
class CompletionRequest:
    chat: bool
    messages: tuple[dict, ...]  # chat: {"role", "content"} with text content
    prompt: str | tuple[int, ...]  # text completions: text or token ids
    sampling: Sampling
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    echo: bool = False


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


def _field(body: dict, name: str, kinds: tuple[type, ...], what: str, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    # JSON true/false are Python ints too: a number field must not take them
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise InvalidInput(f"'{name}' must be {what}, got {json.dumps(value)[:80]}")
    return value


def _text_content(content: object, index: int) -> str:
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
                raise InvalidInput(f"messages[{index}].content: only text parts are supported "
                                   '({"type": "text", "text": "..."})')
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidInput(f"messages[{index}].content must be a string or a list of text parts")


def parse_request(body: object, *, chat: bool) -> CompletionRequest:
    """A chat (`/v1/chat/completions`) or text (`/v1/completions`) request from its JSON
    body; raises InvalidInput naming the first bad field. Fields the API has and Shoal does
    not use (user, metadata, ...) are ignored; fields that would change the answer and that
    Shoal cannot honour are refused."""
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object")
    messages: tuple[dict, ...] = ()
    prompt: str | tuple[int, ...] = ""
    if chat:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise InvalidInput("'messages' must be a non-empty list of {role, content}")
        out = []
        for i, message in enumerate(raw):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise InvalidInput(f"messages[{i}] must be an object with a string 'role'")
            out.append({"role": message["role"],
                        "content": _text_content(message.get("content"), i)})
        messages = tuple(out)
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
    n = _field(body, "n", (int,), "an integer", 1)
    if n != 1:
        raise InvalidInput("'n' must be 1: Shoal returns one choice per request")
    for name in ("presence_penalty", "frequency_penalty"):
        if _field(body, name, (int, float), "a number", 0) != 0:
            raise InvalidInput(f"'{name}' is not supported; leave it out or at 0")
    if _field(body, "best_of", (int,), "an integer", 1) != 1:
        raise InvalidInput("'best_of' must be 1")
    limit = body.get("max_completion_tokens") if chat else None
    name = "max_completion_tokens" if limit is not None else "max_tokens"
    max_tokens = _field(body, name, (int,), "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise InvalidInput(f"'{name}' must be at least 1, got {max_tokens}")
    temperature = _field(body, "temperature", (int, float), "a number", 1.0)
    if not 0 <= temperature <= 2:
        raise InvalidInput(f"'temperature' must be between 0 and 2, got {temperature}")
    top_p = _field(body, "top_p", (int, float), "a number", 1.0)
    if not 0 < top_p <= 1:
        raise InvalidInput(f"'top_p' must be above 0 and at most 1, got {top_p}")
    seed = _field(body, "seed", (int,), "an integer")
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
        if _field(body, "logprobs", (bool,), "true or false", False):
            top = _field(body, "top_logprobs", (int,), "an integer", 0)
        elif body.get("top_logprobs") is not None:
            raise InvalidInput("'top_logprobs' needs 'logprobs': true")
    else:
        top = _field(body, "logprobs", (int,), "an integer")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidInput(f"top log-probabilities must be between 0 and {MAX_TOP_LOGPROBS}")
    stream = _field(body, "stream", (bool,), "true or false", False)
    options = _field(body, "stream_options", (dict,), "an object", {})
    include_usage = _field(options, "include_usage", (bool,), "true or false", False)
    echo = False if chat else _field(body, "echo", (bool,), "true or false", False)
    _field(body, "model", (str,), "a string")
    sampling = Sampling(max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
                        temperature=float(temperature), top_p=float(top_p), seed=seed,
                        stop=stops, top_logprobs=top)
    return CompletionRequest(chat, messages, prompt, sampling, max_tokens is not None,
                             stream, include_usage, echo)


def fit_to_context(request: CompletionRequest, prompt_tokens: int,
                   context: int) -> CompletionRequest:
    """Refuse a prompt that leaves no room to answer, and a max_tokens past the context; a
    request that gave no max_tokens gets what is left, up to DEFAULT_MAX_TOKENS."""
    room = context - prompt_tokens
    if room < 1:
        raise InvalidInput(f"the prompt has {prompt_tokens} tokens; this model's context "
                           f"holds {context}, the prompt and the answer together")
    asked = request.sampling.max_tokens
    if request.max_tokens_given and asked > room:
        raise InvalidInput(f"max_tokens {asked} does not fit: the prompt has {prompt_tokens} "
                           f"tokens of the context's {context}, leaving {room}")
    return replace(request, sampling=replace(request.sampling, max_tokens=min(asked, room)))


def longest_token(tokenizer: TokenizerWrapper) -> int:
    """The most UTF-8 bytes one token's text in the vocabulary takes. A byte-level or
    SentencePiece vocabulary spells a token with at least as many bytes as it stands for, so
    no token covers more of a prompt than this."""
    return max((len(text.encode("utf-8", "replace")) for text in tokenizer.get_vocab()),
               default=1)


def prompt_tokens(tokenizer: TokenizerWrapper, request: CompletionRequest, vocab: int, *,
                  context: int, longest: int) -> list[int]:
    """The request's prompt as token ids, the chat template applied as mlx-lm does; token
    ids given must be below the model's `vocab` size. A text that cannot fit the `context`
    whatever its tokens (at most `longest` bytes each) is refused before it is tokenized,
    which for a text of megabytes takes seconds."""
    if isinstance(request.prompt, tuple) and not request.chat:
        if max(request.prompt) >= vocab:
            raise InvalidInput(f"token id {max(request.prompt)} is outside the vocabulary "
                               f"({vocab} tokens)")
        return list(request.prompt)
    if request.chat:
        try:
            text = render_messages(tokenizer, list(request.messages))
        except InvalidInput:
            raise
        except Exception as e:  # the template itself refused (e.g. roles out of order)
            raise InvalidInput(f"the chat template refused these messages: {e}") from None
    else:
        text = request.prompt
    size = len(text.encode("utf-8"))
    fewest = -(-size // max(longest, 1))
    if fewest >= context:
        raise InvalidInput(f"the prompt has at least {fewest} tokens ({size} bytes); this "
                           f"model's context holds {context}, the prompt and the answer "
                           "together")
    return encode_text(tokenizer, text)


# ---------------------------------------------------------------------------------------
# Answers in the OpenAI API's shapes


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
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def error_json(message: str, kind: str, status: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def completion_json(tokenizer: TokenizerWrapper, request: CompletionRequest,
                    prompt: list[int], events: list[Event], meta: dict) -> dict:
    """A whole (not streamed) answer's body from all of its events, the last one finished."""
    last = events[-1]
    text = "".join(e.text for e in events)
    scores = tuple(s for e in events for s in e.logprobs)
    want_scores = request.sampling.top_logprobs is not None
    if request.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": chat_logprobs(tokenizer, scores) if want_scores else None,
                  "finish_reason": last.finish_reason}
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


def chunk_json(tokenizer: TokenizerWrapper, request: CompletionRequest, event: Event,
               meta: dict, *, first: bool) -> dict:
    """One streamed chunk: `event`'s text (the first chat chunk also names the role)."""
    scores = None
    if request.sampling.top_logprobs is not None:
        scores = (chat_logprobs if request.chat else text_logprobs)(tokenizer, event.logprobs)
    if request.chat:
        delta = {"role": "assistant", "content": event.text} if first else (
            {"content": event.text} if event.text or not event.finish_reason else {})
        choice = {"index": 0, "delta": delta, "logprobs": scores,
                  "finish_reason": event.finish_reason}
    else:
        choice = {"index": 0, "text": event.text, "logprobs": scores,
                  "finish_reason": event.finish_reason}
    out = {**meta, "object": _chunk_object(request), "choices": [choice]}
    if request.include_usage:
        out["usage"] = None
    return out


def usage_chunk_json(request: CompletionRequest, event: Event, meta: dict) -> dict:
    """The chunk after the last one when the client asked for usage: no choices."""
    return {**meta, "object": _chunk_object(request), "choices": [], "usage": usage_json(event)}
