"""One machine, every expert local and resident, against mlx-lm in one process, alternated
round by round, each run a process of its own started as a user would start it:
`python -m benchmarks.one_machine [--quick] [--rounds 3] [--runs 5] [--json FILE]`."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.baselines import measure_single
from benchmarks.checkpoints import FULL, QUICK, bench_checkpoint
from benchmarks.records import write_record
from benchmarks.shoal_runs import measure_all_local


def run(*, quick: bool, rounds: int, runs: int) -> dict:
    """`rounds` of mlx-lm then Shoal (the shoal bench checkpoint, both stores served by the
    coordinator itself), each `runs` timed generations; the medians over rounds, their ratio."""
    settings = {**(QUICK if quick else FULL), "runs": runs, "long_runs": 1}
    source, sharded = bench_checkpoint(quick, settings)
    series: dict[str, list[float]] = {"mlx_lm_single": [], "shoal_one_mac_all_local": []}
    for round_ in range(rounds):
        for name, measure in (("mlx_lm_single", lambda: measure_single(source, settings)),
                              ("shoal_one_mac_all_local",
                               lambda: measure_all_local(sharded, settings))):
            started = time.perf_counter()
            series[name].append(measure()["decode_tps"])
            print(f"one_machine: round {round_ + 1}/{rounds} {name} "
                  f"{series[name][-1]:.1f} tok/s ({time.perf_counter() - started:.0f} s)",
                  file=sys.stderr, flush=True)
    medians = {name: statistics.median(values) for name, values in series.items()}
    return {"settings": settings, "decode_tps": series, "median_decode_tps": medians,
            "ratio": medians["shoal_one_mac_all_local"] / medians["mlx_lm_single"],
            "ratios_by_round": [s / m for m, s in zip(series["mlx_lm_single"],
                                                      series["shoal_one_mac_all_local"],
                                                      strict=True)]}


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.one_machine",
        description="Decode speed of one machine serving every expert itself (shoal generate "
                    "--local-store, all resident) against mlx-lm in one process, alternated.")
    parser.add_argument("--quick", action="store_true", help="the tiny checkpoint: a check")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (default 3)")
    parser.add_argument("--runs", type=int, default=5,
                        help="timed generations per run, their median its figure (default 5)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    report = run(quick=args.quick, rounds=args.rounds, runs=args.runs)
    medians = report["median_decode_tps"]
    write_record(what="one-machine-quick" if args.quick else "one-machine",
                 figures={"shoal_one_mac_all_local": medians["shoal_one_mac_all_local"]},
                 baselines={"mlx_lm_single": medians["mlx_lm_single"]},
                 ratios={"all_local_decode_ratio_vs_mlx_lm_single": report["ratio"]},
                 **report)
    text = json.dumps(report, indent=1)
    if args.json is not None:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
