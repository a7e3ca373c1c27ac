"""What a stream's reader feels: the time from a request's arrival to its first token, and the
gaps between the tokens of a running stream (which a long prompt's prefill would stretch),
kept as cumulative histograms for /metrics and recent samples for the dashboard."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

# From a decode step on loopback to a long prompt's prefill over a slow link.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RECENT = 2048  # samples the dashboard's percentiles are taken over


@dataclass
class Series:
    """One latency's histogram (counts per bucket of LATENCY_BUCKETS, then +Inf) and the
    latest samples."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds
        self.recent.append(seconds)

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, observations at or below it), as Prometheus's histograms list them."""
        out, running = [], 0
        for bound, n in zip((*map(str, LATENCY_BUCKETS), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out

    def summary(self) -> dict:
        ordered = sorted(self.recent)
        if not ordered:
            return {"count": 0, "p50": None, "p99": None, "max": None}

        def at(q: float) -> float:
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

        return {"count": sum(self.counts), "p50": at(0.5), "p99": at(0.99),
                "max": round(ordered[-1], 4)}


class Latencies:
    """Time to first token and inter-token gaps; written by the engine's thread, read by the
    scrapes and the dashboard."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.first_token = Series()
        self.gap = Series()

    def observe(self, *, first_token: float | None = None, gap: float | None = None) -> None:
        with self._lock:
            if first_token is not None:
                self.first_token.observe(first_token)
            if gap is not None:
                self.gap.observe(gap)

    def histograms(self) -> dict[str, tuple[list[tuple[str, int]], float]]:
        with self._lock:
            return {"first_token": (self.first_token.cumulative(), self.first_token.total),
                    "gap": (self.gap.cumulative(), self.gap.total)}

    def summary(self) -> dict:
        with self._lock:
            return {"first_token": self.first_token.summary(), "gap": self.gap.summary()}
