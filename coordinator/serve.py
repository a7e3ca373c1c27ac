"""`shoal serve`'s HTTP server: the OpenAI API's routes on Starlette and uvicorn (chat and
text completions, streamed as server-sent events or not, the model list, health, the API key),
with every request decoded in one shared batch (coordinator/batching.py).

Requests and answers take their shapes from coordinator/openai_api.py; this module carries
them: it submits each request to the engine, waits for its events, and cancels a request
whose client went away, which frees its row in the batch.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mlx_lm.tokenizer_utils import TokenizerWrapper
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from coordinator.batching import BatchEngine, Event, Sampling
from coordinator.cluster import layer_sizes
from coordinator.membership import Membership
from coordinator.openai_api import (
    CompletionRequest,
    answer_meta,
    chunk_json,
    completion_json,
    error_json,
    fit_to_context,
    parse_request,
    prompt_tokens,
    usage_chunk_json,
)
from engine.errors import InvalidInput, NotFound, ShoalError, Unavailable
from engine.manifest import Manifest
from engine.placement import replica_routes

HEARTBEAT = 15.0  # seconds between SSE comments while a streamed answer waits for tokens


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


def _error_response(error: ShoalError) -> JSONResponse:
    if isinstance(error, InvalidInput):
        return JSONResponse(error_json(str(error), "invalid_request_error", 400), 400)
    if isinstance(error, NotFound):
        return JSONResponse(error_json(str(error), "not_found_error", 404), 404)
    if isinstance(error, Unavailable):
        return JSONResponse(error_json(str(error), "unavailable", 503), 503)
    return JSONResponse(error_json(str(error), "server_error", 500), 500)


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


Guard = Callable[[Callable], Callable]  # wraps a handler in the key check and error mapping


def make_app(service: Service, *, mount: Callable[[Guard], list[BaseRoute]] | None = None,
             middleware: Sequence[Middleware] = ()) -> Starlette:
    """The Starlette application: the OpenAI routes over `service`, and those `mount` gives
    (the dashboard's: coordinator/dashboard.py), which wrap theirs in the same guard."""

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
        meta = answer_meta(chat=chat, model=service.model_id)
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
    if mount is not None:
        routes += mount(guard)
    return Starlette(routes=routes, middleware=list(middleware))


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
    if events[-1].error is not None:
        raise events[-1].error
    return JSONResponse(completion_json(service.tokenizer, parsed, prompt, events, meta))


async def _stream(service: Service, parsed: CompletionRequest, prompt: list[int],
                  meta: dict) -> AsyncIterator[bytes]:
    """Server-sent events in the OpenAI shape; an error mid-answer is sent as an event
    with an `error` object (the openai client raises it), then the stream ends."""
    tok = service.tokenizer
    first = True
    if parsed.echo:
        yield _sse(chunk_json(tok, parsed, Event(text=tok.decode(prompt)), meta, first=first))
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
            yield _sse(chunk_json(tok, parsed, event, meta, first=first))
            first = False
            if event.finish_reason is not None:
                if parsed.include_usage:
                    yield _sse(usage_chunk_json(parsed, event, meta))
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


def serve(service: Service, sock: socket.socket, *, log_level: str = "warning",
          mount: Callable[[Guard], list[BaseRoute]] | None = None,
          middleware: Sequence[Middleware] = ()) -> None:
    """Answer HTTP on `sock` until interrupted (uvicorn handles SIGINT and SIGTERM)."""
    import uvicorn

    config = uvicorn.Config(make_app(service, mount=mount, middleware=middleware),
                            log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"shoal serve: {service.model_id} on http://{shown}:{port}/v1 "
          f"(context {service.context} tokens, up to {service.engine.max_batch} requests "
          "decoded together)", file=sys.stderr, flush=True)
    uvicorn.Server(config).run(sockets=[sock])
