"""A long prompt's pass as a pipeline (`pipelined_prefill`): its micro-chunks run through the
layers on threads that take turns, so that while one chunk's experts are out on the workers the
coordinator runs the next chunk's attention and router for the same layer."""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn

from coordinator.dataplane.dispatch import Dispatcher
from engine.errors import ShoalError

TURN_TIMEOUT = 600.0  # seconds a chunk waits for its turn: a bound, never reached when healthy
CHUNK = 256  # tokens of a micro-chunk
DEPTH = 2  # chunks in flight


class Turns:
    """Whose turn it is among the chunks in flight, in chunk order: a chunk runs until it has
    sent a layer call's requests, then hands over (`yield_turn`) and waits for its next turn,
    when it reads their replies. So the chunks' work never overlaps in Python or MLX (one runs
    at a time, the others' requests travel), each layer's cache sees the chunks in order (a
    chunk follows the one before it by half a layer), and each lane's replies are read in the
    order their requests were written."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ring: list[int] = []  # chunks in flight, in order
        self._now: int | None = None
        self.failed: BaseException | None = None
        self.hand_overs = 0  # to another chunk in flight: the pipeline's overlaps

    def join(self, chunk: int) -> None:
        with self._cond:
            self._ring.append(chunk)
            if self._now is None:
                self._now = chunk
            self._cond.notify_all()

    def wait(self, chunk: int) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._now == chunk or self.failed is not None,
                                       TURN_TIMEOUT):
                raise ShoalError("a prompt chunk waited too long for its turn")
            if self.failed is not None and self._now != chunk:
                raise ShoalError("another chunk of the prompt failed")

    def yield_turn(self, chunk: int) -> None:
        """Hand over to the next chunk in flight, and wait for this one's next turn."""
        with self._cond:
            at = self._ring.index(chunk)
            self._now = self._ring[(at + 1) % len(self._ring)]
            self.hand_overs += self._now != chunk
            self._cond.notify_all()
        self.wait(chunk)

    def leave(self, chunk: int, error: BaseException | None = None) -> None:
        with self._cond:
            at = self._ring.index(chunk)
            self._ring.remove(chunk)
            if error is not None and self.failed is None:
                self.failed = error
            self._now = self._ring[at % len(self._ring)] if self._ring else None
            self._cond.notify_all()


def pipelined_prefill(model: nn.Module, dispatcher: Dispatcher, prompt: list[int],
                      cache: list, *, chunk: int = CHUNK, depth: int = DEPTH) -> int:
    """Fill `cache` with `prompt`'s keys and values, its micro-chunks of `chunk` tokens
    pipelined `depth` deep; returns how often a chunk handed over to another. Each chunk's
    pass is mlx-lm's own model call over the cache, in order, as a prefill in steps of `chunk`
    is: the same computation."""
    pieces = [prompt[at:at + chunk] for at in range(0, len(prompt), chunk)]
    turns = Turns()
    local = threading.local()

    def hand_over() -> None:  # the dispatcher's call between its requests and its replies
        if getattr(local, "chunk", None) is not None:
            turns.yield_turn(local.chunk)

    def run(index: int) -> None:
        local.chunk = index
        error = None
        try:
            turns.wait(index)
            model(mx.array([pieces[index]]), cache=cache)
            mx.eval([c.state for c in cache])  # as mlx-lm's prefill: the logits are not needed
        except BaseException as e:  # noqa: BLE001 (handed to the caller below)
            error = e
        finally:
            local.chunk = None
            turns.leave(index, error)

    dispatcher.between = hand_over
    try:
        alive: list[threading.Thread] = []
        for index in range(len(pieces)):
            while len(alive) >= depth and turns.failed is None:
                alive[0].join(0.01)
                alive = [t for t in alive if t.is_alive()]
            if turns.failed is not None:
                break
            turns.join(index)  # runs at the next hand-over: the chunk before is past a layer
            thread = threading.Thread(target=run, args=(index,), daemon=True,
                                      name=f"prefill chunk {index}")
            thread.start()
            alive.append(thread)
        for thread in alive:
            thread.join(TURN_TIMEOUT)
    finally:
        dispatcher.between = None
    if turns.failed is not None:
        raise turns.failed
    return turns.hand_overs


def worth_pipelining(dispatcher: Dispatcher, tokens: int, chunk: int = CHUNK) -> bool:
    """Whether a prompt pass of `tokens` gains from the pipeline: two chunks at least, and a
    member whose experts are reached over the network (in process there is nothing to
    overlap, and mlx-lm's own larger passes are quicker)."""
    return tokens >= 2 * chunk and any(not host.in_process
                                       for host in dispatcher.cluster.current.links)
