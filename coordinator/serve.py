"""`shoal serve`: the OpenAI API over the cluster (chat and text completions, streamed as
server-sent events or not, the model list, health), with every request decoded in one
shared batch (coordinator/batching.py).

The HTTP side is Starlette on uvicorn: request parsing and validation are pure functions of
the JSON body (so each 400 has a message and a test), answers are built from the engine's
events, and a client that goes away cancels its request, which frees its row in the batch.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from mlx_lm.tokenizer_utils import TokenizerWrapper
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from coordinator.batching import BatchEngine, Event, Sampling, TokenLogprob
from coordinator.cluster import layer_sizes
from coordinator.generate import encode_messages, encode_text
from coordinator.membership import Membership
from engine.errors import InvalidInput, NotFound, ShoalError, Unavailable
from engine.manifest import Manifest
from engine.placement import replica_routes

DEFAULT_MAX_TOKENS = 512  # when a request gives none, at most this many (and the context)
MAX_STOP_STRINGS = 4  # as the OpenAI API allows
MAX_TOP_LOGPROBS = 20
HEARTBEAT = 15.0  # seconds between SSE comments while a streamed answer waits for tokens


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


def prompt_tokens(tokenizer: TokenizerWrapper, request: CompletionRequest,
                  vocab: int) -> list[int]:
    """The request's prompt as token ids, the chat template applied as mlx-lm does; token
    ids given must be below the model's `vocab` size."""
    if request.chat:
        try:
            return encode_messages(tokenizer, list(request.messages))
        except InvalidInput:
            raise
        except Exception as e:  # the template itself refused (e.g. roles out of order)
            raise InvalidInput(f"the chat template refused these messages: {e}") from None
    if isinstance(request.prompt, tuple):
        if max(request.prompt) >= vocab:
            raise InvalidInput(f"token id {max(request.prompt)} is outside the vocabulary "
                               f"({vocab} tokens)")
        return list(request.prompt)
    return encode_text(tokenizer, request.prompt)


# ---------------------------------------------------------------------------------------
# Health: every expert must have a live owner


def missing_experts(membership: Membership, manifest: Manifest) -> str | None:
    """Why the cluster cannot serve every expert now (naming them), or None."""
    _, _, holdings = membership.live()
    try:
        replica_routes(layer_sizes(manifest), holdings)
    except Unavailable as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------
# Answers in the OpenAI API's shapes


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


def _error_response(error: ShoalError) -> JSONResponse:
    if isinstance(error, InvalidInput):
        return JSONResponse(error_json(str(error), "invalid_request_error", 400), 400)
    if isinstance(error, NotFound):
        return JSONResponse(error_json(str(error), "not_found_error", 404), 404)
    if isinstance(error, Unavailable):
        return JSONResponse(error_json(str(error), "unavailable", 503), 503)
    return JSONResponse(error_json(str(error), "server_error", 500), 500)


# ---------------------------------------------------------------------------------------
# The service: what the routes share


@dataclass
class Service:
    engine: BatchEngine
    tokenizer: TokenizerWrapper
    manifest: Manifest
    membership: Membership
    model_id: str
    context: int
    api_key: str | None = None
    started: int = 0

    @property
    def vocab(self) -> int:
        """Token ids the model's embedding takes (a multimodal config nests it)."""
        config = self.manifest.config
        size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
        return int(size or len(self.tokenizer.get_vocab()))

    def health(self) -> str | None:
        if not self.engine.alive:
            return "the generation thread has stopped; see the server's log"
        return missing_experts(self.membership, self.manifest)


def _authorized(service: Service, request: Request) -> bool:
    if service.api_key is None:
        return True
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              service.api_key.encode())


def _sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


class _Subscription:
    """One request's events on this event loop. cancel() (a client that went away) frees
    its row in the batch; waiting with a timeout does not cancel anything."""

    def __init__(self, service: Service, prompt: list[int], sampling: Sampling) -> None:
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._handle = service.engine.submit(
            prompt, sampling, lambda e: loop.call_soon_threadsafe(self._queue.put_nowait, e))

    async def next(self, timeout: float | None = None) -> Event | None:
        """The next event, or None if none came within `timeout` seconds."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    def cancel(self) -> None:
        self._handle.cancel()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def make_app(service: Service) -> Starlette:
    """The Starlette application: the OpenAI routes over `service`."""

    def guard(handler: Callable) -> Callable:
        async def endpoint(request: Request) -> Response:
            if not _authorized(service, request):
                return JSONResponse(
                    error_json("a valid API key is needed: send 'Authorization: Bearer KEY'",
                               "invalid_request_error", 401), 401,
                    headers={"WWW-Authenticate": "Bearer"})
            try:
                return await handler(request)
            except ShoalError as e:
                return _error_response(e)

        return endpoint

    async def health(request: Request) -> Response:
        problem = service.health()
        body = {"status": "ok" if problem is None else "unavailable",
                "model": service.model_id, "workers": len(service.membership.live()[1]),
                "requests_in_flight": service.engine.in_flight,
                "batching": service.engine.stats.as_json(),
                "prompt_cache": service.engine.prompt_cache}
        if problem is not None:
            body["detail"] = problem
        return JSONResponse(body, 200 if problem is None else 503)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": service.model_id, "object": "model", "created": service.started,
             "owned_by": "shoal"}]})

    async def completions(request: Request, *, chat: bool) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidInput(f"the request body is not valid JSON: {e}") from None
        parsed = parse_request(body, chat=chat)
        prompt = prompt_tokens(service.tokenizer, parsed, service.vocab)
        parsed = fit_to_context(parsed, len(prompt), service.context)
        problem = service.health()
        if problem is not None:
            raise Unavailable(f"the cluster cannot serve this model now: {problem}")
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "created": int(time.time()), "model": service.model_id}
        if parsed.stream:
            return StreamingResponse(_stream(service, parsed, prompt, meta),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(service, request, parsed, prompt, meta)

    async def chat_completions(request: Request) -> Response:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Response:
        return await completions(request, chat=False)

    routes = [
        Route("/health", guard(health), methods=["GET"]),
        Route("/v1/models", guard(models), methods=["GET"]),
        Route("/v1/chat/completions", guard(chat_completions), methods=["POST"]),
        Route("/v1/completions", guard(text_completions), methods=["POST"]),
    ]
    return Starlette(routes=routes)


async def _whole(service: Service, request: Request, parsed: CompletionRequest,
                 prompt: list[int], meta: dict) -> Response:
    """A non-streamed answer: every event gathered, unless the client leaves first."""
    events: list[Event] = []
    subscription = _Subscription(service, prompt, parsed.sampling)

    async def gather() -> None:
        while not events or (events[-1].finish_reason is None and events[-1].error is None):
            events.append(await subscription.next())

    work = asyncio.create_task(gather())
    gone = asyncio.create_task(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():  # the client left (or the server is stopping)
            work.cancel()
            subscription.cancel()
    if not events or (events[-1].finish_reason is None and events[-1].error is None):
        return Response(status_code=499)
    last = events[-1]
    if last.error is not None:
        raise last.error
    text = "".join(e.text for e in events)
    scores = tuple(s for e in events for s in e.logprobs)
    tok = service.tokenizer
    want_scores = parsed.sampling.top_logprobs is not None
    if parsed.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": chat_logprobs(tok, scores) if want_scores else None,
                  "finish_reason": last.finish_reason}
        obj = "chat.completion"
    else:
        if parsed.echo:
            text = tok.decode(prompt) + text
        choice = {"index": 0, "text": text,
                  "logprobs": text_logprobs(tok, scores) if want_scores else None,
                  "finish_reason": last.finish_reason}
        obj = "text_completion"
    return JSONResponse({**meta, "object": obj, "choices": [choice],
                         "usage": usage_json(last)})


async def _stream(service: Service, parsed: CompletionRequest, prompt: list[int],
                  meta: dict) -> AsyncIterator[bytes]:
    """Server-sent events in the OpenAI shape; an error mid-answer is sent as an event
    with an `error` object (the openai client raises it), then the stream ends."""
    tok = service.tokenizer
    want_scores = parsed.sampling.top_logprobs is not None
    obj = "chat.completion.chunk" if parsed.chat else "text_completion"

    def chunk(event: Event, first: bool) -> dict:
        scores = None
        if want_scores:
            scores = (chat_logprobs if parsed.chat else text_logprobs)(tok, event.logprobs)
        if parsed.chat:
            delta = {"role": "assistant", "content": event.text} if first else (
                {"content": event.text} if event.text or not event.finish_reason else {})
            choice = {"index": 0, "delta": delta, "logprobs": scores,
                      "finish_reason": event.finish_reason}
        else:
            choice = {"index": 0, "text": event.text, "logprobs": scores,
                      "finish_reason": event.finish_reason}
        out = {**meta, "object": obj, "choices": [choice]}
        if parsed.include_usage:
            out["usage"] = None
        return out

    first = True
    if parsed.echo:
        yield _sse(chunk(Event(text=tok.decode(prompt)), first))
        first = False
    subscription = _Subscription(service, prompt, parsed.sampling)
    try:
        while True:
            event = await subscription.next(HEARTBEAT)
            if event is None:
                yield b": waiting\n\n"  # keeps proxies and clients from timing out
                continue
            if event.error is not None:
                status = 503 if isinstance(event.error, Unavailable) else 500
                yield _sse(error_json(str(event.error),
                                      "unavailable" if status == 503 else "server_error",
                                      status))
                break
            yield _sse(chunk(event, first))
            first = False
            if event.finish_reason is not None:
                if parsed.include_usage:
                    yield _sse({**meta, "object": obj, "choices": [],
                                "usage": usage_json(event)})
                break
        yield _sse("[DONE]")
    finally:  # also when the client went away: Starlette cancels this generator
        subscription.cancel()


# ---------------------------------------------------------------------------------------
# The command


def read_api_key(path: Path) -> str:
    try:
        key = Path(path).read_text().strip()
    except FileNotFoundError:
        raise NotFound(f"no API key file at {path}") from None
    except OSError as e:
        raise ShoalError(f"cannot read the API key file {path}: {e.strerror}") from None
    if not key or any(c.isspace() for c in key):
        raise InvalidInput(f"{path} must hold one API key: one line, no spaces")
    return key


def listen(host: str, port: int) -> socket.socket:
    """Bind before loading anything, so a port in use is said at once; port 0 picks one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ShoalError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    return sock


def serve(service: Service, sock: socket.socket, *, log_level: str = "warning") -> None:
    """Answer HTTP on `sock` until interrupted (uvicorn handles SIGINT and SIGTERM)."""
    import uvicorn

    config = uvicorn.Config(make_app(service), log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"shoal serve: {service.model_id} on http://{shown}:{port}/v1 "
          f"(context {service.context} tokens, up to {service.engine.max_batch} requests "
          "decoded together)", file=sys.stderr, flush=True)
    uvicorn.Server(config).run(sockets=[sock])
