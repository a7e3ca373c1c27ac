"""Router lookahead: while layer L's experts run, guess layer L+1's and tell their owners (only
members that stream get hints): a wrong guess costs a read, never a result."""
# The guess applies layer L+1's own router to layer L's MoE input, rescaled from layer L's
# post-attention norm to layer L+1's: the residual stream changes little from one layer to the
# next, so this ranks L+1's experts much as L+1 will.

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.manifest import Manifest
from engine.moe_layers import get_module
from proto import shoal_pb2


@dataclass
class LookaheadStats:
    """Set-level agreement of each prediction with the experts the next layer then used."""

    predictions: int = 0
    predicted: int = 0  # distinct experts guessed, summed over predictions
    used: int = 0  # distinct experts the predicted layers then used
    correct: int = 0  # guessed and used
    hints_sent: int = 0

    @property
    def recall(self) -> float:
        return self.correct / self.used if self.used else 0.0

    @property
    def precision(self) -> float:
        return self.correct / self.predicted if self.predicted else 0.0


# A guess is sent only from ranks whose own measured hit rate reaches this: below it, a
# prefetch costs a drive more reads that no token uses than it saves. Each rank starts at
# one hit in one guess (every rank sent) and its rate decays by RANK_MEMORY per scoring.
MIN_RANK_HIT_RATE = 0.5
RANK_MEMORY = 0.98


@dataclass
class RankRates:
    """How often the guess at each rank (0: the router's top pick) was then used: the
    confidence that decides which ranks are sent, learnt from the lookahead's own record."""

    guessed: np.ndarray
    used: np.ndarray

    @classmethod
    def start(cls, width: int) -> RankRates:
        return cls(np.ones(width), np.ones(width))

    def record(self, ranked: np.ndarray, used: np.ndarray) -> None:
        """`ranked`: (rows, width) guesses in rank order; `used`: the experts then used."""
        width = min(ranked.shape[-1], self.guessed.size)
        hit = np.isin(ranked[:, :width], used)
        self.guessed *= RANK_MEMORY
        self.used *= RANK_MEMORY
        self.guessed[:width] += ranked.shape[0]
        self.used[:width] += hit.sum(axis=0)

    def confident(self) -> np.ndarray:
        """The ranks worth a prefetch."""
        return self.used / self.guessed >= MIN_RANK_HIT_RATE


@dataclass(frozen=True)
class _Next:
    layer: int
    router: nn.Module
    scale: mx.array | None  # this layer's norm weight -> the next layer's, or None


def _norm_weight(model: nn.Module, switch_path: str) -> mx.array | None:
    """The post-attention norm weight of the decoder layer that holds a switch module."""
    parts = switch_path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            norm = get_module(model, ".".join(parts[:cut]) + ".post_attention_layernorm")
        except (KeyError, AttributeError, IndexError, ValueError, TypeError):
            continue
        weight = getattr(norm, "weight", None)
        return weight if isinstance(weight, mx.array) else None
    return None


class Lookahead:
    """Predicts the next MoE layer's experts from this layer's input and builds the hints."""

    def __init__(
        self, model: nn.Module, manifest: Manifest, *, extra: int = 0, rescale: bool = True
    ) -> None:
        self.extra = extra  # guess top-(k + extra) experts per token
        self.stats = LookaheadStats()
        self._next: dict[int, _Next] = {}
        self._guess: dict[int, np.ndarray] = {}  # layer -> distinct experts guessed for it
        self._ranked: dict[int, np.ndarray] = {}  # layer -> (rows, width) guesses, rank order
        self.ranks: RankRates | None = None  # sized at the first guess
        layers = list(manifest.layers)
        for this, nxt in zip(layers, layers[1:], strict=False):
            block = get_module(model, nxt.path.rsplit(".", 1)[0])
            router = getattr(block, "gate", None)
            if router is None:
                continue
            scale = None
            if rescale:
                here, there = _norm_weight(model, this.path), _norm_weight(model, nxt.path)
                if here is not None and there is not None and here.shape == there.shape:
                    safe = mx.where(mx.abs(here) > 1e-6, here, 1e-6)
                    scale = (there.astype(mx.float32) / safe.astype(mx.float32)).astype(here.dtype)
                    # now, on this thread: a graph left lazy belongs to this thread's stream,
                    # and `shoal serve` predicts on its generation thread, which has another
                    mx.eval(scale)
            self._next[this.layer] = _Next(nxt.layer, router, scale)

    def predict(self, layer: int, x: mx.array, k: int) -> tuple[int, np.ndarray] | None:
        """(next MoE layer, distinct experts it will probably use) for MoE input `x` of `layer`."""
        ahead = self.ahead(layer, x, k)
        return None if ahead is None else self.guessed(*ahead)

    def ahead(self, layer: int, x: mx.array, k: int) -> tuple[int, mx.array] | None:
        """`predict`'s guess as a graph, not evaluated: (next MoE layer, its picks), for a
        caller that evaluates them with what it evaluates anyway, then calls `guessed`."""
        nxt = self._next.get(layer)
        if nxt is None:
            return None
        h = x.reshape(-1, x.shape[-1])
        try:
            if nxt.scale is not None:
                h = h * nxt.scale
            out = nxt.router(h)
        except ValueError:
            # The switch input is not the router's (Kimi K3 feeds its experts a latent
            # projection): this block gives no lookahead. MLX checks shapes as it builds
            # the graph, so nothing was computed.
            del self._next[layer]
            return None
        if isinstance(out, tuple):  # routers that pick their own experts (e.g. deepseek_v3)
            inds, scores = out[0], out[1]
            order = mx.argsort(-scores.astype(mx.float32), axis=-1)
            return nxt.layer, mx.take_along_axis(inds, order, axis=-1)
        width = min(k + self.extra, out.shape[-1])
        return nxt.layer, mx.argsort(-out, axis=-1)[..., :width]

    def guessed(self, layer: int, inds: mx.array) -> tuple[int, np.ndarray]:
        """Record the picks guessed for `layer` in rank order (scored once it runs); (layer,
        the distinct picks of the ranks confident enough to prefetch)."""
        ranked = np.asarray(inds).reshape(-1, inds.shape[-1])
        if self.ranks is None or self.ranks.guessed.size < ranked.shape[-1]:
            self.ranks = RankRates.start(ranked.shape[-1])
        self._ranked[layer] = ranked
        guess = np.unique(ranked[:, self.ranks.confident()[:ranked.shape[-1]]])
        self._guess[layer] = guess
        return layer, guess

    def score(self, layer: int, experts: np.ndarray) -> None:
        """Compare the guess made for `layer` (if any) with the experts it actually used."""
        guess, ranked = self._guess.pop(layer, None), self._ranked.pop(layer, None)
        if guess is None:
            return
        used = np.unique(experts)
        if ranked is not None and self.ranks is not None:
            self.ranks.record(ranked, used)
        s = self.stats
        s.predictions += 1
        s.predicted += guess.size
        s.used += used.size
        s.correct += np.intersect1d(guess, used, assume_unique=True).size

    def hints(
        self, layer: int, x: mx.array, k: int,
        owner_of: Callable[[int, np.ndarray], np.ndarray], links: list,
    ) -> dict[int, shoal_pb2.PrefetchHint]:
        """Per worker index, the hint for the next layer's experts it will be sent, for
        streaming workers only. `owner_of(layer, experts)` names the copy that will compute
        each expert (with replicas, not always its first owner)."""
        if not any(self.streams(link) for link in links):
            return {}  # every expert is in memory somewhere: guessing would only cost time
        predicted = self.predict(layer, x, k)
        if predicted is None:
            return {}
        nxt, guess = predicted
        owner = owner_of(nxt, guess)
        out = {}
        for worker in np.unique(owner).tolist():
            if worker < 0 or not self.streams(links[worker]):
                continue
            mine = guess[owner == worker]
            out[worker] = shoal_pb2.PrefetchHint(layer=nxt, experts=mine.tolist())
        self.stats.hints_sent += len(out)
        return out

    @staticmethod
    def streams(link) -> bool:
        """Whether the link's worker reads some of its experts from its drives, as its inventory
        says (its residency decides); with no inventory yet, True: a hint is harmless."""
        inventory = link.inventory
        return inventory is None or inventory.streaming
