"""`python -m benchmarks.streaming --scale 1,2,4`: one model split over 1, 2 and 4 members (the
coordinator's own store plus `shoal-worker`s), each one Mac: its memory budget, read rate and
CPU share, the page cache dropped; beside mlx-lm, the ideal and the forecast."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from benchmarks.checkpoints import bench_checkpoint, bench_root
from benchmarks.mlx_lm_process import run_mlx_lm
from benchmarks.scale_figures import points_of
from benchmarks.scale_members import holders_of, placed_stores, run_point
from benchmarks.stream_limits import MemberLimits, block_device, drop_page_cache
from builders.demo_models import build_once, cache_root, moe_folder, prepare
from coordinator.decoding.generate import encode_prompt
from engine.auth import ensure_secret
from engine.cache_policy import format_bytes
from engine.manifest import read_manifest
from engine.sharding import shard
from engine.stream_placement import plan_streaming
from engine.stream_speed import StreamingMember, predict_streaming, skewed_heat

PROMPT = "Explain how rainbows form."
# what `--admission-ab` keeps of the run with every read expert kept
AB_KEYS = ("tok_s", "hit_rate", "read_bytes_per_token", "demand_bytes_per_token", "drive_busy")


def model_stores(model: str, counts: list[int],
                 checkpoint: Path | None = None) -> tuple[Path, dict[int, Path]]:
    """The checkpoint and its stores split over each member count (and over one, which the
    placed layouts link to), built once in the cache: "demo" (SmolLM2-135M as 16 experts,
    top-4: a trained model's routing and varied text) or "bench" (the DeepSeek-V3-shaped random
    checkpoint; its greedy text repeats, so its routing does too and caches hit far more), or
    the mlx-lm checkpoint folder `checkpoint`."""
    counts = sorted({1, *counts})
    if checkpoint is not None:
        where = hashlib.sha256(str(checkpoint.resolve()).encode()).hexdigest()[:12]
        root = cache_root() / "scale" / f"{checkpoint.name}-{where}"
        return checkpoint, {n: build_once(root / f"sharded-w{n}",
                                          lambda out, n=n: shard(checkpoint, out, workers=n,
                                                                 progress=False),
                                          f"{n} member stores") for n in counts}
    if model == "demo":
        return moe_folder(16, 4), {n: prepare(16, 4, n, progress=False) for n in counts}
    if model != "bench":
        raise SystemExit(f"--model takes demo or bench, not {model!r}")
    source, _ = bench_checkpoint(False)
    return source, {n: build_once(cache_root() / "scale" / f"sharded-w{n}",
                                  lambda out, n=n: shard(source, out, workers=n, progress=False),
                                  f"{n} member stores") for n in counts}


def run_scale(counts: list[int], *, model: str, tokens: int, drive_mbps: float,
              budget_share: float, cpu_share: float | None, skew: float,
              json_path: Path | None, lookahead: bool = True, checkpoint: Path | None = None,
              mixed_drives: list[float] | None = None, placement: str = "stream",
              admission_ab: bool = False, drive_copies: list[int] | None = None) -> dict:
    """Every member count at `drive_mbps` each (0: no read limit), each first with every
    expert in memory and no read limit (a token's compute, for the forecast, and the routing
    heat); with `mixed_drives`, two members at those rates. Experts are placed by
    engine/stream_placement.py from the first point's heat (`placement` "stream"), or as
    `shoal shard --workers N` splits them ("shard"; the mixed run is always placed).
    `admission_ab`: each point also with every read expert kept (no heat-weighted admission),
    the two runs in alternating order, so that both see the same load. `drive_copies` (e.g.
    [1, 2]): each point of two or more members placed with each cold expert on that many
    members' drives, one run each in alternating order after one all-in-memory run."""
    copies_tried = drive_copies or [1]
    if placement == "shard" and copies_tried != [1]:
        raise SystemExit("--drive-copies places for streaming: not with --placement shard")
    source, sharded = model_stores(model, counts, checkpoint)
    manifest = read_manifest(sharded[1])
    sizes = {(e.layer, e.expert): e.bytes for e in manifest.experts}
    expert_total = sum(sizes.values())
    experts = manifest.layers[0].num_experts
    top_k = json.loads((source / "config.json").read_text())["num_experts_per_tok"]
    budget = int(expert_total * budget_share)
    read_bps = int(drive_mbps * 1e6) if drive_mbps > 0 else None
    device = block_device(sharded[1])
    secret_file = bench_root(False) / "secret"
    ensure_secret(secret_file)
    ids = encode_prompt(load_tokenizer(sharded[1] / "dense"), PROMPT, chat=True)
    cpu_text = "no CPU limit" if cpu_share is None else f"{cpu_share:g} of a core"
    print(f"model: {model if checkpoint is None else checkpoint} ({source.name}), "
          f"{len({k[0] for k in sizes})} MoE layers x {experts} experts (top-{top_k}), experts "
          f"{format_bytes(expert_total)}; each member: memory budget {format_bytes(budget)} "
          f"({100 * budget_share:.0f}% of the experts), drive {drive_mbps:g} MB/s, {cpu_text}; "
          f"decode {tokens} tokens; load {os.getloadavg()[0]:.1f}", flush=True)
    drop_page_cache(sorted(source.glob("*.safetensors")))
    reference = run_mlx_lm(source, ids, tokens, None)
    rows, calibration, heats, floors = [], None, [], {}

    def point(store: Path, n: int, rates: list[int | None], tmp: Path, copies: int = 1) -> dict:
        nonlocal calibration
        if (n, tuple(rates)) not in floors:  # one all-in-memory run for every layout of n
            floors[n, tuple(rates)] = run_point(store, n, expert_total, [None] * n, ids, tokens,
                                                secret_file, tmp, device, cpu_share)
        floor = floors[n, tuple(rates)]
        # The decode's own routing, counted with every expert in memory (the ids are the
        # same at every point, so is the routing): the heat record.
        heat = floor["heat"] or skewed_heat({k[0]: experts for k in sizes}, skew)
        heats.append(heat)
        runs = [True, False] if admission_ab else [True]
        if len(rows) % 2:  # alternate which goes first
            runs.reverse()
        measured = {admission: run_point(store, n, budget, rates, ids, tokens, secret_file, tmp,
                                         device, cpu_share, lookahead, admission)
                    for admission in runs}
        row = measured[True]
        if False in measured:
            every = measured[False]
            row["every_read_kept"] = {key: every[key] for key in AB_KEYS}
            row["every_read_kept"]["exact"] = every["tokens"] == reference.get("tokens")
            row["every_read_kept"]["ran_first"] = runs[0] is False
        row.pop("heat")
        row["exact"] = row["tokens"] == reference.get("tokens")
        row["drive_copies"] = copies
        row["stored_bytes"] = sum(sizes[key] * len(names)
                                  for key, names in holders_of(store, n).items())
        row["all_in_memory_tok_s"] = floor["tok_s"]
        members = [StreamingMember(f"member-{i}", budget, rate or 1e15)
                   for i, rate in enumerate(rates)]
        forecast = dict(holders=holders_of(store, n), members=members, sizes=sizes, heat=heat,
                        top_k=top_k, compute_seconds=1.0 / floor["tok_s"])
        row["predicted"] = predict_streaming(**forecast)
        if calibration is None:  # the first point measures what a drive reads per miss
            predicted = row["predicted"]["read_bytes_per_token"]
            calibration = row["read_bytes_per_token"] / predicted if predicted >= 1 else 1.0
        row["read_factor"] = calibration
        row["forecast"] = predict_streaming(**forecast, read_factor=max(calibration, 1e-6))
        row["forecast_tok_s"] = row["forecast"]["tokens_per_second"]
        # Ideal: the members' drive rates summed, against one member at the base rate.
        row["ideal_x"] = sum(rates) / read_bps if read_bps else float(n)
        row["drive_mbps"] = [None if rate is None else rate / 1e6 for rate in rates]
        every = row.get("every_read_kept")
        ab = "" if every is None else (f"; every read kept: {every['tok_s']:.3f} tok/s, exact "
                                       f"{every['exact']}")
        print(f"  {n} member(s) at {'/'.join(str(r and r / 1e6) for r in rates)} MB/s, "
              f"{copies} drive cop{'y' if copies == 1 else 'ies'}: "
              f"{row['tok_s']:.3f} tok/s (forecast {row['forecast_tok_s']:.3f}), exact "
              f"{row['exact']}{ab}, load {os.getloadavg()[0]:.1f}", flush=True)
        return row

    def layout(n: int, rates: list[int], tmp: Path, copies: int = 1) -> Path:
        if n == 1 or (placement == "shard" and len(set(rates)) == 1):
            return sharded[n]
        if not heats:  # the routing heat first, from one member with every expert in memory
            heats.append(run_point(sharded[1], 1, expert_total, [None], ids, tokens,
                                   secret_file, tmp, device, cpu_share)["heat"])
        names = [f"member-{i}" for i in range(n)]
        holders = plan_streaming(dict.fromkeys(names, budget), dict.fromkeys(names, expert_total),
                                 {name: float(r) for name, r in zip(names, rates, strict=True)},
                                 sizes, heats[0], top_k=top_k, drive_copies=copies)
        return placed_stores(sharded[1], holders,
                             tmp / ("placed-" + "-".join(map(str, rates)) + f"-c{copies}"))

    def points(rates: list[int], run_rates: list[int | None], tmp: Path) -> list[dict]:
        """The point of members at `rates` (run at `run_rates`, None: no limit), once per
        drive-copies count, which runs first alternating from point to point (one member has
        one copy)."""
        n = len(rates)
        tried = [1] if n == 1 else copies_tried[::-1] if len(turns) % 2 else copies_tried
        turns.append(n)
        measured = {c: point(layout(n, rates, tmp, c), n, run_rates, tmp, c) for c in tried}
        return [measured[c] for c in sorted(measured)]

    turns: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            rows.extend(points([read_bps or int(1e12)] * n, [read_bps] * n, Path(tmp)))
        mixed_rows = []
        if mixed_drives:
            rates = [int(r * 1e6) for r in mixed_drives]
            mixed_rows = points(rates, list(rates), Path(tmp))
    mixed = mixed_rows[0] if mixed_rows else None
    limited = mlx_lm_limited(source, ids, tokens, reference, expert_total, budget, read_bps,
                             device)
    for row in [*rows, *mixed_rows]:
        row["x_one"] = row["tok_s"] / rows[0]["tok_s"]
        row["of_ideal"] = row["x_one"] / row["ideal_x"]
    report = {"model": model if checkpoint is None else str(checkpoint),
              "lookahead": lookahead, "placement": placement, "drive_mbps": drive_mbps,
              "admission_ab": admission_ab, "drive_copies": copies_tried,
              "memory_budget": budget,
              "cpu_share": cpu_share, "expert_bytes": expert_total, "decode_tokens": tokens,
              "skew_assumed": skew, "rows": rows, "mixed_drives": mixed,
              "mixed_drives_copies": mixed_rows,
              "mlx_lm": {k: v for k, v in reference.items() if k != "tokens"},
              "mlx_lm_limited": limited, "load_after": os.getloadavg()}
    print_scale(report)
    if json_path:
        json_path.write_text(json.dumps(report, indent=1, default=str))
    return report


def mlx_lm_limited(source: Path, ids: list[int], tokens: int, reference: dict, expert_total: int,
                   budget: int, read_bps: int | None, device: str | None) -> dict:
    """mlx-lm under one member's limits: its unlimited peak less the experts beyond the
    budget (plus 32 MiB), and the same read limit."""
    if "peak_rss" not in reference:
        return {"error": reference.get("error", "no reference run")}
    memory = reference["peak_rss"] - expert_total + budget + (32 << 20)
    limit = MemberLimits(f"shoal-scale-mlx-lm-{os.getpid()}", memory, read_bps, device)
    try:
        drop_page_cache(sorted(source.glob("*.safetensors")))
        row = run_mlx_lm(source, ids, tokens, limit)
        row.update(memory_limit=memory, limits=limit.kinds, not_set=limit.missing)
        if "tokens" in row:
            row["exact"] = row.pop("tokens") == reference["tokens"]
        return row
    finally:
        limit.close()


def _percents(values: list) -> str:
    return ",".join("-" if v is None else f"{100 * v:.0f}%" for v in values)


def print_admission(report: dict) -> None:
    """With --admission-ab: each point with heat-weighted admission against every read kept."""
    rows = [r for r in points_of(report) if "every_read_kept" in r]
    if not rows:
        return
    print(f"\nadmission A/B (the two runs of a point back to back, alternating which first):\n"
          f"{'members':>7} {'tok/s heat':>10} {'every':>7} {'hit heat':>8} {'every':>6} "
          f"{'read/tok heat':>13} {'every':>10} {'exact':>6}")
    for row in rows:
        every = row["every_read_kept"]
        print(f"{row['members']:>7} {row['tok_s']:>10.3f} {every['tok_s']:>7.3f} "
              f"{100 * (row['hit_rate'] or 0):>7.1f}% {100 * (every['hit_rate'] or 0):>5.1f}% "
              f"{format_bytes(row['read_bytes_per_token']):>13} "
              f"{format_bytes(every['read_bytes_per_token']):>10} "
              f"{str(row['exact'] and every['exact']):>6}")


def print_scale(report: dict) -> None:
    cpu = report["cpu_share"]
    print(f"\neach member: drive {report['drive_mbps']:g} MB/s, memory budget "
          f"{format_bytes(report['memory_budget'])}, CPU "
          f"{'unlimited' if cpu is None else f'{cpu:g} of a core'}; ideal: the members' summed "
          "drive rates against one; forecast: engine/stream_speed.py with the all-in-memory "
          "run's compute, the decode's heat and the first point's bytes read per miss"
          + ("; xC: each cold expert on C members' drives" if len(report["drive_copies"]) > 1
             else ""))
    print(f"{'members':>7} {'tok/s':>7} {'x one':>6} {'ideal':>6} {'forecast':>8} {'hit':>6} "
          f"{'read/tok':>10} {'demand/tok':>10} {'drive busy':>16} {'cpu busy':>16} "
          f"{'exact':>6} {'in memory':>9}")
    for row in points_of(report):
        name = str(row["members"]) + ("" if len(set(row["drive_mbps"])) == 1 else
                                      " (" + "/".join(f"{r:g}" for r in row["drive_mbps"]) + ")")
        name += f" x{row.get('drive_copies', 1)}" if len(report["drive_copies"]) > 1 else ""
        print(f"{name:>7} {row['tok_s']:>7.3f} {row['x_one']:>6.2f} {row['ideal_x']:>6.2f} "
              f"{row['forecast_tok_s']:>8.3f} {100 * (row['hit_rate'] or 0):>5.1f}% "
              f"{format_bytes(row['read_bytes_per_token']):>10} "
              f"{format_bytes(row['demand_bytes_per_token']):>10} "
              f"{_percents(row['drive_busy']):>16} {_percents(row['cpu_busy']):>16} "
              f"{str(row['exact']):>6} {row['all_in_memory_tok_s']:>9.3f}")
    print_admission(report)
    ref, lim = report["mlx_lm"], report["mlx_lm_limited"]
    print(f"mlx-lm, no limits: {ref.get('decode_tps', 0):.3f} tok/s; under one member's limits "
          f"({format_bytes(lim.get('memory_limit', 0))} memory, same read limit): "
          + (f"{lim['decode_tps']:.3f} tok/s" if "decode_tps" in lim else lim.get("error", "-")))
    not_set = sorted({m for row in report["rows"] for m in row["not_set"]})
    print("limits set: " + ", ".join(report["rows"][0]["limits"] or ["none"])
          + ("; could not set: " + "; ".join(not_set) if not_set else "")
          + f"; load average after: {', '.join(f'{x:.1f}' for x in report['load_after'])}")
