"""Forwards on several threads that take turns and make each MoE layer's call together
(`MergedCalls`): `shoal serve`'s decode step and a prompt's piece share one round trip per
layer instead of a pass over the cluster each."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx

from engine.errors import ShoalError

TURN_TIMEOUT = 600.0  # seconds a forward waits for its turn: a bound, never reached when healthy

# (layer, x (rows, width), inds (rows, k)) -> (rows, k, width): one layer call to the members
LayerCallRunner = Callable[[int, mx.array, mx.array], mx.array]


class MergedCalls:
    """The forwards taking part run one at a time, in turns: each runs until its next MoE
    layer call, leaves its rows there and hands over to the next one that has not; the last
    to arrive makes one call with every forward's rows and hands each its own back. Each
    expert's output for a row depends on that row alone, so merging changes the round trips,
    not the results. A forward that ends leaves; the others go on without it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._order: list[str] = []  # forwards taking part, in turn order
        self._now: str | None = None
        self._pending: dict[str, tuple[int, mx.array, mx.array]] = {}
        self._results: dict[str, mx.array | BaseException] = {}
        self._local = threading.local()
        self.merged = 0  # layer calls that carried rows of more than one forward

    def join(self, name: str) -> None:
        """`name` takes part from now: the others' calls wait for its, even before its thread
        enters `taking_part` (a forward started on another thread joins before it starts)."""
        with self._cond:
            if name not in self._order:
                self._order.append(name)
            if self._now is None:
                self._now = name

    @contextmanager
    def taking_part(self, name: str) -> Iterator[None]:
        """The calling thread's forwards take part (as `name`) until the block ends; the
        block starts on this forward's turn."""
        self.join(name)
        self._local.name = name
        try:
            self._wait_turn(name)
            yield
        finally:
            self._local.name = None
            self._leave(name)

    def taking_part_now(self) -> bool:
        return getattr(self._local, "name", None) is not None

    def call(self, layer: int, x: mx.array, inds: mx.array, run: LayerCallRunner) -> mx.array:
        """This forward's layer call, made with the others' when they reach theirs."""
        me = self._local.name
        *lead, k = inds.shape
        mx.eval(x, inds)  # on this thread's stream: the call may run on another thread
        with self._cond:
            self._pending[me] = (layer, x, inds)  # computed (reshaped where the call runs)
        while True:
            with self._cond:
                if me in self._results:
                    out = self._results.pop(me)
                    break
                waiting = [n for n in self._order if n not in self._pending]
                if waiting:  # hand over to the next forward that has not reached its call
                    self._now = waiting[0]
                    self._cond.notify_all()
                    self._wait_turn(me, locked=True)
                    continue
                calls, self._pending = self._pending, {}
            self._run(calls, run)  # every other forward waits: this one holds the turn
        if isinstance(out, BaseException):
            raise out
        return out.reshape(*lead, k, out.shape[-1])

    def _run(self, calls: dict[str, tuple[int, mx.array, mx.array]],
             run: LayerCallRunner) -> None:
        by_layer: dict[int, list[str]] = {}
        for name, (layer, _, _) in calls.items():
            by_layer.setdefault(layer, []).append(name)
        results: dict[str, mx.array | BaseException] = {}
        for layer, names in by_layer.items():
            xs = [calls[n][1].reshape(-1, calls[n][1].shape[-1]) for n in names]
            picks = [calls[n][2].reshape(-1, calls[n][2].shape[-1]) for n in names]
            rows = [x.shape[0] for x in xs]
            try:
                if len(names) == 1:
                    out = run(layer, xs[0], picks[0])
                else:
                    self.merged += 1
                    out = run(layer, mx.concatenate(xs), mx.concatenate(picks))
                at = 0
                for name, count in zip(names, rows, strict=True):
                    results[name] = out[at:at + count]
                    at += count
                # each thread has its streams: an array crosses to another thread computed
                mx.eval([results[name] for name in names])
            except BaseException as e:  # noqa: BLE001 (each forward of the call raises it)
                results.update({name: e for name in names})
        with self._cond:
            self._results.update(results)

    def _wait_turn(self, name: str, *, locked: bool = False) -> None:
        if not locked:
            with self._cond:
                return self._wait_turn(name, locked=True)
        if not self._cond.wait_for(lambda: self._now == name, TURN_TIMEOUT):
            raise ShoalError("a forward waited too long for its turn at a layer call")

    def _leave(self, name: str) -> None:
        with self._cond:
            at = self._order.index(name)
            self._order.remove(name)
            self._pending.pop(name, None)
            if self._now == name:
                self._now = self._order[at % len(self._order)] if self._order else None
            self._cond.notify_all()
