"""`GET /metrics` of `shoal serve` in Prometheus's text format (prometheus_client): requests
counted as answered, each worker's round trip and compute per MoE call and the streams'
latencies as histograms, the rest read from the dashboard's state at each scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.cluster.member import Member
from coordinator.server.batching import EngineStats
from proto import shoal_pb2

# Paths counted by name; any other is counted as "other", so a scan of random URLs cannot
# grow the number of series without bound.
# Every route by name, the rest pooled as "other": a label per path a client makes up would
# grow the registry without bound. /api/ is shared by the dashboard's endpoints and Ollama's.
COUNTED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/v1/messages",
    "/v1/messages/count_tokens", "/health", "/", "/metrics",
    "/api/auth", "/api/cluster", "/api/speed", "/api/heat", "/api/rebalance",
    "/api/rebalance/plan",
    "/api/chat", "/api/generate", "/api/tags", "/api/ps", "/api/show", "/api/version",
})
# A MoE layer call takes from tens of microseconds (loopback) to tens of milliseconds.
TIME_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                0.5, 1.0, 2.5)


@dataclass(frozen=True)
class Figures:
    """What a scrape reports besides the counted requests and the histograms."""

    batching: EngineStats
    in_flight: int
    batch_width: float  # tokens per decode step over the last sample
    decode_tps: float  # over the last sample
    members: Sequence[Member]
    worker_stats: Mapping[str, shoal_pb2.WorkerStats]  # latest, by address
    rebalance: dict  # the dashboard's rebalance run (state, steps_done, ...)
    latencies: dict = field(default_factory=dict)  # Latencies.histograms()
    prompt_cache: dict = field(default_factory=dict)  # BatchEngine.prompt_cache
    drafting: dict | None = None  # BatchEngine.drafting_stats(), None without a draft


class Metrics:
    """The registry of one server (not prometheus_client's global one, so that several
    servers in one process, as in tests, do not share counters)."""

    def __init__(self, figures: Callable[[], Figures]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("shoal_requests", "HTTP requests answered, by path and status",
                                ["path", "code"], registry=self.registry)
        self.round_trip = Histogram(
            "shoal_worker_round_trip_seconds", "Per MoE layer call and worker: first request "
            "sent to last reply read", ["worker"], buckets=TIME_BUCKETS, registry=self.registry)
        self.compute = Histogram(
            "shoal_worker_compute_seconds", "Per MoE layer call and worker: the time it "
            "reported computing", ["worker"], buckets=TIME_BUCKETS, registry=self.registry)
        self.registry.register(_Collector(figures))

    def observe_worker(self, address: str, round_trip: float, compute: float) -> None:
        """One worker's part of one MoE layer call (called on the generation thread)."""
        self.round_trip.labels(address).observe(round_trip)
        self.compute.labels(address).observe(compute)

    def middleware(self) -> Middleware:
        return Middleware(_CountRequests, counter=self.requests)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    async def endpoint(self, request: Request) -> Response:
        return Response(self.text(), media_type=CONTENT_TYPE_LATEST)


class _CountRequests:
    """ASGI middleware: count each HTTP request by path and status when its answer starts."""

    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in COUNTED_PATHS else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


class _Collector:
    """Reads the figures at each scrape and reports them as metric families."""

    def __init__(self, figures: Callable[[], Figures]) -> None:
        self.figures = figures

    def describe(self) -> list[Metric]:
        return []  # the families are known only once read: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        f = self.figures()
        b = f.batching
        yield _counter("shoal_decoded_tokens", "Tokens decoded: one per request in each decode "
                       "step (a request's end token included)", b.decode_rows)
        yield _counter("shoal_decode_steps", "Decode steps of the batch", b.decode_steps)
        prompt = CounterMetricFamily("shoal_prompt_tokens", "Prompt tokens, computed or taken "
                                     "from the prompt cache", labels=["source"])
        prompt.add_metric(["computed"], b.prompt_tokens)
        prompt.add_metric(["cache"], b.cached_tokens - b.disk_cached_tokens)
        prompt.add_metric(["disk"], b.disk_cached_tokens)
        yield prompt
        for name, doc in (("first_token", "Seconds from a request's arrival to its first "
                           "token"), ("gap", "Seconds between two tokens of a running stream")):
            if name in f.latencies:
                buckets, total = f.latencies[name]
                yield HistogramMetricFamily(f"shoal_{name}_seconds", doc, buckets=buckets,
                                            sum_value=total)
        disk = f.prompt_cache.get("disk")
        if disk is not None:
            yield _gauge("shoal_prompt_cache_disk_bytes", "Bytes of prompt cache files on "
                         "disk", disk["bytes"])
        yield _counter("shoal_failed_steps", "Generation steps that failed", b.failed_steps)
        yield _gauge("shoal_requests_in_flight", "Requests submitted and not finished",
                     f.in_flight)
        yield _gauge("shoal_batch_width", "Requests per decode step over the last second",
                     f.batch_width)
        yield _gauge("shoal_widest_batch", "The most requests one decode step carried",
                     b.widest_step)
        yield _gauge("shoal_decode_tokens_per_second", "Tokens decoded per second over the "
                     "last second", f.decode_tps)
        if f.drafting is not None:
            yield from _drafting_families(f.drafting)
        yield from _worker_families(f.members, f.worker_stats)
        r = f.rebalance
        yield _gauge("shoal_rebalance_running", "1 while a live rebalance runs",
                     float(r.get("state") == "running"))
        yield _gauge("shoal_rebalance_steps_done", "Steps done by the latest live rebalance",
                     r.get("steps_done", 0))
        yield _gauge("shoal_rebalance_steps_planned", "Steps planned for the latest live "
                     "rebalance", r.get("steps_planned") or 0)
        yield _gauge("shoal_rebalance_bytes_sent", "Bytes the latest live rebalance sent",
                     r.get("bytes_sent", 0))


def _worker_families(members: Sequence[Member],
                     stats: Mapping[str, shoal_pb2.WorkerStats]) -> Iterator[Metric]:
    labels = ["worker", "node_id"]
    healthy = GaugeMetricFamily("shoal_worker_healthy", "1 if the worker is healthy",
                                labels=labels)
    rtt = GaugeMetricFamily("shoal_worker_health_check_seconds", "Smoothed round trip of the "
                            "worker's health checks", labels=labels)
    hits = CounterMetricFamily("shoal_worker_cache_hits", "Expert uses found resident in the "
                               "worker's memory, since it started", labels=labels)
    demands = CounterMetricFamily("shoal_worker_cache_demands", "Expert uses asked of the "
                                  "worker, since it started", labels=labels)
    reads = CounterMetricFamily("shoal_worker_drive_reads", "Expert files read from the "
                                "worker's drives, since it started", labels=labels)
    resident = GaugeMetricFamily("shoal_worker_resident_bytes", "Bytes of experts in the "
                                 "worker's memory", labels=labels)
    budget = GaugeMetricFamily("shoal_worker_memory_budget_bytes", "The worker's memory "
                               "budget for experts", labels=labels)
    for m in members:
        names = [m.address, m.node_id]
        healthy.add_metric(names, float(m.state == "healthy"))
        if m.rtt_ms is not None:
            rtt.add_metric(names, m.rtt_ms / 1e3)
        s = stats.get(m.address)
        if s is not None:
            hits.add_metric(names, s.hits)
            demands.add_metric(names, s.demands)
            reads.add_metric(names, sum(d.reads for d in s.drives))
            resident.add_metric(names, s.resident_bytes)
            budget.add_metric(names, s.memory_budget)
    yield from (healthy, rtt, hits, demands, reads, resident, budget)


def _drafting_families(d: dict) -> Iterator[Metric]:
    """The draft's figures (serve --draft): a stream decoding alone goes through it."""
    steps = CounterMetricFamily("shoal_draft_steps", "Forwards of the model for a stream "
                                "decoding with the draft, by kind", labels=["kind"])
    steps.add_metric(["verify"], d["verify_steps"])
    steps.add_metric(["plain"], d["plain_steps"])
    yield steps
    yield _counter("shoal_draft_proposed_tokens", "Tokens the draft proposed", d["proposed"])
    yield _counter("shoal_draft_accepted_tokens", "Proposed tokens the model agreed with",
                   d["accepted"])
    yield _counter("shoal_draft_decoded_tokens", "Tokens decoded through the draft's path",
                   d["tokens"])
    yield _gauge("shoal_draft_acceptance", "Accepted over proposed tokens, since the start",
                 d["acceptance_rate"])
    yield _gauge("shoal_draft_tokens_per_step", "Tokens per forward of the model on the "
                 "draft's path, since the start", d["tokens_per_step"])


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
