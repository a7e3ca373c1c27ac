"""mlx-lm's baselines, each in processes of its own: one process, and its own two-process
tensor- and pipeline-parallel generation (mlx.launch, ring backend, loopback)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mlx_lm.utils import load_model, load_tokenizer

from benchmarks.checkpoints import FULL
from benchmarks.measure import decode_and_prefill
from benchmarks.own_process import own_process_figures
from benchmarks.records import REPO
from benchmarks.shoal_runs import measure_shoal_local
from engine.errors import ShoalError


def measure_single(source: Path, settings: dict) -> dict:
    """mlx-lm in one process, a process of its own (MLX reads its CUDA launch setting once per
    process, and this one runs Shoal's coordinator with Shoal's)."""
    figures = own_process_figures("mlx-lm in one process", lambda out: [
        sys.executable, "-m", "benchmarks.baselines", "--single", str(source),
        "--settings", json.dumps(settings), "--out", str(out)])
    if "error" in figures:  # every ratio is taken against it
        raise ShoalError(figures["error"])
    return figures


def measure_single_here(source: Path, settings: dict) -> dict:
    model, config = load_model(source)
    tokenizer = load_tokenizer(source)
    return decode_and_prefill(model, tokenizer, config["vocab_size"],
                              lengths=settings["lengths"],
                              decode_tokens=settings["decode_tokens"], runs=settings["runs"],
                              long_runs=settings["long_runs"])


def measure_mlx_distributed(source: Path, mode: str, settings: dict) -> dict:
    """mlx-lm's own generation over mx.distributed: 2 ranks, ring backend on loopback."""
    launcher = Path(sys.executable).with_name("mlx.launch")
    return own_process_figures(f"mlx.launch ({mode})", lambda out: [
        str(launcher), "-n", "2", "--backend", "ring", "--python", sys.executable,
        str(REPO / "benchmarks" / "mlx_distributed.py"), "--model", str(source),
        "--mode", mode, "--out", str(out),
        "--prompt-lengths", ",".join(map(str, settings["lengths"])),
        "--decode-tokens", str(settings["decode_tokens"]), "--runs", str(settings["runs"]),
        "--long-runs", str(settings["long_runs"])])


def main() -> None:
    """`python -m benchmarks.baselines --single SOURCE | --all-local SHARDED [--settings JSON]
    [--out FILE]`: mlx-lm's one-process figures, or one machine's all-local Shoal figures, as
    `measure_single` and `measure_all_local` run them in a process of their own."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.baselines",
        description="mlx-lm's decode and prefill figures in this process (shoal bench runs "
                    "the whole comparison)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--single", type=Path, metavar="SOURCE",
                       help="the checkpoint, as mlx-lm loads it")
    which.add_argument("--all-local", type=Path, metavar="SHARDED",
                       help="Shoal instead, every store of this split served in process, as "
                            "`shoal generate --local-store` runs (benchmarks/shoal_runs.py)")
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
