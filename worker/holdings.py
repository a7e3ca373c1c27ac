"""What this worker offers: the experts it serves, those draining before a drop, the tokens
computed per expert (the heat histogram), and when each was last asked for."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterable

import numpy as np

from engine.manifest import ExpertKey

SERVING, DRAINING = "serving", "draining"
MAX_UNSETTLED = 256  # requests noted but not yet counted, at most (see Holdings.asked)


# Every change to the experts offered bumps `version`; replies carry it, so a coordinator
# notices within one layer call. A draining expert is still computed if asked for (a coordinator
# may not have noticed yet) but is no longer offered.
class Holdings:
    """Thread-safe: compute threads count, the servicer reads, transfers change the set."""

    def __init__(self, keys: Iterable[ExpertKey]) -> None:
        self.boot_id = secrets.token_hex(8)
        self.version = 1
        self._state: dict[ExpertKey, str] = dict.fromkeys(keys, SERVING)
        self._drained_at: dict[ExpertKey, float] = {}
        self._gone: set[ExpertKey] = set()  # deleted since start: asking for them is stale
        # Per layer, indexed by expert number: tokens computed, and when last asked for
        # (the worker's start until then). Arrays, so a request is counted without a loop.
        self._tokens: dict[int, np.ndarray] = {}
        self._asked: dict[int, np.ndarray] = {}
        self._unsettled: list[tuple[int, np.ndarray, float]] = []  # see `asked`
        self._started = time.monotonic()
        self._lock = threading.Lock()

    # -- the compute path ---------------------------------------------------------------

    def asked(self, layer: int, experts: np.ndarray) -> None:
        """One request computed a (token, expert) pair for each entry of `experts` (valid
        expert numbers of `layer`, repeats allowed).

        Noted here, counted by `settle`: the servicer settles once the reply is on its way,
        and every reader settles first, so no reader misses a request and the reply does not
        wait for the count (a bincount under the lock, in the reply's path otherwise)."""
        with self._lock:
            self._unsettled.append((layer, experts, time.monotonic()))
            if len(self._unsettled) >= MAX_UNSETTLED:  # nobody settles (a caller in process)
                self._settle()

    def settle(self) -> None:
        """Count the requests noted since the last call."""
        with self._lock:
            self._settle()

    def _settle(self) -> None:  # with the lock held
        unsettled, self._unsettled = self._unsettled, []
        for layer, experts, when in unsettled:
            tokens, asked = self._rows(layer, int(experts.max()) + 1)
            tokens += np.bincount(experts, minlength=tokens.size)
            asked[experts] = when

    def _rows(self, layer: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer's count and time arrays, grown to hold expert number `size - 1`."""
        tokens = self._tokens.get(layer)
        if tokens is None or tokens.size < size:
            grow = size - (0 if tokens is None else tokens.size)
            old_tokens = np.zeros(0, np.int64) if tokens is None else tokens
            old_asked = self._asked.get(layer, np.zeros(0))
            self._tokens[layer] = np.concatenate([old_tokens, np.zeros(grow, np.int64)])
            self._asked[layer] = np.concatenate([old_asked, np.full(grow, self._started)])
        return self._tokens[layer], self._asked[layer]

    def _asked_at(self, key: ExpertKey) -> float:  # with the lock held
        self._settle()
        asked = self._asked.get(key[0])
        return self._started if asked is None or key[1] >= asked.size else float(asked[key[1]])

    # -- reading ------------------------------------------------------------------------

    def offered(self) -> list[ExpertKey]:
        with self._lock:
            return sorted(k for k, s in self._state.items() if s == SERVING)

    def draining(self) -> list[ExpertKey]:
        with self._lock:
            return sorted(k for k, s in self._state.items() if s == DRAINING)

    def state(self, key: ExpertKey) -> str | None:
        with self._lock:
            return self._state.get(key)

    def was_deleted(self, key: ExpertKey) -> bool:
        with self._lock:
            return key in self._gone

    def tokens(self) -> dict[ExpertKey, int]:
        """Tokens computed per expert since the worker started, for experts asked at all."""
        with self._lock:
            self._settle()
            return {(layer, int(e)): int(counts[e])
                    for layer, counts in self._tokens.items() for e in np.flatnonzero(counts)}

    def idle_seconds(self, key: ExpertKey) -> float:
        """Since `key` was last asked for, or since the worker started."""
        with self._lock:
            return time.monotonic() - self._asked_at(key)

    # -- changes (each bumps the version) -------------------------------------------------

    def add(self, key: ExpertKey) -> None:
        with self._lock:
            self._state[key] = SERVING
            self._drained_at.pop(key, None)
            self._gone.discard(key)
            self.version += 1

    def drain(self, key: ExpertKey) -> None:
        with self._lock:
            if self._state.get(key) == SERVING:
                self._state[key] = DRAINING
                self._drained_at[key] = time.monotonic()
                self.version += 1

    def keep(self, key: ExpertKey) -> None:
        with self._lock:
            if self._state.get(key) == DRAINING:
                self._state[key] = SERVING
                self._drained_at.pop(key, None)
                self.version += 1

    def why_not_delete(self, key: ExpertKey, quiet: float) -> str | None:
        """None if `key` has drained and nobody asked for it for `quiet` seconds."""
        now = time.monotonic()
        with self._lock:
            if self._state.get(key) != DRAINING:
                return "it is not draining: drain it first"
            drained = now - self._drained_at[key]
            asked = now - self._asked_at(key)
            if min(drained, asked) < quiet:
                return (f"it was drained {drained:.1f} s and last asked for {asked:.1f} s ago; "
                        f"a copy is deleted only after {quiet:.1f} s of both")
        return None

    def deleted(self, key: ExpertKey) -> None:
        with self._lock:
            self._state.pop(key, None)
            self._drained_at.pop(key, None)
            self._gone.add(key)
            self.version += 1
