"""Pure policy of a worker's expert cache: the memory budget, the heat of each expert, which
experts stay pinned, and which resident experts to evict. No I/O: numbers and numpy arrays
in, decisions out, so every rule can be tested without a drive or a model."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from engine.errors import InvalidInput

# With no --memory-budget, a worker keeps at most this share of physical memory in experts:
# the rest is for the OS, MLX's working memory, and (on a Mac) the GPU's share of unified memory.
DEFAULT_MEMORY_SHARE = 0.6
HALF_LIFE_PASSES = 4.0  # heat halves every 4 forward passes (decode: every 4 tokens)
PIN_HEAT = 2.0  # an expert at least this hot is pinned (about 2 tokens in its last half-life)
PIN_SHARE = 0.5  # at most this share of the cache is pinned, so cold experts can still come in
# Admission remembers routing this long (passes), so that it ranks experts as a heat record
# and the forecast's hot set do, not by the last few tokens.
ADMIT_HALF_LIFE_PASSES = 64.0

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_SHARE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


@dataclass(frozen=True)
class BudgetSpec:
    """What the user asked for: a byte count, a share of the worker's expert bytes, or neither."""

    bytes: int | None = None
    share: float | None = None  # of the expert bytes this worker holds, in (0, 1]


def parse_budget(text: str) -> BudgetSpec:
    """'512M', '8G', '1.5GiB', '123456' (bytes) or '50%' (of the worker's expert bytes)."""
    if match := _SHARE.match(text):
        share = float(match.group(1)) / 100
        if not 0 < share <= 1:
            raise InvalidInput(f"--memory-budget {text}: a share must be above 0% and at most 100%")
        return BudgetSpec(share=share)
    if match := _SIZE.match(text):
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
        if value <= 0:
            raise InvalidInput(f"--memory-budget {text}: must be more than 0 bytes")
        return BudgetSpec(bytes=value)
    raise InvalidInput(
        f"--memory-budget {text!r} is not a size like 512M, 8G or 50% (of this worker's experts)"
    )


def resolve_budget(spec: BudgetSpec, expert_bytes: int, physical_bytes: int) -> int:
    """The budget in bytes; the default is DEFAULT_MEMORY_SHARE of physical memory."""
    if spec.bytes is not None:
        return spec.bytes
    if spec.share is not None:
        return int(spec.share * expert_bytes)
    return int(DEFAULT_MEMORY_SHARE * physical_bytes)


def format_bytes(count: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(count) >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


class Heat:
    """Tokens routed to each expert, halved every `half_life` forward passes.

    This is LRFU's combined recency-frequency value (Lee et al., 1999): one number that
    behaves like LFU for long half-lives and like LRU for short ones. Values decay lazily:
    each expert keeps the pass at which its value was last brought up to date.
    """

    def __init__(self, count: int, half_life: float = HALF_LIFE_PASSES) -> None:
        self.half_life = half_life
        self.clock = 0  # forward passes seen
        self._value = np.zeros(count, dtype=np.float64)
        self._stamp = np.zeros(count, dtype=np.int64)
        self._values: np.ndarray | None = None  # `values()` until the next change

    def advance(self, passes: int = 1) -> None:
        self.clock += passes
        self._values = None

    def grow(self, count: int) -> None:
        """Room for `count` more experts (a worker that received new ones), at zero heat."""
        self._value = np.concatenate([self._value, np.zeros(count)])
        self._stamp = np.concatenate([self._stamp, np.full(count, self.clock, dtype=np.int64)])
        self._values = None

    def add(self, index: np.ndarray, tokens: np.ndarray) -> None:
        """Count `tokens[i]` more tokens routed to expert `index[i]` in the current pass."""
        index = np.asarray(index)
        self._value[index] = self._decayed(index) + np.asarray(tokens, dtype=np.float64)
        self._stamp[index] = self.clock
        self._values = None

    def values(self) -> np.ndarray:
        """Every expert's value now (read-only: kept for the calls until the next change,
        as the cache asks several times a request)."""
        if self._values is None:
            self._values = self._decayed(slice(None))
            self._values.flags.writeable = False
        return self._values

    def _decayed(self, index: np.ndarray | slice) -> np.ndarray:
        age = self.clock - self._stamp[index]
        return self._value[index] * np.exp2(-age / self.half_life)


def pinned(
    heat: np.ndarray,
    nbytes: np.ndarray,
    resident: np.ndarray,
    pin_bytes: int,
    threshold: float = PIN_HEAT,
) -> np.ndarray:
    """Resident experts at least `threshold` hot, hottest first, up to `pin_bytes` in all."""
    mask = np.zeros(heat.shape, dtype=bool)
    hot = np.flatnonzero(resident & (heat >= threshold))
    if hot.size == 0:
        return mask
    hot = hot[np.argsort(-heat[hot], kind="stable")]
    fits = np.cumsum(nbytes[hot]) <= pin_bytes
    mask[hot[fits]] = True
    return mask


def admit(frequency: np.ndarray, candidates: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Which experts just read (they must be, to compute) join the kept experts; the others stay
    on probation, the first to go when room is needed: TinyLFU's rule (Einziger et al., 2017)
    over the long-window `frequency`. One joins when it was routed more than the least routed
    expert of `kept` (a mask), so a cold expert read once does not displace the hot set."""
    ranked = frequency[kept]
    floor = ranked.min() if ranked.size else -np.inf
    return frequency[np.asarray(candidates)] > floor


def choose_victims(
    heat: np.ndarray,
    last_used: np.ndarray,
    nbytes: np.ndarray,
    evictable: np.ndarray,
    pinned_mask: np.ndarray,
    need_bytes: int,
    probation: np.ndarray | None = None,
) -> np.ndarray | None:
    """The fewest evictable experts, coldest first, that free at least `need_bytes`.

    Order: on probation (not admitted) before kept, unpinned before pinned, then lowest heat,
    then least recently used, then lowest index (so the choice is deterministic). None when
    even evicting them all is not enough.
    """
    if need_bytes <= 0:
        return np.zeros(0, dtype=np.int64)
    candidates = np.flatnonzero(evictable)
    if candidates.size == 0 or nbytes[candidates].sum() < need_bytes:
        return None
    kept = np.ones(candidates.size, bool) if probation is None else ~probation[candidates]
    order = np.lexsort(
        (candidates, last_used[candidates], heat[candidates], pinned_mask[candidates], kept)
    )
    ranked = candidates[order]
    freed = np.cumsum(nbytes[ranked])
    take = int(np.searchsorted(freed, need_bytes)) + 1
    return ranked[:take]
