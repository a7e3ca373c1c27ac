"""Reproduce docs/demo.md's figures: convert the SmolLM2 GGUF, split it into experts for several
top-k, and print how closely each MoE follows the dense model."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from builders.gguf_llama import find_smollm2_gguf, gguf_to_llama
from builders.moefy import MoefyReport, moefy


def folder_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) / 2**20


def row(report: MoefyReport, size_mib: float) -> str:
    agreement = "exact" if report.agreement is None else f"{report.agreement:.3f}"
    demo = "-" if report.demo_matches is None else ("yes" if report.demo_matches else "no")
    return (
        f"| {report.top_k:>5} | {agreement:>9} | {report.held_out_positions:>9} | {demo:>10} "
        f"| {report.calibration_tokens:>11} | {report.build_seconds:>7.1f} "
        f"| {report.measure_seconds:>9.1f} | {size_mib:>8.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, nargs="+", default=[16, 8, 4])
    parser.add_argument("--calibration-tokens", type=int, default=256)
    parser.add_argument("--held-out-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, help="keep the checkpoints here (default: temp)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as temp:
        work = args.work_dir or Path(temp)
        gguf = find_smollm2_gguf()
        start = time.perf_counter()
        dense = gguf_to_llama(gguf, work / "dense", progress=False)
        print(f"GGUF {gguf.name}: {gguf.stat().st_size / 2**20:.0f} MiB")
        print(
            f"dense float32 checkpoint: {folder_mib(dense):.0f} MiB, "
            f"converted in {time.perf_counter() - start:.1f} s\n"
        )
        print(
            "| top-k | agreement | positions | demo match | calibration | build s | measure s "
            "|  size MiB |"
        )
        print(
            "|------:|----------:|----------:|-----------:|------------:|--------:|----------:"
            "|----------:|"
        )
        answers = []
        for top_k in args.top_k:
            out = work / f"moe{args.experts}-top{top_k}"
            report = moefy(
                dense,
                out,
                num_experts=args.experts,
                top_k=top_k,
                seed=args.seed,
                progress=False,
                calibration_tokens=args.calibration_tokens,
                held_out_tokens=args.held_out_tokens,
            )
            print(row(report, folder_mib(out)), flush=True)
            if report.moe_answer is not None:
                answers.append((top_k, report.dense_answer, report.moe_answer))
        for top_k, dense_answer, moe_answer in answers:
            print(f"\ntop-{top_k} demo answer: {moe_answer!r}\n  dense answer: {dense_answer!r}")


if __name__ == "__main__":
    main()
