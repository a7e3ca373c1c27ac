"""`shoal bench`: Shoal (two workers; one machine all local; one local store + one worker)
against mlx-lm (one process, and its own two-process distributed generation) and against bare
expert-lane and gRPC echoes, on one checkpoint, in one run.

The checkpoint is a DeepSeek-V3-shaped MoE (builders/synthetic.py, size "bench": hidden 1024,
64 routed experts + 1 shared, top-8, 12 layers, 4-bit), built once into the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.echo import lane_round_trips, round_trips
from benchmarks.measure import bench_prompt, decode_and_prefill, timed_generation
from benchmarks.network import ThunderboltNetwork
from builders.demo_models import build_once, cache_root
from builders.synthetic import build_checkpoint
from coordinator.generate import open_remote_model
from coordinator.link import LANE, Transport
from coordinator.ops.local_processes import start_workers, stop_workers
from coordinator.report import breakdown_table
from engine.auth import ensure_secret, load_secret
from engine.errors import ShoalError
from engine.manifest import read_manifest
from engine.process import environment_as_given
from engine.sharding import shard
from proto import EXPERT_REPLY, EXPERT_REQUEST, shoal_pb2
from proto.wire import decode

REPO = Path(__file__).resolve().parents[1]
# runs: generations at the shortest prompt (the decode figure); long_runs: at each longer one
FULL = {"size": "bench", "bits": 4, "group_size": 64, "lengths": [16, 128, 512],
        "decode_tokens": 32, "runs": 3, "long_runs": 1, "echo_round_trips": 300}
# float32: the tiny model's 4-bit scales are too narrow for mlx-lm's tensor-parallel split.
QUICK = {"size": "tiny", "bits": None, "group_size": 32, "lengths": [16, 64], "decode_tokens": 8,
         "runs": 1, "long_runs": 1, "echo_round_trips": 50}
NETWORKS = ("loopback", "thunderbolt")
WORKERS = 2


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def prepare(settings: dict, root: Path) -> tuple[Path, Path]:
    source = build_once(
        root / "source",
        lambda out: build_checkpoint(out, "deepseek_v3", size=settings["size"],
                                     quantize_bits=settings["bits"],
                                     group_size=settings["group_size"]),
        f"the {settings['size']} DeepSeek-V3-style checkpoint",
    )
    sharded = build_once(root / f"sharded-w{WORKERS}",
                         lambda out: shard(source, out, workers=WORKERS, progress=False),
                         f"{WORKERS} worker stores")
    return source, sharded


def bench_root(quick: bool) -> Path:
    return cache_root() / "bench" / ("quick" if quick else "full")


def bench_checkpoint(quick: bool, settings: dict | None = None) -> tuple[Path, Path]:
    """The bench's checkpoint (with `quick` the tiny one) and its worker stores, built once
    under Shoal's cache; `settings` in place of the preset's (its size, bits, group size)."""
    return prepare(settings or (QUICK if quick else FULL), bench_root(quick))


def bench_files(quick: bool, logs: str = "logs",
                settings: dict | None = None) -> tuple[Path, Path, Path, Path]:
    """What a run of the bench's cluster needs: `bench_checkpoint`'s two, the cluster's secret
    file, and a folder for the workers' logs."""
    source, sharded = bench_checkpoint(quick, settings)
    secret_file = bench_root(quick) / "secret"
    ensure_secret(secret_file)
    log_dir = bench_root(quick) / logs
    log_dir.mkdir(parents=True, exist_ok=True)
    return source, sharded, secret_file, log_dir


def baseline_env() -> dict[str, str]:
    """mlx-lm's baselines run as the user would run mlx-lm: without the launch setting Shoal
    gives its own processes (engine/process.py), with this checkout importable."""
    env = environment_as_given()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def baseline_figures(what: str, command: Callable[[Path], list[str]]) -> dict:
    """Run an mlx-lm baseline in processes of its own, `command(out)` writing its figures as
    JSON to `out`; the figures, or {"error": ...} naming `what` with the output's tail."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        run = subprocess.run(command(out), capture_output=True, text=True, timeout=1800,
                             cwd=REPO, env=baseline_env())
        if run.returncode != 0 or not out.exists():
            tail = (run.stdout + run.stderr).strip()[-800:]
            return {"error": f"{what} failed with {run.returncode}: {tail}"}
        return json.loads(out.read_text())


def measure_single(source: Path, settings: dict) -> dict:
    """mlx-lm in one process, a process of its own (MLX reads its CUDA launch setting once per
    process, and this one runs Shoal's coordinator with Shoal's)."""
    figures = baseline_figures("mlx-lm in one process", lambda out: [
        sys.executable, "-m", "benchmarks.bench", "--single", str(source),
        "--settings", json.dumps(settings), "--out", str(out)])
    if "error" in figures:  # every ratio is taken against it
        raise ShoalError(figures["error"])
    return figures


def measure_single_here(source: Path, settings: dict) -> dict:
    from mlx_lm.utils import load_model, load_tokenizer

    model, config = load_model(source)
    tokenizer = load_tokenizer(source)
    return decode_and_prefill(model, tokenizer, config["vocab_size"],
                              lengths=settings["lengths"],
                              decode_tokens=settings["decode_tokens"], runs=settings["runs"],
                              long_runs=settings["long_runs"])


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
                                         runs=settings["runs"], long_runs=settings["long_runs"])
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
    """The coordinator serving stores itself, in process (coordinator/local_experts.py): every
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
                                      runs=settings["runs"], long_runs=settings["long_runs"])
        finally:
            remote.close()
    finally:
        stop_workers(workers)


def measure_all_local(sharded: Path, settings: dict) -> dict:
    """One Mac, every store local, in a process of its own started as `shoal generate
    --local-store` starts: a coordinator with no worker keeps MLX's own launch setting
    (engine/process.py), which this process, having run workers, no longer can."""
    figures = baseline_figures("Shoal with every store local", lambda out: [
        sys.executable, "-m", "benchmarks.bench", "--all-local", str(sharded),
        "--settings", json.dumps(settings), "--out", str(out)])
    if "error" in figures:
        raise ShoalError(figures["error"])
    return figures


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
            server.terminate()
            server.wait(10)


def wait_for_line(path: Path, pattern: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, path.read_text() if path.exists() else "")
        if match:
            return match.group(1)
        time.sleep(0.05)
    raise ShoalError(f"no line matching {pattern!r} in {path} after {timeout:.0f} s")


def measure_mlx_distributed(source: Path, mode: str, settings: dict) -> dict:
    """mlx-lm's own generation over mx.distributed: 2 ranks, ring backend on loopback."""
    launcher = Path(sys.executable).with_name("mlx.launch")
    return baseline_figures(f"mlx.launch ({mode})", lambda out: [
        str(launcher), "-n", "2", "--backend", "ring", "--python", sys.executable,
        str(REPO / "benchmarks" / "mlx_distributed.py"), "--model", str(source),
        "--mode", mode, "--out", str(out),
        "--prompt-lengths", ",".join(map(str, settings["lengths"])),
        "--decode-tokens", str(settings["decode_tokens"]), "--runs", str(settings["runs"]),
        "--long-runs", str(settings["long_runs"])])


def measure_shoal_on(network: str, sharded: Path, settings: dict, secret_file: Path,
                     log_dir: Path, transport: Transport) -> dict:
    if network == "loopback":
        return measure_shoal(sharded, settings, secret_file, log_dir, None, transport)
    net = ThunderboltNetwork.build(WORKERS)
    try:
        return measure_shoal(sharded, settings, secret_file, log_dir, net, transport)
    finally:
        net.close()


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def run(*, quick: bool = False, plot: Path | None = None, network: str = "loopback",
        transport: Transport = LANE, **overrides: int | None) -> dict:
    """The whole comparison; `overrides` (runs, long_runs, decode_tokens) replace the
    preset's values. `network` "thunderbolt" puts Shoal's workers (and the echo servers)
    behind a Thunderbolt-like link (benchmarks/network.py); mlx-lm's baselines stay on
    loopback."""
    if network not in NETWORKS:
        raise ShoalError(f"unknown network {network!r}; choose {' or '.join(NETWORKS)}")
    settings = {**(QUICK if quick else FULL),
                **{k: v for k, v in overrides.items() if v is not None}, "network": network,
                "transport": transport.kind, "spin_us": round(transport.spin * 1e6)}
    source, sharded, secret_file, log_dir = bench_files(quick, settings=settings)

    steps: list[tuple[str, Callable[[], dict]]] = [
        ("mlx_lm_single", lambda: measure_single(source, settings)),
        ("shoal", lambda: measure_shoal_on(network, sharded, settings, secret_file, log_dir,
                                           transport)),
        ("shoal_one_mac_all_local", lambda: measure_all_local(sharded, settings)),
        ("shoal_one_local_one_remote", lambda: measure_shoal_local(
            sharded, settings, secret_file, log_dir, remote_stores=1)),
        ("mlx_lm_tensor_parallel", lambda: measure_mlx_distributed(source, "tensor", settings)),
        ("mlx_lm_pipeline_parallel",
         lambda: measure_mlx_distributed(source, "pipeline", settings)),
    ]
    results = {}
    for name, step in steps:
        log(f"measuring {name} ...")
        started = time.perf_counter()
        results[name] = step()
        log(f"{name} done in {time.perf_counter() - started:.0f} s")

    shoal, single = results["shoal"], results["mlx_lm_single"]
    tp = results["mlx_lm_tensor_parallel"]
    longest = str(max(settings["lengths"]))
    dispatch = shoal["dispatch"]
    overhead_ms = dispatch["layer_ms"] - dispatch["slowest_worker_compute_ms"]
    report = {
        "machine": machine(),
        "checkpoint": {"family": "deepseek_v3", "size": settings["size"],
                       "bits": settings["bits"],
                       "group_size": settings["group_size"],
                       "experts": len(read_manifest(sharded).experts),
                       "workers": WORKERS},
        "settings": settings,
        **results,
        "layer_overhead_ms": overhead_ms,
        "decode_ratio_vs_mlx_lm_single": ratio(shoal["decode_tps"], single["decode_tps"]),
        "all_local_decode_ratio_vs_mlx_lm_single": ratio(
            results["shoal_one_mac_all_local"]["decode_tps"], single["decode_tps"]),
        "local_and_remote_decode_ratio_vs_two_remote": ratio(
            results["shoal_one_local_one_remote"]["decode_tps"], shoal["decode_tps"]),
        f"prefill{longest}_ratio_vs_mlx_lm_single": ratio(shoal["prefill_tps"][longest],
                                                          single["prefill_tps"][longest]),
        "decode_ratio_vs_mlx_lm_tensor_parallel": ratio(shoal["decode_tps"],
                                                        tp.get("decode_tps")),
        "layer_overhead_ratio_vs_grpc_echo": ratio(overhead_ms,
                                                   shoal["echo"]["round_trip_ms"]),
        "layer_overhead_ratio_vs_lane_echo": ratio(overhead_ms,
                                                   shoal["echo"]["lane_round_trip_ms"]),
    }
    if "prefill512_ratio_vs_mlx_lm_single" not in report:
        report["prefill512_ratio_vs_mlx_lm_single"] = None  # --quick does not reach 512
    if plot is not None:
        draw(report, plot)
    return report


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version()}


def draw(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ShoalError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in ("shoal", "mlx_lm_single", "mlx_lm_tensor_parallel", "mlx_lm_pipeline_parallel"):
        by_prompt = report[name].get("decode_tps_by_prompt")
        if by_prompt:
            lengths = sorted(by_prompt, key=int)
            ax.plot([int(n) for n in lengths], [by_prompt[n] for n in lengths], marker="o",
                    label=name.replace("_", " "))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"decode speed, {report['checkpoint']['size']} checkpoint, "
                 f"{report['checkpoint']['workers']} local workers")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(report: dict) -> str:
    rows = [("system", "decode tok/s") + tuple(f"prefill {n}" for n in
                                              report["settings"]["lengths"])]
    for name in ("shoal", "shoal_one_mac_all_local", "shoal_one_local_one_remote",
                 "mlx_lm_single", "mlx_lm_tensor_parallel", "mlx_lm_pipeline_parallel"):
        r = report[name]
        if "error" in r:
            rows.append((name, r["error"][:60]))
            continue
        rows.append((name, f"{r['decode_tps']:.1f}")
                    + tuple(f"{r['prefill_tps'][str(n)]:.1f}" for n in
                            report["settings"]["lengths"]))
    d, e = report["shoal"]["dispatch"], report["shoal"]["echo"]
    lines = ["  ".join(f"{c:>24}" if i == 0 else f"{c:>12}" for i, c in enumerate(row))
             for row in rows]
    lines += [
        "",
        f"per-layer round trip {d['layer_ms']:.2f} ms (slowest worker's compute "
        f"{d['slowest_worker_compute_ms']:.2f} ms, overhead {report['layer_overhead_ms']:.2f}"
        f" ms) over the {report['settings']['transport']} transport; bare echoes over "
        f"{e['streams']} connections: expert lane {e['lane_round_trip_ms']:.2f} ms, gRPC "
        f"over TLS {e['round_trip_ms']:.2f} ms ({e['plaintext_ms']:.2f} ms in plaintext)",
        f"RPCs per token per layer {d['rpcs_per_token_per_layer']:.2f}; bytes per token sent "
        f"{d['bytes_sent_per_token']:.0f}, received {d['bytes_received_per_token']:.0f}",
    ]
    lines += ["", "per-layer decode breakdown (us per MoE layer call):",
              breakdown_table(d["breakdown"]),
              f"per-layer prefill breakdown, {d['prefill_length']}-token prompt (us per call, "
              f"{d['prefill_requests_per_call']:.1f} requests a call):",
              breakdown_table(d["prefill_breakdown"])]
    for shape, us in report["shoal"]["serialization_us"].items():
        lines.append(f"serialization, {shape}: request {us['request']:.0f} us, reply "
                     f"{us['reply']:.0f} us (build, serialize, parse, view; both ends)")
    if "without_relay_ms" in e:
        lines.append(f"network thunderbolt: echo {e['without_relay_ms']:.2f} ms without the "
                     f"relay, {e['relay_without_delay_ms']:.2f} ms through it with no delay")
    for key in ("decode_ratio_vs_mlx_lm_single", "prefill512_ratio_vs_mlx_lm_single",
                "decode_ratio_vs_mlx_lm_tensor_parallel", "layer_overhead_ratio_vs_grpc_echo",
                "layer_overhead_ratio_vs_lane_echo",
                "all_local_decode_ratio_vs_mlx_lm_single",
                "local_and_remote_decode_ratio_vs_two_remote"):
        value = report.get(key)
        lines.append(f"{key}: {'n/a' if value is None else f'{value:.2f}'}")
    return "\n".join(lines)


def main() -> None:
    """`python -m benchmarks.bench --single SOURCE | --all-local SHARDED [--settings JSON]
    [--out FILE]`: mlx-lm's one-process figures, or Shoal's with every store local, each as
    `shoal bench` runs it in a process of its own."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench",
        description="mlx-lm's, or one-machine Shoal's, decode and prefill figures in this "
                    "process (shoal bench runs the whole comparison)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--single", type=Path, metavar="SOURCE",
                       help="the checkpoint, as mlx-lm loads it")
    which.add_argument("--all-local", type=Path, metavar="SHARDED",
                       help="Shoal instead, every store of this split served in process")
    parser.add_argument("--settings", type=json.loads, default=FULL, metavar="JSON",
                        help="lengths, decode_tokens, runs and long_runs (default: the full "
                             "bench's)")
    parser.add_argument("--out", type=Path, help="write the figures here (default: print)")
    args = parser.parse_args()
    if args.single is not None:
        figures = json.dumps(measure_single_here(args.single, args.settings))
    else:
        figures = json.dumps(measure_shoal_local(args.all_local, args.settings, None, None,
                                                 remote_stores=0))
    if args.out is None:
        print(figures)
    else:
        args.out.write_text(figures)


if __name__ == "__main__":
    main()
