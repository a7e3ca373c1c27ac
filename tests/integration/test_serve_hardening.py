"""`shoal serve` under abuse, against the real server process and two real workers: thousands
of idle connections from a helper process, slowloris headers, big bodies, nested JSON, lone
surrogates, and SIGTERM or SIGINT with streams open. The servers here take an API key, as one
open to others would: during each flood a fresh client sending the key must be served within
FRESH_CLIENT_SECONDS, a stream already running must never wait more than STREAM_PAUSE_SECONDS
for its next token, and the server's memory and log must stay bounded. These are bounds that
hold on a busy machine; the speed a stream keeps under a flood is a benchmark's figure
(benchmarks/probes/flood_rate.py)."""

import json
import re
import signal
import threading
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from coordinator.ops.heat_record import load_record, record_path
from coordinator.ops.local_processes import LocalServer, start_server, start_workers, stop_workers
from engine.manifest import read_manifest
from engine.sharding import shard
from tests.integration import socket_flood

pytestmark = pytest.mark.slow

# Bounds that tell "served" from "locked out" on a busy machine: a client locked out waits
# for its own timeout (10 s and more), a starved stream for the whole flood window.
FRESH_CLIENT_SECONDS = 5.0
FLOOD_WINDOW_SECONDS = 10.0
BIG_BODIES_SECONDS = 240  # all the big bodies answered, after the window
STREAM_PAUSE_SECONDS = 6.0  # the longest a running stream may wait for a token meanwhile
API_KEY = "sk-shoal-hardening-test"
KEYED = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, secret_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-hardening")
    sharded = root / "sharded"
    shard(tiny_checkpoint("qwen3_moe"), sharded, workers=2, progress=False)
    workers = start_workers([[sharded / "worker-0"], [sharded / "worker-1"]], secret_file,
                            root / "logs")
    yield sharded, workers, root
    stop_workers(workers)


def _start(cluster, secret_file, name: str, *extra: str) -> LocalServer:
    sharded, workers, root = cluster
    key_file = root / "api-key"
    key_file.write_text(API_KEY + "\n")
    return start_server(sharded, [w.address for w in workers], secret_file,
                        root / f"{name}.log", ("--api-key-file", str(key_file),
                                               "--prompt-cache-dir", str(root / "cache"), *extra))


@pytest.fixture(scope="module")
def server(cluster, secret_file):
    # A context far above the model's, so that a prompt of megabytes is really tokenized
    # (and then refused: its max_tokens does not fit) instead of refused by its length.
    local = _start(cluster, secret_file, "serve", "--context", "4000000")
    yield local
    local.stop()


def _client(server: LocalServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=30)


def _rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks


class Stream:
    """A streamed completion read on its own thread, each chunk's arrival time kept."""

    def __init__(self, server: LocalServer, max_tokens: int = 3500) -> None:
        self.times: list[float] = []
        self.lines: list[str] = []
        self.error: BaseException | None = None
        self._closing = False
        body = {"prompt": "hello there", "max_tokens": max_tokens, "temperature": 0,
                "stream": True}
        self._thread = threading.Thread(target=self._run, args=(server.url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=KEYED,
                              timeout=60) as reply:
                for line in reply.iter_lines():
                    if self._closing:
                        return  # leaving the block closes the connection: the server cancels
                    if line.startswith("data:"):
                        self.lines.append(line)
                        self.times.append(time.monotonic())
        except BaseException as e:  # noqa: BLE001 (read by the test)
            self.error = e

    def rate(self, start: float, end: float) -> float:
        """Chunks per second that arrived between `start` and `end`."""
        return sum(start <= t < end for t in self.times) / (end - start)

    def longest_pause(self, start: float, end: float) -> float:
        """The longest wait for a chunk between `start` and `end` (to `end` after the last)."""
        times = [start, *(t for t in self.times if start <= t < end), end]
        return max(b - a for a, b in zip(times, times[1:], strict=False))

    def wait_started(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < 5:
            assert time.monotonic() < deadline and self.error is None, self.error
            time.sleep(0.05)

    def close(self) -> None:
        self._closing = True
        self.join(10)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream did not end"


def _fresh_client_seconds(server: LocalServer) -> list[float]:
    """How long /health and a two-token completion took for a new client, each."""
    took = []
    started = time.monotonic()
    health = httpx.get(server.url + "/health", headers=KEYED, timeout=10)
    took.append(time.monotonic() - started)
    assert health.status_code == 200, health.text
    started = time.monotonic()
    reply = _client(server).completions.create(model="sharded", prompt="hi", max_tokens=2,
                                               temperature=0)
    took.append(time.monotonic() - started)
    assert reply.choices[0].finish_reason in ("stop", "length")
    return took


def _window(server: LocalServer, stream: Stream, seconds: float) -> dict:
    """The stream's rate over `seconds` while a fresh client comes every second."""
    started = time.monotonic()
    fresh, files = [], []
    while time.monotonic() - started < seconds:
        fresh += _fresh_client_seconds(server)
        files.append(socket_flood.open_files(server.proc.pid))
        time.sleep(1.0)
    ended = time.monotonic()
    return {"rate": stream.rate(started, ended), "fresh": fresh, "files": max(files),
            "seconds": ended - started, "pause": stream.longest_pause(started, ended)}


def _under_flood(server: LocalServer, mode: str, sockets: int, hosts: int) -> dict:
    """A stream's rate for 6 s, then during a flood, fresh clients coming in both.
    Returns the figures."""
    stream = Stream(server)
    stream.wait_started()
    calm = _window(server, stream, 6.0)
    rss_before, log_before = _rss_mb(server.proc.pid), server.log.stat().st_size
    seconds = FLOOD_WINDOW_SECONDS + 2
    address = server.url.removeprefix("http://")
    flood = socket_flood.start(address, mode=mode, sockets=sockets, hosts=hosts,
                               seconds=seconds)
    cpu_before = _cpu_seconds(server.proc.pid), _cpu_seconds(flood.pid)
    flooded = _window(server, stream, FLOOD_WINDOW_SECONDS)
    cpu = [(_cpu_seconds(pid) - was) / flooded["seconds"]
           for pid, was in zip((server.proc.pid, flood.pid), cpu_before, strict=True)]
    rss_after = _rss_mb(server.proc.pid)
    report = socket_flood.report(flood, seconds)
    health = httpx.get(server.url + "/health", headers=KEYED, timeout=10).json()
    keyless = httpx.get(server.url + "/health", timeout=10).status_code
    stream.close()
    return {"baseline_rate": calm["rate"], "flood_rate": flooded["rate"],
            "longest_pause": flooded["pause"],
            "fresh_seconds": calm["fresh"] + flooded["fresh"],
            "rss_growth_mb": rss_after - rss_before, "most_open_files": flooded["files"],
            "log_growth": server.log.stat().st_size - log_before, "flood": report,
            "connections": health.get("connections"), "server_cores": cpu[0],
            "flood_cores": cpu[1], "stream_error": stream.error, "keyless_status": keyless}


def _check_flood(figures: dict) -> None:
    print(json.dumps({k: v for k, v in figures.items() if k != "stream_error"}, default=str))
    assert figures["stream_error"] is None, figures["stream_error"]
    assert figures["keyless_status"] == 401  # the fresh clients were served as key holders
    assert max(figures["fresh_seconds"]) < FRESH_CLIENT_SECONDS, figures
    assert figures["longest_pause"] < STREAM_PAUSE_SECONDS, figures
    assert figures["rss_growth_mb"] < 150, figures
    assert figures["log_growth"] < 4096, figures


def test_thousands_of_idle_connections_lock_out_no_one(server):
    """3000 sockets that never send a byte, from 100 addresses (30 each: the total cap, 1024,
    fills and the idle ones are closed for newcomers), then from one (64 per address)."""
    figures = _under_flood(server, "idle", sockets=3000, hosts=100)
    _check_flood(figures)
    soft = socket_flood.soft_file_limit(server.proc.pid)
    assert soft > 2048  # raised above mlx-lm's 2048
    # the idle ones were closed: evicted for newcomers, or at the header deadline first
    assert figures["connections"]["evicted"] + figures["connections"]["timed_out"] > 0
    assert figures["most_open_files"] < soft
    alone = _under_flood(server, "idle", sockets=2000, hosts=1)
    _check_flood(alone)
    assert alone["connections"]["refused"] > 0
    assert alone["flood"]["held_at_end"] <= 64 + 10


def test_slowloris_headers_are_cut_at_the_header_deadline(server):
    """900 connections (under the caps, so only the deadline closes them) that send a
    request's first line and then one byte of a header a second, forever."""
    figures = _under_flood(server, "slowloris", sockets=900, hosts=30)
    _check_flood(figures)
    report = figures["flood"]
    assert report["closed_by_server"] >= 900  # every one of the first round was closed
    assert 4.5 <= report["median_age_closed"] <= 7.0, report  # the 5 s header deadline
    assert figures["connections"]["timed_out"] >= 900


def _post(server: LocalServer, path: str, content, timeout: float = 60,
          **headers) -> httpx.Response:
    return httpx.post(server.url + path, content=content, timeout=timeout,
                      headers={"Content-Type": "application/json", **KEYED, **headers})


@pytest.mark.long
def test_a_big_body_gets_413_and_freezes_nothing(server):
    """Bodies of 20 MB (declared, chunked, and through the openai client) get 413; one just
    under the 4 MiB limit is tokenized (seconds) and refused after: meanwhile /health and
    fresh clients answer and a running stream never waits long for its next token."""
    stream = Stream(server)
    stream.wait_started()
    calm = _window(server, stream, 6.0)
    rss_before = _rss_mb(server.proc.pid)
    body = json.dumps({"prompt": "x" * (20 << 20), "max_tokens": 4}).encode()
    tokenized = json.dumps({"prompt": "the quick brown fox jumps over the lazy dog " * 90000,
                            "max_tokens": 3999999}).encode()
    results: dict[str, object] = {}

    def send_big() -> None:
        try:
            send_each()
        except Exception as e:  # noqa: BLE001 (read by the test)
            results["error"] = e

    def send_each() -> None:
        results["declared"] = _post(server, "/v1/completions", body)
        # Without a Content-Length: refused once 4 MiB have arrived.
        results["chunked"] = _post(server, "/v1/completions",
                                   (body[i:i + 65536] for i in range(0, len(body), 65536)))
        with pytest.raises(openai.APIStatusError) as caught:
            _client(server).completions.create(model="x", prompt="y" * (20 << 20),
                                               max_tokens=4)
        results["openai"] = caught.value
        for i in range(2):  # twice: what it takes is given back, not kept
            # answered within the test's bound, however long tokenizing takes on a busy machine
            results[f"tokenized{i}"] = _post(server, "/v1/completions", tokenized,
                                             timeout=BIG_BODIES_SECONDS)
            results[f"rss{i}"] = _rss_mb(server.proc.pid)

    sender = threading.Thread(target=send_big)
    sender.start()
    busy = _window(server, stream, FLOOD_WINDOW_SECONDS)
    sender.join(BIG_BODIES_SECONDS)  # tokenizing 3.9 MB twice takes long on a busy machine
    assert not sender.is_alive(), f"the big bodies were not answered in {BIG_BODIES_SECONDS} s"
    assert "error" not in results, results["error"]
    stream.close()
    figures = {"baseline_rate": calm["rate"], "rate": busy["rate"], "pause": busy["pause"],
               "slowest_fresh": max(busy["fresh"]), "rss_before": rss_before,
               "rss_after_each": [results["rss0"], results["rss1"]]}
    print(json.dumps(figures))
    for name in ("declared", "chunked"):
        reply = results[name]
        assert reply.status_code == 413, reply.text
        assert "--max-body" in reply.json()["error"]["message"]
    assert results["openai"].status_code == 413
    for i in range(2):
        reply = results[f"tokenized{i}"]
        assert reply.status_code == 400 and "does not fit" in reply.text, reply.text
    assert max(busy["fresh"]) < FRESH_CLIENT_SECONDS, busy
    assert busy["pause"] < STREAM_PAUSE_SECONDS, figures
    assert results["rss1"] - rss_before < 400, figures
    assert stream.error is None


NESTED = 100_000


@pytest.mark.parametrize("content,message", [
    ("[" * NESTED + "]" * NESTED, "nests deeper"),
    ('{"prompt": ' + "[" * NESTED + "]" * NESTED + ', "max_tokens": 2}', "nests deeper"),
    ('{"prompt": "hi", "model": ' + "[" * 100 + "]" * 100 + "}", "nests deeper"),
    ('{"prompt": "a\\ud800b", "max_tokens": 2}', "not valid Unicode"),
    ('{"prompt": ["\\udfff"], "max_tokens": 2}', "not valid Unicode"),
    ('{"prompt": "hi", "stop": ["\\ud800"]}', "not valid Unicode"),
])
def test_nested_json_and_lone_surrogates_get_400(server, content, message):
    reply = _post(server, "/v1/completions", content.encode())
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]


def test_a_lone_surrogate_in_a_chat_message_gets_400(server):
    content = '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'
    reply = _post(server, "/v1/chat/completions", content.encode())
    assert reply.status_code == 400 and "not valid Unicode" in reply.text, reply.text
    paired = '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'
    assert _post(server, "/v1/chat/completions", paired.encode()).status_code == 200


# Every route that takes a body, in each API's error shape.
OTHER_APIS = {
    "/v1/messages": lambda reply: reply.json()["error"]["message"],
    "/v1/messages/count_tokens": lambda reply: reply.json()["error"]["message"],
    "/api/chat": lambda reply: reply.json()["error"],
    "/api/generate": lambda reply: reply.json()["error"],
    "/api/show": lambda reply: reply.json()["error"],
}


@pytest.mark.parametrize("path", OTHER_APIS)
def test_the_anthropic_and_ollama_routes_hold_the_same_limits(server, path):
    message = OTHER_APIS[path]
    big = _post(server, path, b'{"prompt": "' + b"x" * (5 << 20) + b'"}')
    assert big.status_code == 413 and "--max-body" in message(big), big.text
    if path.startswith("/v1/"):
        assert big.json()["error"]["type"] == "request_too_large"
    nested = _post(server, path, ("[" * NESTED + "]" * NESTED).encode())
    assert nested.status_code == 400 and "nests deeper" in message(nested), nested.text
    lone = '{"model": "x", "max_tokens": 2, "prompt": "\\ud800", "messages": []}'
    surrogate = _post(server, path, lone.encode())
    assert surrogate.status_code == 400, surrogate.text
    assert "not valid Unicode" in message(surrogate)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_ends_every_open_stream_and_records_the_heat(cluster, secret_file, sig):
    sharded = cluster[0]
    manifest = read_manifest(sharded)
    before = load_record(record_path(sharded), manifest.fingerprint).total()
    local = _start(cluster, secret_file, f"stop-{sig.name}")
    try:
        streams = [Stream(local) for _ in range(4)]
        for stream in streams:
            stream.wait_started()
        whole: dict[str, object] = {}

        def unstreamed() -> None:
            whole["reply"] = httpx.post(local.url + "/v1/completions", headers=KEYED, json={
                "prompt": "hello", "max_tokens": 3500, "temperature": 0}, timeout=60)

        waiting = threading.Thread(target=unstreamed)
        waiting.start()
        time.sleep(0.5)
        stopped = time.monotonic()
        local.proc.send_signal(sig)
        code = local.proc.wait(30)
        took = time.monotonic() - stopped
    finally:
        local.stop()
    print(json.dumps({"stop": sig.name, "seconds_to_exit": took, "status": code}))
    for stream in streams:
        stream.join(10)
        assert stream.error is None, stream.error
        assert stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
        assert "shutting down" in stream.lines[-2], stream.lines[-2]
    waiting.join(10)
    assert whole["reply"].status_code == 503 and "shutting down" in whole["reply"].text
    assert code == 0, local.log.read_text()[-2000:]
    assert took < 15, took
    after = load_record(record_path(sharded), manifest.fingerprint).total()
    assert sum(after.values()) > sum(before.values())  # this server's tokens were recorded
    assert "Traceback" not in local.log.read_text()


DRAIN_SECONDS = 120


def test_a_stop_lets_the_streams_in_flight_finish_within_the_drain_and_refuses_new_ones(
    cluster, secret_file
):
    # A drain far longer than 4 x 400 tokens take even on a busy machine: what must hold is
    # that they finish inside it, whatever the machine's speed.
    local = _start(cluster, secret_file, "drain", "--drain-seconds", str(DRAIN_SECONDS))
    try:
        streams = [Stream(local, max_tokens=400) for _ in range(4)]
        for stream in streams:
            stream.wait_started()
        stopped = time.monotonic()
        local.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # refused: the listener is closed, or the request answered 503
            late: object = httpx.post(local.url + "/v1/completions", headers=KEYED, timeout=10,
                                      json={"prompt": "hi", "max_tokens": 2}).status_code
        except httpx.TransportError as e:
            late = type(e).__name__
        for stream in streams:
            stream.join(DRAIN_SECONDS + 5)
        finished = time.monotonic() - stopped
        code = local.proc.wait(30)
    finally:
        local.stop()
    print(json.dumps({"streams_finished_after": finished, "late_request": late}))
    for stream in streams:
        assert stream.error is None, stream.error
        assert stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
        last = json.loads(stream.lines[-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "length", last
        # in flight at the stop: the drain, not the time before it, carried them to the end
        assert sum(t > stopped for t in stream.times) >= 10, (len(stream.times), stopped)
    assert late in (503, "ConnectError"), late
    assert finished < DRAIN_SECONDS, finished
    assert code == 0, local.log.read_text()[-2000:]
    assert "Traceback" not in local.log.read_text()
