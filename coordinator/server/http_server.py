"""`shoal serve`'s HTTP server: the OpenAI routes on Starlette and uvicorn, with Anthropic's,
Ollama's and the Responses API beside them, CORS and the access log around all; SIGINT and
SIGTERM refuse new requests and give those in flight the drain period to finish."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from coordinator.server import anthropic_api, ollama_api, responses_api
from coordinator.server.access_log import AccessLog
from coordinator.server.answering import (
    Guard,
    Service,
    authorized,
    events,
    gather,
    read_request,
    status_of,
)
from coordinator.server.batching import Event
from coordinator.server.http_limits import BACKLOG, QuietAcceptErrors, guarded_protocol
from coordinator.server.openai_answers import (
    Chunks,
    answer_meta,
    completion_json,
    error_json,
    model_json,
    usage_chunk_json,
)
from coordinator.server.openai_api import CompletionRequest, fit_to_context, parse_request
from engine.errors import InvalidInput, NotFound, ShoalError, Unavailable


def _error_response(error: ShoalError) -> JSONResponse:
    status = status_of(error)
    kind = {400: "invalid_request_error", 404: "not_found_error", 408: "invalid_request_error",
            413: "invalid_request_error", 503: "unavailable"}.get(status, "server_error")
    return JSONResponse(error_json(str(error), kind, status), status)


def _sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


def make_app(service: Service, *, mount: Callable[[Guard], list[BaseRoute]] | None = None,
             middleware: Sequence[Middleware] = ()) -> Starlette:
    """The Starlette application: the OpenAI, Anthropic and Ollama routes over `service`, and
    those `mount` gives (the dashboard's: coordinator/server/dashboard.py), which wrap theirs in the
    same guard; `middleware` goes inside the access log."""

    def guard(handler: Callable) -> Callable:
        async def endpoint(request: Request) -> Response:
            if not authorized(service, request):
                return unauthorized(request.url.path)
            try:
                return await handler(request)
            except ShoalError as e:
                return _error_response(e)
            except ClientDisconnect:  # it left while its body was being read
                return Response(status_code=499)

        return endpoint

    async def health(request: Request) -> Response:
        problem = service.health()
        body = {"status": "ok" if problem is None else "unavailable",
                "model": service.model_id, "workers": len(service.membership.live()[1]),
                "requests_in_flight": service.engine.in_flight,
                "batching": service.engine.stats.as_json(),
                "prompt_cache": service.engine.prompt_cache,
                "drafting": service.engine.drafting_stats(),
                "connections": service.guard.as_json()}
        if problem is not None:
            body["detail"] = problem
        return JSONResponse(body, 200 if problem is None else 503)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list",
                             "data": [model_json(service.model_id, service.started)]})

    async def model(request: Request) -> Response:
        if request.path_params["model"] != service.model_id:
            raise NotFound(f"no model {request.path_params['model']!r}: this server has "
                           f"{service.model_id!r}")
        return JSONResponse(model_json(service.model_id, service.started))

    async def completions(request: Request, *, chat: bool) -> Response:
        parsed, prompt = await read_request(
            service, request,
            lambda body: service.prepare(parse_request(service.check_model(body), chat=chat)))
        parsed = fit_to_context(parsed, len(prompt), service.context)
        service.check_serving()
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
        Route("/v1/models/{model:path}", guard(model), methods=["GET"]),
        Route("/v1/chat/completions", guard(chat_completions), methods=["POST"]),
        Route("/v1/completions", guard(text_completions), methods=["POST"]),
        *responses_api.routes(service, guard),
        *anthropic_api.routes(service, guard),
        *ollama_api.routes(service, guard),
    ]
    if mount is not None:
        routes += mount(guard)
    # The access log outermost, so that its line says what any other layer answered.
    layers = [Middleware(AccessLog), *middleware]
    if service.cors_origins:
        layers.append(Middleware(CORSMiddleware, allow_origins=list(service.cors_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["*"]))
    return Starlette(routes=routes, middleware=layers,
                     exception_handlers={HTTPException: _http_error})


def unauthorized(path: str) -> JSONResponse:
    """401 in the shape of the API the path belongs to, so each API's clients show it."""
    message = "a valid API key is needed: send 'Authorization: Bearer KEY'"
    if path.startswith("/v1/messages"):
        body = anthropic_api.error_json(message + " or 'x-api-key: KEY'", 401)
    elif path.startswith("/api/"):
        body = ollama_api.error_json(message)
    else:
        body = error_json(message, "invalid_request_error", 401)
    return JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})


async def _http_error(request: Request, error: HTTPException) -> Response:
    """Starlette's own errors (no such route, a method the route does not take) in the
    OpenAI shape, so that clients can show them."""
    if error.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif error.status_code == 405:
        message = f"{request.url.path} does not take {request.method}"
    else:
        message = error.detail
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_json(message, kind, error.status_code), error.status_code,
                        headers=error.headers)


async def _whole(service: Service, request: Request, parsed: CompletionRequest,
                 prompt: list[int], meta: dict) -> Response:
    """A non-streamed answer: every event gathered, unless the client leaves first."""
    gathered = await gather(service.engine, request, prompt, parsed.sampling)
    if gathered is None:
        return Response(status_code=499)
    if gathered[-1].error is not None:
        raise gathered[-1].error
    return JSONResponse(completion_json(service.tokenizer, parsed, prompt, gathered, meta))


async def _stream(service: Service, parsed: CompletionRequest, prompt: list[int],
                  meta: dict) -> AsyncIterator[bytes]:
    """Server-sent events in the OpenAI shape; an error mid-answer is sent as an event
    with an `error` object (the openai client raises it), then the stream ends."""
    chunks = Chunks(service.tokenizer, parsed, meta)
    if parsed.echo:
        yield _sse(chunks.chunk(Event(text=service.tokenizer.decode(prompt))))
    async for event in events(service.engine, prompt, parsed.sampling):
        if event is None:
            yield b": waiting\n\n"  # keeps proxies and clients from timing out
            continue
        if event.error is not None:  # the last event
            status = 503 if isinstance(event.error, Unavailable) else 500
            yield _sse(error_json(str(event.error),
                                  "unavailable" if status == 503 else "server_error", status))
            continue
        yield _sse(chunks.chunk(event))
        if event.finish_reason is not None and parsed.include_usage:
            yield _sse(usage_chunk_json(parsed, event, meta))
    yield _sse("[DONE]")


# ---------------------------------------------------------------------------------------
# The command


def read_api_key(path: Path) -> str:
    try:
        key = Path(path).read_text().strip()
    except FileNotFoundError:
        raise NotFound(f"no API key file at {path}: `shoal api-key {path}` makes one") from None
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
    sock.listen(BACKLOG)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, stopped the same way by SIGINT and SIGTERM: uvicorn closes the
    listener and the idle connections and waits for the answers in flight; `on_stop(again)`
    is told of each signal (the second: end them now). serve() then returns, so that the
    command lets go of everything and records the heat. (uvicorn itself raises the signal
    again once it has stopped, and SIGTERM's default action then ends the process.)"""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[bool], None]) -> None:
        super().__init__(config)
        self._on_stop = on_stop

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: object) -> None:
        self._on_stop(self.should_exit)
        super().handle_exit(sig, frame)  # type: ignore[arg-type]

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(QuietAcceptErrors())
        await super().startup(sockets)


def serve(service: Service, sock: socket.socket, *, log_level: str = "warning",
          mount: Callable[[Guard], list[BaseRoute]] | None = None,
          middleware: Sequence[Middleware] = (), drain: float = 5.0) -> None:
    """Answer HTTP on `sock` until SIGINT or SIGTERM; then refuse new requests, give those in
    flight `drain` seconds to finish (a second signal: none), end the rest and return."""
    cut = threading.Timer(drain, lambda: service.engine.close(timeout=0))
    cut.daemon = True

    def stop(again: bool) -> None:  # in the signal handler: nothing here may block
        service.stopping = True  # new requests get 503 (uvicorn refuses new connections)
        if again:
            service.engine.close(timeout=0)  # its requests end at once, with an error event
            say("shoal serve: ending the answers in flight now\n")
        elif not cut.is_alive():
            cut.start()
            say(f"shoal serve: stopping: new requests are refused, those in flight get up to "
                f"{drain:g} s to finish (Ctrl-C again ends them now)\n")

    config = uvicorn.Config(make_app(service, mount=mount, middleware=middleware),
                            http=guarded_protocol(service.guard),
                            log_level=log_level, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=drain + 5, backlog=BACKLOG,
                            log_config=None)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    key = ("an API key is required (--api-key-file)" if service.api_key is not None
           else "no API key is required")
    cors = (f"; browser pages of {', '.join(service.cors_origins)} may call it"
            if service.cors_origins else "")
    print(f"shoal serve: {service.model_id} on http://{shown}:{port}/v1 "
          f"(context {service.context} tokens, up to {service.engine.max_batch} requests "
          f"decoded together); {key}{cors}", file=sys.stderr, flush=True)
    try:
        _Server(config, stop).run(sockets=[sock])
    finally:
        cut.cancel()
        for parsers in (service.parsers, service.large_parser):
            parsers.shutdown(wait=False, cancel_futures=True)
    print("shoal serve: stopped", file=sys.stderr, flush=True)


def say(line: str) -> None:
    """A line on stderr from a signal handler: os.write, since print may be interrupted
    in the middle of another print (a reentrant call raises)."""
    os.write(sys.stderr.fileno(), line.encode())
