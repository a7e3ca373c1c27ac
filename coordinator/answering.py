"""One request's events from the batch engine, on the HTTP server's event loop, for every API
`shoal serve` speaks: gathered whole, or streamed as they come (with a heartbeat while none
does). Leaving early cancels the request, which frees its row in the batch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from starlette.requests import Request

from coordinator.batching import BatchEngine, Event, Sampling
from engine.errors import InvalidInput, NotFound, ShoalError, Unavailable

HEARTBEAT = 15.0  # seconds between keep-alives while a streamed answer waits for tokens


async def read_json(request: Request) -> object:
    """The request's body as JSON; InvalidInput if it is not."""
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidInput(f"the request body is not valid JSON: {e}") from None


def status_of(error: ShoalError) -> int:
    """The HTTP status an error is answered with, whichever API's shape it takes."""
    if isinstance(error, InvalidInput):
        return 400
    if isinstance(error, NotFound):
        return 404
    return 503 if isinstance(error, Unavailable) else 500


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
