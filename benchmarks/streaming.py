"""Expert streaming benchmark: one worker at budgets of 100/50/25% of its expert bytes against the
drive and mlx-lm (default), `--local` the coordinator's own store alternated with mlx-lm,
`--scale 1,2,4` one model over 1, 2 and 4 members (benchmarks/streaming_scale.py)."""
# python -m benchmarks.streaming [--tokens 48] [--budgets 100,50,25] | --local [--rounds 4]
#     | --scale 1,2,4 [--quick] [--json FILE]
# The model is `shoal demo`'s (real weights, so routing is as skewed as a trained router makes
# it). Linux, as root, for dropping the page cache and the cgroup limits; elsewhere those steps
# are skipped and said so.

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.measure import greedy_generation  # noqa: E402
from benchmarks.mlx_lm_process import run_mlx_lm  # noqa: E402
from benchmarks.records import write_record  # noqa: E402
from benchmarks.stream_limits import (  # noqa: E402
    MemberLimits,
    drop_page_cache,
    peak_rss,
    sequential_bandwidth,
)
from benchmarks.streaming_scale import run_scale  # noqa: E402
from builders.demo_models import moe_folder, prepare  # noqa: E402
from coordinator.dataplane.lookahead import Lookahead  # noqa: E402
from coordinator.decoding.generate import encode_prompt, open_remote_model  # noqa: E402
from coordinator.decoding.report import streaming_report  # noqa: E402
from coordinator.ops.local_processes import start_worker  # noqa: E402
from coordinator.ops.worker_stats import read_stats  # noqa: E402
from engine.auth import create_secret, load_secret  # noqa: E402
from engine.cache_policy import format_bytes  # noqa: E402
from engine.manifest import read_manifest  # noqa: E402
from engine.moe_layers import get_module  # noqa: E402

PROMPT = "Explain how rainbows form."


def compare_predictors(source: Path, sharded: Path, ids: list[int], tokens: int) -> dict:
    """Recall and precision of the lookahead's guesses in one process, decode steps only:
    layer L+1's router on layer L's MoE input, as is and rescaled between the two norms."""
    model, tokenizer = load(str(source))
    manifest = read_manifest(sharded)
    records: list[tuple[int, mx.array, mx.array]] = []

    class Recorder(nn.Module):
        def __init__(self, layer: int, inner: nn.Module) -> None:
            super().__init__()
            self.layer, self.inner = layer, inner

        def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
            records.append((self.layer, x, inds))
            return self.inner(x, inds)

    for layer in manifest.layers:
        parent, name = layer.path.rsplit(".", 1)
        block = get_module(model, parent)
        setattr(block, name, Recorder(layer.layer, getattr(block, name)))
    for _ in stream_generate(model, tokenizer, mx.array(ids), max_tokens=tokens,
                             sampler=make_sampler(temp=0.0)):
        pass
    out = {}
    for rescale in (False, True):
        lookahead = Lookahead(model, manifest, rescale=rescale)
        for layer, x, inds in records:
            if x.reshape(-1, x.shape[-1]).shape[0] != 1:
                continue  # the prompt's pass: decode is what streaming serves
            lookahead.score(layer, np.array(inds).reshape(-1))
            lookahead.predict(layer, x, inds.shape[-1])
        s = lookahead.stats
        out["rescaled" if rescale else "as is"] = {"recall": s.recall, "precision": s.precision}
    return out


def dense_bytes(sharded: Path) -> int:
    return sum(p.stat().st_size for p in (sharded / "dense").glob("*.safetensors"))


def run_budget(
    sharded: Path, store: Path, share: int, tokens: int, secret_file: Path, log_dir: Path,
    prompt_ids: list[int] | None, *, lookahead: bool = True,
) -> dict:
    """One worker at `share`% of its expert bytes; stats cover the decode steps only (read
    after the first token, so the prompt's pass, which reads nearly everything, is left out)."""
    files = sorted(store.glob("L*/E*.safetensors"))
    how = drop_page_cache(files)
    worker = start_worker([store], secret_file, log_dir / f"worker-{share}.log",
                          ["--memory-budget", f"{share}%"])
    try:
        remote = open_remote_model(sharded, [worker.address], load_secret(secret_file))
        if not lookahead:
            remote.dispatcher.lookahead = None
        try:
            ids = prompt_ids or encode_prompt(remote.tokenizer, PROMPT, chat=True)
            connected = read_stats(remote.cluster.links)
            taken: list = []
            run = greedy_generation(remote.model, remote.tokenizer, ids, tokens,
                                    lambda: taken.append(read_stats(remote.cluster.links)))
            out, decode_seconds, (before,) = run.tokens, run.decode_seconds, taken
            after = read_stats(remote.cluster.links)
        finally:
            remote.close()
        rss = peak_rss(worker.proc.pid)
    finally:
        worker.stop()
    hints = remote.dispatcher.lookahead.stats if lookahead else None
    (prefill,) = streaming_report(connected, before, 0, None)["workers"].values()
    report = streaming_report(before, after, 0, hints)  # 0: per forward pass, one per decode token
    (summary,) = report["workers"].values()
    drive = summary["drives"][0]
    return {
        "share": share,
        "lookahead": lookahead,
        "page_cache": how,
        "prompt_ids": ids,
        "tokens": out,
        "decode_tps": (len(out) - 1) / decode_seconds,
        "hit_rate_without_prefetch": summary["hit_rate_without_prefetch"],
        "hit_rate": summary["hit_rate"],
        "prefetch_recall": summary["prefetch_recall"],
        "prefetch_precision": summary["prefetch_precision"],
        "hint_recall": report["hints"]["recall"] if hints else None,
        "hint_precision": report["hints"]["precision"] if hints else None,
        "bytes_read_per_token": summary["bytes_read_per_token"],
        "read_bandwidth": drive["bandwidth"],
        "prefill_read_bandwidth": prefill["drives"][0]["bandwidth"],
        "prefill_bytes_read": prefill["bytes_read"],
        "drive_busy_share": drive["active_seconds"] / decode_seconds if decode_seconds else 0,
        "budget": summary["memory_budget"],
        "worker_peak_rss": rss,
    }


def local_once(sharded: str, store: str, share: int, ids: list[int], tokens: int) -> None:
    """Run in a process of its own: the coordinator alone with every expert local at `share`%
    of their bytes; prints one JSON line. Decode speed as mlx-lm's own loop reports it (the
    same measure as MLX_LM_SCRIPT's); the cache's figures cover the decode steps only."""
    remote = open_remote_model(Path(sharded), [], b"", local_stores=[Path(store)],
                               memory_budget=f"{share}%")
    taken: list = []

    def after_first() -> None:
        taken.append(read_stats(remote.cluster.links))
        remote.dispatcher.stats.reset()

    try:
        run = greedy_generation(remote.model, remote.tokenizer, ids, tokens, after_first)
        (before,) = taken
        after = read_stats(remote.cluster.links)
    finally:
        remote.close()
    (summary,) = streaming_report(before, after, 0, None)["workers"].values()
    breakdown = remote.dispatcher.stats.decode.breakdown()
    print(json.dumps({
        "share": share, "tokens": run.tokens, "decode_tps": run.generation_tps,
        "hit_rate": summary["hit_rate"], "bytes_read_per_token": summary["bytes_read_per_token"],
        "dispatched_layer_calls": remote.dispatcher.stats.decode.calls,
        "bookkeeping_us": breakdown["worker_bookkeeping_us"],
        "reads_us": breakdown["worker_reads_us"],
        "matrix_us": breakdown["worker_matrix_us"],
    }))


def run_local(sharded: Path, store: Path, share: int, ids: list[int], tokens: int) -> dict:
    code = ("from benchmarks.streaming import local_once; "
            f"local_once({str(sharded)!r}, {str(store)!r}, {share}, {ids!r}, {tokens})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=1800, cwd=REPO)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-300:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare_local(sharded: Path, source: Path, shares: list[int], tokens: int,
                  rounds: int) -> None:
    """One Mac alone, every expert local, at each budget, against mlx-lm with every expert in
    memory: alternated round by round (each round starts with another configuration), so a
    busy machine's slow spells fall on all of them alike."""
    ids = encode_prompt(load_tokenizer(sharded / "dense"), PROMPT, chat=True)
    store = sharded / "worker-0"
    configs = ["mlx-lm", *shares]
    runs: dict = {c: [] for c in configs}
    for round_ in range(rounds):
        for config in configs[round_ % len(configs):] + configs[:round_ % len(configs)]:
            drop_page_cache(sorted(store.glob("L*/E*.safetensors"))
                            + sorted(source.glob("*.safetensors")))
            row = (run_mlx_lm(source, ids, tokens, None) if config == "mlx-lm"
                   else run_local(sharded, store, config, ids, tokens))
            if "error" in row:
                raise SystemExit(f"{config}: {row['error']}")
            runs[config].append(row)
            print(f"  round {round_ + 1}: {config}{'' if config == 'mlx-lm' else '%'} "
                  f"{row['decode_tps']:.2f} tok/s", flush=True)
    reference = statistics.median(r["decode_tps"] for r in runs["mlx-lm"])
    expected = runs["mlx-lm"][0]["tokens"]
    print(f"\ndecode {tokens} tokens, prompt {len(ids)} tokens, {rounds} alternated rounds; "
          "median tok/s, and the per-round ratio to that round's mlx-lm run (min-max)")
    print(f"{'configuration':>28} {'tok/s':>6} {'x mlx-lm':>8} {'per round':>11} "
          f"{'same tokens':>11} {'hit':>6} {'read/tok':>10} {'bookkeeping':>11} "
          f"{'matrix':>7}")
    print(f"{'mlx-lm, all in memory':>28} {reference:>6.2f} {1:>8.2f}")
    for share in shares:
        rows = runs[share]
        median = statistics.median(r["decode_tps"] for r in rows)
        ratios = [r["decode_tps"] / m["decode_tps"] for r, m in zip(rows, runs["mlx-lm"],
                                                                     strict=True)]
        same = all(r["tokens"] == expected for r in rows)
        hit = statistics.median(r["hit_rate"] or 0 for r in rows)
        read = statistics.median(r["bytes_read_per_token"] or 0 for r in rows)
        calls = rows[0]["dispatched_layer_calls"]
        keep = ("-" if not calls else
                f"{statistics.median(r['bookkeeping_us'] for r in rows) / 1e3:.2f} ms")
        matrix = ("-" if not calls else
                  f"{statistics.median(r['matrix_us'] for r in rows) / 1e3:.2f} ms")
        print(f"{f'shoal, all local, {share}% budget':>28} {median:>6.2f} "
              f"{median / reference:>8.2f} {min(ratios):>5.2f}-{max(ratios):<5.2f} "
              f"{str(same):>11} {100 * hit:>5.1f}% {format_bytes(read):>10} {keep:>11} "
              f"{matrix:>7}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int,
                        help="tokens to decode (default 48; with --scale 32, --quick 8)")
    parser.add_argument("--budgets", default="100,50,25")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--without-lookahead", default="25", metavar="SHARES",
                        help="budgets to run again with no prefetch hints (default 25)")
    parser.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx-lm side")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--local", action="store_true",
                        help="one Mac alone: the coordinator's own experts at each budget "
                        "against mlx-lm with every expert in memory, alternated")
    parser.add_argument("--rounds", type=int, default=4, help="with --local (default 4)")
    parser.add_argument("--scale", metavar="COUNTS",
                        help="the scaling run: one model over these member counts "
                        "(e.g. 1,2,4), each member one memory budget and one throttled drive")
    parser.add_argument("--quick", action="store_true", help="with --scale: 8 tokens, not 32")
    parser.add_argument("--model", default="demo", choices=("demo", "bench"),
                        help="with --scale: the demo's SmolLM2 MoE (real routing; default) or "
                        "the DeepSeek-V3-shaped bench checkpoint (random weights)")
    parser.add_argument("--checkpoint", type=Path, metavar="DIR",
                        help="with --scale: this mlx-lm checkpoint folder in place of --model")
    parser.add_argument("--drive-mbps", type=float, default=40.0,
                        help="with --scale: each member's read limit, MB/s (0: none; default 40)")
    parser.add_argument("--mixed-drives", metavar="MBPS,MBPS", default="40,80",
                        help="with --scale: then two members with these drive rates, placed in "
                        "proportion by engine/stream_placement.py (default 40,80; '' skips)")
    parser.add_argument("--member-budget", type=float, default=10.0, metavar="PERCENT",
                        help="with --scale: each member's memory budget, %% of all the experts' "
                        "bytes (default 10: four members hold 40%%)")
    parser.add_argument("--cpu-share", type=float, default=0.4, metavar="CORES",
                        help="with --scale: each member's CPU quota in cores (0: none; "
                        "default 0.4)")
    parser.add_argument("--placement", choices=("stream", "shard"), default="stream",
                        help="with --scale: experts placed by engine/stream_placement.py from "
                        "the decode's heat (default), or as `shoal shard --workers N` splits them")
    parser.add_argument("--admission-ab", action="store_true",
                        help="with --scale: run each point again with every read expert kept "
                        "(worker --cache-admission every), alternated, to compare")
    parser.add_argument("--drive-copies", default="1", metavar="COUNTS",
                        help="with --scale: each cold expert on this many members' drives, "
                        "e.g. 1,2: each point of two or more members once per count, "
                        "alternating which runs first (default 1)")
    parser.add_argument("--no-lookahead", action="store_true",
                        help="with --scale: no prefetch hints from the router's lookahead")
    parser.add_argument("--skew", type=float, default=0.0,
                        help="with --scale: the routing skew the prediction assumes where no "
                        "heat was counted (default 0)")
    args = parser.parse_args()
    if args.scale:
        try:
            counts = [int(n) for n in args.scale.split(",")]
            mixed = [float(r) for r in args.mixed_drives.split(",") if r.strip()]
            copies = [int(c) for c in args.drive_copies.split(",")]
        except ValueError:
            parser.error(f"--scale takes counts like 1,2,4, --mixed-drives rates like 40,80 and "
                         f"--drive-copies counts like 1,2, not {args.scale!r} / "
                         f"{args.mixed_drives!r} / {args.drive_copies!r}")
        if not counts or min(counts) < 1 or (mixed and min(mixed) <= 0) or min(copies) < 1:
            parser.error("member counts and drive copies must be 1 or more and drive rates "
                         "above 0")
        if args.checkpoint is not None and not (args.checkpoint / "config.json").is_file():
            parser.error(f"--checkpoint {args.checkpoint}: no config.json there")
        tokens = args.tokens or (8 if args.quick else 32)
        report = run_scale(counts, model=args.model, tokens=tokens, drive_mbps=args.drive_mbps,
                           budget_share=args.member_budget / 100,
                           cpu_share=args.cpu_share or None, skew=args.skew,
                           json_path=args.json, lookahead=not args.no_lookahead,
                           checkpoint=args.checkpoint, mixed_drives=mixed,
                           placement=args.placement, admission_ab=args.admission_ab,
                           drive_copies=copies)
        write_record(what="streaming-scale", figures=report)
        return

    args.tokens = args.tokens or 48
    sharded = prepare(args.experts, args.top_k, 1)
    source = moe_folder(args.experts, args.top_k)
    if args.local:
        compare_local(sharded, source, [int(s) for s in args.budgets.split(",")], args.tokens,
                      args.rounds)
        return
    store = sharded / "worker-0"
    manifest = read_manifest(sharded)
    expert_total = sum(e.bytes for e in manifest.experts)
    print(f"model: {manifest.model_type} {len(manifest.layers)} MoE layers x "
          f"{manifest.layers[0].num_experts} experts (top-{args.top_k}), experts "
          f"{format_bytes(expert_total)}, dense {format_bytes(dense_bytes(sharded))}", flush=True)

    seq = sequential_bandwidth(store)
    print(f"drive sequential read (1 GiB, 8 MiB blocks, around the page cache): "
          f"{format_bytes(seq)}/s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        secret_file = create_secret(Path(tmp) / "secret")
        rows, prompt_ids = [], None
        runs = [(int(s), True) for s in args.budgets.split(",")]
        runs += [(int(s), False) for s in args.without_lookahead.split(",") if s]
        for share, lookahead in runs:
            row = run_budget(sharded, store, share, args.tokens, secret_file, Path(tmp),
                             prompt_ids, lookahead=lookahead)
            prompt_ids = row["prompt_ids"]
            rows.append(row)
            print(f"  {share}% done: {row['decode_tps']:.1f} tok/s", flush=True)

    predictors = compare_predictors(source, sharded, prompt_ids, args.tokens)
    reference = None
    if not args.no_mlx_lm:
        drop_page_cache(sorted(source.glob("*.safetensors")))
        reference = run_mlx_lm(source, prompt_ids, args.tokens, None)
        for row in rows:
            if not row["lookahead"] or "peak_rss" not in reference:
                continue
            # What mlx-lm needed with every weight in memory, less the expert bytes that the
            # worker at this budget leaves on the drive (plus 32 MiB of slack).
            missing = expert_total * (100 - row["share"]) // 100
            limit_bytes = reference["peak_rss"] - missing + (32 << 20)
            limit = None
            try:
                limit = MemberLimits(f"shoal-bench-{row['share']}", limit_bytes, None, None)
                drop_page_cache(sorted(source.glob("*.safetensors")))
                row["mlx_lm"] = run_mlx_lm(source, prompt_ids, args.tokens, limit)
                row["mlx_lm"]["limit"] = limit_bytes
                row["mlx_lm"]["how"] = ", ".join(limit.kinds)
                row["mlx_lm"]["cgroup_peak"] = limit.peak_memory()
            except OSError as e:
                row["mlx_lm"] = {"error": f"no memory limit possible here ({e})"}
            finally:
                if limit is not None:
                    limit.close()

    print()
    print(f"page cache before each run: {rows[0]['page_cache']}; decode {args.tokens} tokens, "
          f"prompt {len(prompt_ids)} tokens; sequential read {format_bytes(seq)}/s")
    print("budget: share of the worker's expert bytes (hints: router lookahead on/off); hit: "
          "expert uses found in memory (cache alone / with prefetch); pf: the worker's "
          "prefetches; hint: the coordinator's guesses; figures over decode steps only")
    head = (f"{'budget':>11} {'tok/s':>6} {'hit':>11} {'pf rec':>6} {'pf prec':>7} "
            f"{'hint rec':>8} {'hint prec':>9} {'read/tok':>10} {'read bw':>12} {'vs seq':>6} "
            f"{'drive busy':>10} {'prefill bw':>12} {'worker RSS':>10} {'same tokens':>11} "
            "| mlx-lm, same limit")
    print(head)
    for row in rows:
        bw, pbw = row["read_bandwidth"], row["prefill_read_bandwidth"]
        same = (reference is None or "tokens" not in reference or
                row["tokens"] == reference["tokens"])
        other = row.get("mlx_lm", {})
        other_text = (f"{other['decode_tps']:.1f} tok/s (limit {format_bytes(other['limit'])})"
                      if "decode_tps" in other else other.get("error", "-")
                      + (f" (limit {format_bytes(other['limit'])})" if "limit" in other else ""))

        def pct(v):
            return "-" if v is None else f"{100 * v:.0f}%"

        hit = f"{pct(row['hit_rate_without_prefetch'])}/{pct(row['hit_rate'])}"
        budget = f"{row['share']}% " + ("hints" if row["lookahead"] else "none")
        print(f"{budget:>11} {row['decode_tps']:>6.1f} {hit:>11} "
              f"{pct(row['prefetch_recall']):>6} {pct(row['prefetch_precision']):>7} "
              f"{pct(row['hint_recall']):>8} {pct(row['hint_precision']):>9} "
              f"{format_bytes(row['bytes_read_per_token'] or 0):>10} "
              f"{('-' if bw is None else format_bytes(bw) + '/s'):>12} "
              f"{('-' if bw is None else pct(bw / seq)):>6} {pct(row['drive_busy_share']):>10} "
              f"{('-' if pbw is None else format_bytes(pbw) + '/s'):>12} "
              f"{format_bytes(row['worker_peak_rss']):>10} {str(same):>11} | {other_text}")
    if reference is not None and "decode_tps" in reference:
        print(f"mlx-lm, no limit: {reference['decode_tps']:.1f} tok/s, peak RSS "
              f"{format_bytes(reference['peak_rss'])}, peak MLX memory "
              f"{format_bytes(reference['peak_memory'])}")
        limited = [r["mlx_lm"] for r in rows if "how" in r.get("mlx_lm", {})]
        if limited:
            print(f"mlx-lm limits: {limited[0]['how']} = its unlimited peak RSS less the expert "
                  "bytes the worker leaves on the drive at that budget, plus 32 MiB")
    for name, figures in predictors.items():
        print(f"lookahead predictor {name}: recall {100 * figures['recall']:.1f}%, precision "
              f"{100 * figures['precision']:.1f}% (decode steps, one process)")
    write_record(what="streaming", figures={"rows": rows}, baselines={"mlx_lm": reference},
                 sequential=seq, predictors=predictors)
    if args.json:
        args.json.write_text(json.dumps({"sequential": seq, "rows": rows, "mlx_lm": reference,
                                         "predictors": predictors}, indent=1))


if __name__ == "__main__":
    main()
