"""/metrics without a server: the registry's text parsed by prometheus_client's own parser,
requests counted by the middleware as they are answered, worker timings as histograms."""

import asyncio
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from coordinator.cluster.member import Member
from coordinator.server.batching import EngineStats
from coordinator.server.latency import Latencies
from coordinator.server.metrics import Figures, Metrics
from engine.interfaces import Route as Path
from proto import shoal_pb2


def samples(metrics: Metrics) -> dict:
    out = {}
    for family in text_string_to_metric_families(metrics.text().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def figures(decoded: int) -> Figures:
    members = [Member(key="a", node_id="mac-a", address="10.0.0.2:1", state="healthy",
                      route=Path("10.0.0.2", "en0", "wired"), rtt_ms=2.0),
               Member(key="b", node_id="mac-b", address="10.0.0.3:1", state="unreachable",
                      route=Path("10.0.0.3", "en0", "wired"))]
    stats = {"10.0.0.2:1": shoal_pb2.WorkerStats(hits=7, demands=9, memory_budget=100)}
    return Figures(EngineStats(decode_steps=3, decode_rows=decoded, prompt_tokens=5),
                   2, 1.5, 12.0, members, stats,
                   {"state": "running", "steps_done": 4, "steps_planned": 9})


def test_the_figures_of_each_scrape_are_read_at_the_scrape():
    decoded = [10]
    metrics = Metrics(lambda: figures(decoded[0]))
    first = samples(metrics)
    decoded[0] = 25
    second = samples(metrics)
    assert first[("shoal_decoded_tokens_total", ())] == 10
    assert second[("shoal_decoded_tokens_total", ())] == 25
    assert second[("shoal_prompt_tokens_total", (("source", "computed"),))] == 5
    assert second[("shoal_batch_width", ())] == 1.5
    healthy = {k[1]: v for k, v in second.items() if k[0] == "shoal_worker_healthy"}
    assert healthy == {(("node_id", "mac-a"), ("worker", "10.0.0.2:1")): 1.0,
                       (("node_id", "mac-b"), ("worker", "10.0.0.3:1")): 0.0}
    assert second[("shoal_worker_cache_hits_total",
                   (("node_id", "mac-a"), ("worker", "10.0.0.2:1")))] == 7
    assert second[("shoal_rebalance_running", ())] == 1.0
    assert second[("shoal_rebalance_steps_planned", ())] == 9


def test_worker_timings_fill_one_histogram_per_worker():
    metrics = Metrics(lambda: figures(0))
    metrics.observe_worker("10.0.0.2:1", 0.002, 0.001)
    metrics.observe_worker("10.0.0.2:1", 0.2, 0.1)
    s = samples(metrics)
    label = (("worker", "10.0.0.2:1"),)
    assert s[("shoal_worker_round_trip_seconds_count", label)] == 2
    assert abs(s[("shoal_worker_round_trip_seconds_sum", label)] - 0.202) < 1e-9
    assert s[("shoal_worker_compute_seconds_bucket", (("le", "0.001"), *label))] == 1


def test_requests_are_counted_by_path_and_status_and_unknown_paths_pooled():
    metrics = Metrics(lambda: figures(0))

    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/health", ok), Route("/api/chat", ok)],
                    middleware=[metrics.middleware()])

    async def call(path: str) -> None:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b""}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "headers": [], "scheme": "http",
                 "server": ("test", 80), "root_path": "", "http_version": "1.1"}
        await app(scope, receive, send)

    for path in ("/health", "/health", "/api/chat", "/no/such/1", "/no/such/2", "/api/no-such"):
        asyncio.run(call(path))
    s = samples(metrics)
    assert s[("shoal_requests_total", (("code", "200"), ("path", "/health")))] == 2
    assert s[("shoal_requests_total", (("code", "200"), ("path", "/api/chat")))] == 1
    assert s[("shoal_requests_total", (("code", "404"), ("path", "other")))] == 3


def test_first_token_and_gap_times_are_histograms_and_the_disk_tier_a_source():
    latencies = Latencies()
    for gap in (0.004, 0.006, 0.02, 1.5):
        latencies.observe(gap=gap)
    latencies.observe(first_token=0.3)
    base = figures(1)
    metrics = Metrics(lambda: replace(
        base, batching=replace(base.batching, cached_tokens=9, disk_cached_tokens=4),
        latencies=latencies.histograms(),
        prompt_cache={"disk": {"entries": 1, "bytes": 4096}}))
    got = samples(metrics)
    assert got[("shoal_gap_seconds_bucket", (("le", "0.005"),))] == 1
    assert got[("shoal_gap_seconds_bucket", (("le", "0.025"),))] == 3
    assert got[("shoal_gap_seconds_bucket", (("le", "+Inf"),))] == 4
    assert got[("shoal_gap_seconds_count", ())] == 4
    assert got[("shoal_first_token_seconds_count", ())] == 1
    assert got[("shoal_prompt_tokens_total", (("source", "cache"),))] == 5
    assert got[("shoal_prompt_tokens_total", (("source", "disk"),))] == 4
    assert got[("shoal_prompt_cache_disk_bytes", ())] == 4096
    summary = latencies.summary()["gap"]
    assert summary["count"] == 4 and summary["p50"] == 0.02 and summary["max"] == 1.5
