"""Shoal's side of `shoal bench`: the cluster of two local workers (optionally behind the
Thunderbolt-like network), the coordinator serving stores itself, and the bare echo floor."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.checkpoints import WORKERS
from benchmarks.echo import lane_round_trips, round_trips
from benchmarks.measure import bench_prompt, decode_and_prefill, timed_generation
from benchmarks.network import ThunderboltNetwork
from benchmarks.own_process import own_process_figures
from benchmarks.records import REPO
from coordinator.dataplane.link import LANE, Transport
from coordinator.decoding.generate import open_remote_model
from coordinator.ops.local_processes import start_workers, stop_process, stop_workers
from engine.auth import load_secret
from engine.errors import ShoalError
from proto import EXPERT_REPLY, EXPERT_REQUEST, shoal_pb2
from proto.wire import decode


def measure_shoal_on(network: str, sharded: Path, settings: dict, secret_file: Path,
                     log_dir: Path, transport: Transport) -> dict:
    if network == "loopback":
        return measure_shoal(sharded, settings, secret_file, log_dir, None, transport)
    net = ThunderboltNetwork.build(WORKERS)
    try:
        return measure_shoal(sharded, settings, secret_file, log_dir, net, transport)
    finally:
        net.close()


def measure_shoal(sharded: Path, settings: dict, secret_file: Path, log_dir: Path,
                  net: ThunderboltNetwork | None, transport: Transport = LANE) -> dict:
    """Decode/prefill figures, then per-layer dispatch figures of decode alone (a prefill-only
    generation's counters subtracted from a prefill+decode one), then the echo floor over the
    same network. With `net`, each worker runs in its namespace behind a delay relay."""
    places = net.places() if net else ()
    workers = start_workers([[sharded / f"worker-{k}"] for k in range(WORKERS)], secret_file,
                            log_dir, places)
    try:
        addresses = [net.relay(w.address) if net else w.address for w in workers]
        remote = open_remote_model(sharded, addresses, load_secret(secret_file),
                                   transport=transport)
        try:
            if net:  # each expert lane through a relay of its own too
                for link, worker in zip(remote.cluster.links, workers, strict=True):
                    if worker.lane_address:
                        link.lane_address = net.relay(worker.lane_address)
            vocab = remote.manifest.config["vocab_size"]
            figures = decode_and_prefill(remote.model, remote.tokenizer, vocab,
                                         lengths=settings["lengths"],
                                         decode_tokens=settings["decode_tokens"],
                                         runs=settings["runs"], long_runs=settings["long_runs"],
                                         dispatcher=remote.dispatcher)
            figures["dispatch"] = decode_dispatch(remote, vocab, settings["decode_tokens"],
                                                  max(settings["lengths"]))
            width = int(remote.manifest.config["hidden_size"])
            k = int(remote.manifest.config["num_experts_per_tok"])
            longest = max(settings["lengths"])
            # one worker's share with two workers: half the (token, expert) pairs
            figures["serialization_us"] = {
                "decode": serialization_us(width, 1, k // WORKERS),
                f"prefill{longest}": serialization_us(width, longest, longest * k // WORKERS,
                                                      repeat=5),
            }
        finally:
            remote.close()
    finally:
        stop_workers(workers)
    figures["echo"] = echo_floor(figures["dispatch"], settings["echo_round_trips"], log_dir, net,
                                 secret_file)
    return figures


def measure_shoal_local(sharded: Path, settings: dict, secret_file: Path, log_dir: Path,
                        *, remote_stores: int) -> dict:
    """The coordinator serving stores itself, in process (dataplane/local_experts.py): every
    store local ("one Mac, all local"), or the first local and the others behind workers on
    loopback ("one local + one remote")."""
    stores = [sharded / f"worker-{k}" for k in range(WORKERS)]
    local, remote_ones = stores[:WORKERS - remote_stores], stores[WORKERS - remote_stores:]
    workers = start_workers([[store] for store in remote_ones], secret_file, log_dir) \
        if remote_ones else []
    try:
        remote = open_remote_model(sharded, [w.address for w in workers],
                                   load_secret(secret_file) if workers else b"",
                                   local_stores=local)
        try:
            return decode_and_prefill(remote.model, remote.tokenizer,
                                      remote.manifest.config["vocab_size"],
                                      lengths=settings["lengths"],
                                      decode_tokens=settings["decode_tokens"],
                                      runs=settings["runs"], long_runs=settings["long_runs"],
                                      dispatcher=remote.dispatcher)
        finally:
            remote.close()
    finally:
        stop_workers(workers)


def decode_dispatch(remote, vocab: int, tokens: int, prefill_length: int) -> dict:
    """Per-layer dispatch figures of decode, from the dispatcher's own split of decode calls
    (one new position per sequence) from prompt passes, as `generate --stats` reports them."""
    stats = remote.dispatcher.stats

    def generation(length: int, max_tokens: int) -> None:
        stats.reset()
        timed_generation(remote.model, remote.tokenizer, bench_prompt(vocab, length),
                         max_tokens)

    generation(16, tokens)
    d, layers = stats.decode, len(stats.layers)
    steps = d.calls / layers  # decode steps that went through every MoE layer
    generation(prefill_length, 1)
    return {
        "tokens": tokens,
        "moe_layers": layers,
        "layer_ms": 1e3 * d.seconds / d.calls,
        "worker_compute_ms_per_request": 1e3 * d.worker_compute_seconds / d.requests,
        # a call lasts as long as its slowest worker: the overhead is measured against that
        "slowest_worker_compute_ms": 1e3 * d.slowest_compute_seconds / d.calls,
        "shared_expert_ms": 1e3 * d.shared_seconds / d.calls,
        "rpcs_per_token_per_layer": d.requests / d.calls,
        "workers_per_layer": d.requests / d.calls,
        "bytes_sent_per_token": d.bytes_sent / steps,
        "bytes_received_per_token": d.bytes_received / steps,
        "request_bytes": d.bytes_sent / d.requests,
        "reply_bytes": d.bytes_received / d.requests,
        "breakdown": d.breakdown(),
        "prefill_length": prefill_length,
        "prefill_breakdown": stats.prefill.breakdown(),  # the prompt's pass, not its last token
        # requests a prompt pass's layer call sends: a worker's share may go as pieces
        "prefill_requests_per_call": stats.prefill.requests / max(stats.prefill.calls, 1),
    }


def serialization_us(width: int, rows: int, pairs: int, repeat: int = 50) -> dict:
    """Microseconds of CPU to turn one worker's request of `rows` hidden states and `pairs`
    (row, expert) pairs, and its reply, into wire bytes and back, as the two ends do."""
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((rows, width)).astype(np.float32)
    outputs = rng.standard_normal((pairs, width)).astype(np.float32)
    index = np.arange(pairs, dtype=np.int32)

    def request() -> None:
        wire = EXPERT_REQUEST.write(shoal_pb2.ExpertRequest(seq=1, layer=1),
                                    hidden=(hidden, "float32"), rows=(index % rows, "int32"),
                                    experts=(index, "int32"))
        _, tensors = EXPERT_REQUEST.read(wire, "request")
        decode(tensors["hidden"], what="hidden", ndim=2)

    def reply() -> None:
        wire = EXPERT_REPLY.write(shoal_pb2.ExpertReply(seq=1), output=(outputs, "float32"))
        decode(EXPERT_REPLY.read(wire, "reply")[1]["output"], what="output", ndim=2)

    figures = {}
    for name, step in (("request", request), ("reply", reply)):
        step()
        started = time.perf_counter()
        for _ in range(repeat):
            step()
        figures[name] = 1e6 * (time.perf_counter() - started) / repeat
    return figures


def echo_floor(dispatch: dict, count: int, log_dir: Path, net: ThunderboltNetwork | None,
               secret_file: Path) -> dict:
    """The same fan-out and message sizes over bare gRPC streams to echo processes, placed
    where the workers were, over TLS as Shoal's links (and in plaintext: what TLS costs).
    Over the Thunderbolt-like network also without the relay and through a relay that adds
    no delay: what the relay itself costs."""
    fan_out = max(1, round(dispatch["workers_per_layer"]))
    identity = load_secret(secret_file).require_identity()
    servers = []
    try:
        # the first fan_out serve gRPC over TLS, the next plaintext, the last expert lanes
        for k in range(3 * fan_out):
            prefix, host = net.places()[k % fan_out] if net else ([], "127.0.0.1")
            tls = ["--secret-file", str(secret_file)] if k < fan_out or k >= 2 * fan_out else []
            lane = ["--lane"] if k >= 2 * fan_out else []
            log_file = open(log_dir / f"echo-{k}.log", "w")  # noqa: SIM115 (kept for the process)
            servers.append(subprocess.Popen(
                [*prefix, sys.executable, "-m", "benchmarks.echo", "serve", "--host", host,
                 "--reply-bytes", str(int(dispatch["reply_bytes"])), *tls, *lane],
                stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO,
            ))
        addresses = [wait_for_line(log_dir / f"echo-{k}.log", r"on (\S+:\d+)") for k in
                     range(3 * fan_out)]
        secure, plain = addresses[:fan_out], addresses[fan_out:2 * fan_out]
        lanes = addresses[2 * fan_out:]

        def floor(targets: list[str], tls: bool = True) -> float:
            return 1e3 * round_trips(targets, int(dispatch["request_bytes"]), count,
                                     identity=identity if tls else None)

        def lane_floor(targets: list[str]) -> float:
            return 1e3 * lane_round_trips(targets, int(dispatch["request_bytes"]), count,
                                          identity)

        if net is None:
            return {"streams": fan_out, "round_trip_ms": floor(secure),
                    "plaintext_ms": floor(plain, tls=False),
                    "lane_round_trip_ms": lane_floor(lanes)}
        return {"streams": fan_out,
                "round_trip_ms": floor([net.relay(a) for a in secure]),
                "lane_round_trip_ms": lane_floor([net.relay(a) for a in lanes]),
                "plaintext_ms": floor([net.relay(a) for a in plain], tls=False),
                "without_relay_ms": floor(secure),
                "relay_without_delay_ms": floor([net.relay(a, delay=0.0) for a in secure])}
    finally:
        for server in servers:
            stop_process(server, 30)


def wait_for_line(path: Path, pattern: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, path.read_text() if path.exists() else "")
        if match:
            return match.group(1)
        time.sleep(0.05)
    raise ShoalError(f"no line matching {pattern!r} in {path} after {timeout:.0f} s")


def measure_all_local(sharded: Path, settings: dict) -> dict:
    """One Mac, every store local, in a process of its own started as `shoal generate
    --local-store` starts: a coordinator with no worker keeps MLX's own launch setting
    (engine/process.py), which a process that has run workers no longer can."""
    figures = own_process_figures("Shoal with every store local", lambda out: [
        sys.executable, "-m", "benchmarks.baselines", "--all-local", str(sharded),
        "--settings", json.dumps(settings), "--out", str(out)])
    if "error" in figures:
        raise ShoalError(figures["error"])
    return figures
