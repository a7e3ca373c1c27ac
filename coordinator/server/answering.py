"""What every API `shoal serve` speaks answers from: the `Service` (the batch engine, the model,
the workers, the key, the limits) and one request's way through it, its body read within the
limits, its events gathered whole or streamed; a client that leaves cancels its row."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import os
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import TypeVar

from mlx_lm.tokenizer_utils import TokenizerWrapper
from starlette.requests import Request

from coordinator.cluster.snapshot import Members, layer_sizes, snapshot_of
from coordinator.server.batching import BatchEngine, Event, Sampling
from coordinator.server.http_limits import ConnectionGuard, Limits
from coordinator.server.openai_api import CompletionRequest, decode_body
from coordinator.server.prompts import longest_token, prepare
from engine.errors import InvalidInput, NotFound, ShoalError, Unavailable
from engine.manifest import Manifest

HEARTBEAT = 15.0  # seconds between keep-alives while a streamed answer waits for tokens
LARGE_BODY_NICE = 5  # a weight of a third of the batch thread's when they share a core

T = TypeVar("T")


class TooLarge(InvalidInput):
    """A request body over --max-body: 413."""


class TooSlow(InvalidInput):
    """A request body that did not arrive in time: 408."""


def status_of(error: ShoalError) -> int:
    """The HTTP status an error is answered with, whichever API's shape it takes."""
    if isinstance(error, TooLarge):
        return 413
    if isinstance(error, TooSlow):
        return 408
    if isinstance(error, InvalidInput):
        return 400
    if isinstance(error, NotFound):
        return 404
    return 503 if isinstance(error, Unavailable) else 500


# ---------------------------------------------------------------------------------------
# Health: every expert must have a live owner


def missing_experts(membership: Members, manifest: Manifest) -> str | None:
    """Why the cluster cannot serve every expert now (naming them, and the workers found but
    not serving), or None."""
    return snapshot_of(membership, layer_sizes(manifest)).missing or None


# ---------------------------------------------------------------------------------------
# The service: what the routes share


@dataclass
class Service:
    engine: BatchEngine
    tokenizer: TokenizerWrapper
    manifest: Manifest
    membership: Members  # the workers, and the coordinator's own experts when it holds some
    model_id: str
    context: int
    api_key: str | None = None
    started: int = 0
    cors_origins: tuple[str, ...] = ()  # origins whose browser pages may call the API
    limits: Limits = field(default_factory=Limits)
    stopping: bool = False  # set on SIGINT or SIGTERM: new requests get 503
    buffered: int = 0  # bytes of request bodies held now, read and not yet tokenized

    def __post_init__(self) -> None:
        self.guard = ConnectionGuard(self.limits)
        # Decoding and tokenizing run off the event loop, so that /health and the streams go
        # on meanwhile: large bodies on a thread of their own at a lower priority (one at a
        # time, which bounds their memory), so that small requests never queue behind them
        # and the batch's thread wins the CPU from them.
        self.parsers = ThreadPoolExecutor(2, thread_name_prefix="shoal parse")
        self.large_parser = ThreadPoolExecutor(1, thread_name_prefix="shoal parse large",
                                               initializer=_lower_priority)

    @cached_property
    def longest_token(self) -> int:
        return longest_token(self.tokenizer)

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

    def prepare(self, request: CompletionRequest) -> tuple[CompletionRequest, list[int]]:
        """The request bound to this model (prompts.prepare): its prompt's token ids,
        refused before tokenizing when it cannot fit the context. Runs on a parser thread."""
        return prepare(self.tokenizer, request, self.vocab, context=self.context,
                       longest=self.longest_token)

    def check_model(self, body: object) -> object:
        """The request's body, refused (404, naming the model served) when it asks for
        another model: a client meaning some other server gets told, not this model's words."""
        name = body.get("model") if isinstance(body, dict) else None
        if isinstance(name, str) and name not in (self.model_id, f"{self.model_id}:latest"):
            raise NotFound(f"model {name!r} not found: this server serves {self.model_id!r}")
        return body

    def check_serving(self) -> None:
        """Unavailable, naming the problem, unless a request can be answered now."""
        problem = self.health()
        if problem is not None:
            raise Unavailable(f"the cluster cannot serve this model now: {problem}")


def _lower_priority() -> None:
    """Lower the calling thread's CPU priority where threads have their own (Linux); on
    macOS the call refuses a thread id and nothing changes. Not the lowest: at nice 19 it
    weighs 15 against a busy machine's other threads' 1024, and a large body waits minutes."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LARGE_BODY_NICE)


def authorized(service: Service, request: Request) -> bool:
    """Whether the request carries the service's API key (or none is needed)."""
    if service.api_key is None:
        return True
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
        token = request.headers.get("x-api-key", "")
    return hmac.compare_digest(token.strip().encode(), service.api_key.encode())


Guard = Callable[[Callable], Callable]  # wraps a handler in the key check and error mapping


# ---------------------------------------------------------------------------------------
# The request's body: read within the limits, parsed off the event loop


class _Held:
    """Bytes of one request's body counted in the service's `buffered` until released."""

    def __init__(self, service: Service) -> None:
        self.service, self.bytes = service, 0

    def add(self, n: int) -> None:
        self.bytes += n
        self.service.buffered += n

    def release(self) -> None:
        self.service.buffered -= self.bytes
        self.bytes = 0


async def _read_body(service: Service, request: Request, held: _Held) -> bytes:
    """The request's body, read within the limits (one declared too large is refused before
    a byte of it is read)."""
    limits = service.limits
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body:
        raise TooLarge(f"the request body has {int(declared)} bytes; this server takes at "
                       f"most {limits.max_body} (shoal serve --max-body)")
    chunks: list[bytes] = []
    try:
        async with asyncio.timeout(limits.body_timeout):
            async for chunk in request.stream():
                held.add(len(chunk))
                if held.bytes > limits.max_body:
                    raise TooLarge(f"the request body is over {limits.max_body} bytes, the "
                                   "most this server takes (shoal serve --max-body)")
                if service.buffered > limits.max_buffered:
                    raise Unavailable("the server is reading too many large requests at once; "
                                      "try again")
                chunks.append(chunk)
    except TimeoutError:
        raise TooSlow(f"the request body did not arrive within {limits.body_timeout:g} s; "
                      "send it at once") from None
    return b"".join(chunks)


async def read_request(service: Service, request: Request, parse: Callable[[object], T]) -> T:
    """The request's body read within the service's limits, decoded (decode_body: its depth
    and Unicode checked) and given to `parse`, which validates it and tokenizes its prompt
    (Service.prepare): the CPU-heavy part of a request, run on the service's parser threads
    so that the event loop goes on answering meanwhile. A client that leaves while its body
    is read raises starlette's ClientDisconnect (answered 499)."""
    if service.stopping:
        raise Unavailable("the server is shutting down")
    held = _Held(service)
    try:
        body = await _read_body(service, request, held)
        loop = asyncio.get_running_loop()
        if len(body) > service.limits.large_body:
            return await loop.run_in_executor(service.large_parser,
                                              lambda: _parse_large(body, parse))
        return await loop.run_in_executor(service.parsers, lambda: parse(decode_body(body)))
    finally:
        held.release()


def _parse_large(body: bytes, parse: Callable[[object], T]) -> T:
    """A large body parsed, then the memory its tokenizing freed handed back to the OS:
    glibc's malloc keeps it otherwise (hundreds of MB for a body of a few MB)."""
    try:
        return parse(decode_body(body))
    finally:
        _trim_heap()


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc only; elsewhere there is none
    except (OSError, AttributeError):
        return None


def _trim_heap() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# ---------------------------------------------------------------------------------------
# The request's events


class Subscription:
    """One request's events on this event loop. cancel() (a client that went away) frees
    its row in the batch; waiting with a timeout does not cancel anything."""

    def __init__(self, engine: BatchEngine, prompt: list[int], sampling: Sampling) -> None:
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._handle = engine.submit(
            prompt, sampling, lambda e: loop.call_soon_threadsafe(self._queue.put_nowait, e))

    async def next(self, timeout: float | None = None) -> Event | None:
        """The next event, or None if none came within `timeout` seconds."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    def cancel(self) -> None:
        self._handle.cancel()


def finished(event: Event) -> bool:
    return event.finish_reason is not None or event.error is not None


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def gather(engine: BatchEngine, request: Request, prompt: list[int],
                 sampling: Sampling) -> list[Event] | None:
    """Every event of a whole answer, the last one finished; None if the client left first
    (the request is then cancelled)."""
    events: list[Event] = []
    subscription = Subscription(engine, prompt, sampling)

    async def collect() -> None:
        while not events or not finished(events[-1]):
            events.append(await subscription.next())

    work = asyncio.create_task(collect())
    gone = asyncio.create_task(until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():  # the client left (or the server is stopping)
            work.cancel()
            subscription.cancel()
    if not events or not finished(events[-1]):
        return None
    return events


async def events(engine: BatchEngine, prompt: list[int],
                 sampling: Sampling) -> AsyncIterator[Event | None]:
    """A streamed answer's events up to the finished one; None after HEARTBEAT seconds
    without one (send a keep-alive). Closing the iterator early cancels the request:
    Starlette closes it when the client goes away."""
    subscription = Subscription(engine, prompt, sampling)
    try:
        while True:
            event = await subscription.next(HEARTBEAT)
            yield event
            if event is not None and finished(event):
                return
    finally:
        subscription.cancel()
