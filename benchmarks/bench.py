"""`shoal bench`: Shoal (two workers; one machine all local; one local store + one worker)
against mlx-lm (one process; its own two-process distributed generation) and bare echoes, on
one checkpoint in one run; the result is one record (benchmarks/records.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.baselines import measure_mlx_distributed, measure_single
from benchmarks.checkpoints import FULL, QUICK, WORKERS, bench_files, log
from benchmarks.records import BENCH_BASELINES, BENCH_FIGURES, command_line, make_record
from benchmarks.shoal_runs import measure_all_local, measure_shoal_local, measure_shoal_on
from coordinator.dataplane.link import LANE, Transport
from coordinator.decoding.report import breakdown_table
from engine.errors import ShoalError
from engine.manifest import read_manifest

NETWORKS = ("loopback", "thunderbolt")


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b

def run(*, quick: bool = False, plot: Path | None = None, network: str = "loopback",
        transport: Transport = LANE, **overrides: int | list[int] | None) -> dict:
    """The whole comparison; `overrides` (runs, long_runs, decode_tokens, lengths) replace the
    preset's values. `network` "thunderbolt" puts Shoal's workers (and the echo servers)
    behind a Thunderbolt-like link (benchmarks/network.py); mlx-lm's baselines stay on
    loopback."""
    if network not in NETWORKS:
        raise ShoalError(f"unknown network {network!r}; choose {' or '.join(NETWORKS)}")
    preset = QUICK if quick else FULL
    settings = {**preset,
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
    ratios = {
        "decode_ratio_vs_mlx_lm_single": ratio(shoal["decode_tps"], single["decode_tps"]),
        "all_local_decode_ratio_vs_mlx_lm_single": ratio(
            results["shoal_one_mac_all_local"]["decode_tps"], single["decode_tps"]),
        "local_and_remote_decode_ratio_vs_two_remote": ratio(
            results["shoal_one_local_one_remote"]["decode_tps"], shoal["decode_tps"]),
        "prefill512_ratio_vs_mlx_lm_single": None,  # --quick does not reach 512
        **{f"prefill{n}_ratio_vs_mlx_lm_single": ratio(shoal["prefill_tps"][str(n)],
                                                       single["prefill_tps"][str(n)])
           for n in settings["lengths"] if n >= 512 or str(n) == longest},
        "decode_ratio_vs_mlx_lm_tensor_parallel": ratio(shoal["decode_tps"],
                                                        tp.get("decode_tps")),
        "layer_overhead_ratio_vs_grpc_echo": ratio(overhead_ms,
                                                   shoal["echo"]["round_trip_ms"]),
        "layer_overhead_ratio_vs_lane_echo": ratio(overhead_ms,
                                                   shoal["echo"]["lane_round_trip_ms"]),
    }
    record = make_record(
        what=record_name(quick, network, transport,
                         lengths=settings["lengths"] != preset["lengths"]),
        command=command_line(),
        figures={k: results[k] for k in BENCH_FIGURES},
        baselines={k: results[k] for k in BENCH_BASELINES}, ratios=ratios,
        checkpoint={"family": "deepseek_v3", "size": settings["size"], "bits": settings["bits"],
                    "group_size": settings["group_size"],
                    "experts": len(read_manifest(sharded).experts), "workers": WORKERS},
        settings=settings, layer_overhead_ms=overhead_ms)
    if plot is not None:
        draw(record, plot)
    return record


def record_name(quick: bool, network: str, transport: Transport, *,
                lengths: bool = False) -> str:
    """What a record of this run is called: the default run is "bench"; `lengths`: prompt
    lengths other than the preset's (`--lengths`), a record of prefill ("-prefill")."""
    return "-".join(["bench", *(["quick"] if quick else []),
                     *([network] if network != "loopback" else []),
                     *([transport.kind] if transport.kind != LANE.kind else []),
                     *(["prefill"] if lengths else [])])


def draw(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ShoalError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in ("shoal", "mlx_lm_single", "mlx_lm_tensor_parallel", "mlx_lm_pipeline_parallel"):
        by_prompt = section(report, name).get("decode_tps_by_prompt")
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
        r = section(report, name)
        if "error" in r:
            rows.append((name, r["error"][:60]))
            continue
        rows.append((name, f"{r['decode_tps']:.1f}")
                    + tuple(f"{r['prefill_tps'][str(n)]:.1f}" for n in
                            report["settings"]["lengths"]))
    d, e = report["figures"]["shoal"]["dispatch"], report["figures"]["shoal"]["echo"]
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
    for shape, us in report["figures"]["shoal"]["serialization_us"].items():
        lines.append(f"serialization, {shape}: request {us['request']:.0f} us, reply "
                     f"{us['reply']:.0f} us (build, serialize, parse, view; both ends)")
    if "without_relay_ms" in e:
        lines.append(f"network thunderbolt: echo {e['without_relay_ms']:.2f} ms without the "
                     f"relay, {e['relay_without_delay_ms']:.2f} ms through it with no delay")
    prefill = sorted(k for k in report["ratios"] if k.startswith("prefill"))
    for key in ("decode_ratio_vs_mlx_lm_single", *prefill,
                "decode_ratio_vs_mlx_lm_tensor_parallel", "layer_overhead_ratio_vs_grpc_echo",
                "layer_overhead_ratio_vs_lane_echo",
                "all_local_decode_ratio_vs_mlx_lm_single",
                "local_and_remote_decode_ratio_vs_two_remote"):
        value = report["ratios"].get(key)
        lines.append(f"{key}: {'n/a' if value is None else f'{value:.2f}'}")
    return "\n".join(lines)


def section(record: dict, name: str) -> dict:
    """One system's figures: Shoal's configurations, or a baseline's."""
    return record["figures"].get(name) or record["baselines"][name]
