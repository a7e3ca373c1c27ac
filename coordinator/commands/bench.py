"""`shoal bench`: Shoal against mlx-lm and bare echoes (the harness is benchmarks/bench.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from coordinator.commands.options import AddParser, transport_of, transport_options


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "bench", help="measure Shoal against mlx-lm and a bare gRPC echo on one checkpoint",
        description="Build (once) a DeepSeek-V3-shaped 4-bit benchmark checkpoint, start two "
        "local workers, and measure decode and prefill tokens/s, per-layer round trips and "
        "bytes per token; run mlx-lm in one process, mlx-lm's own two-process tensor- and "
        "pipeline-parallel generation (mlx.launch, ring backend), and a bare gRPC echo with "
        "the same message sizes, and report Shoal's ratios to each.",
    )
    p.add_argument("--quick", action="store_true",
                   help="a tiny checkpoint and few runs: checks the harness, not the speed")
    p.add_argument("--runs", type=int, metavar="N",
                   help="timed generations at the shortest prompt, whose median is the decode "
                   "figure (default 3)")
    p.add_argument("--long-runs", type=int, metavar="N",
                   help="timed generations at each longer prompt (default 1)")
    p.add_argument("--network", choices=["loopback", "thunderbolt"], default="loopback",
                   help="thunderbolt: run the workers in Linux network namespaces behind a "
                   "10 Gbit/s cap and 0.2 ms added each way, like Thunderbolt Bridge between "
                   "Macs (needs root and iproute2); mlx-lm's baselines stay on loopback")
    p.add_argument("--decode-tokens", type=int, metavar="N",
                   help="tokens generated per timed run (default 32)")
    transport_options(p)
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")
    p.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="draw decode speed against prompt length (needs matplotlib)")
    p.set_defaults(main=main)


def main(args: argparse.Namespace) -> None:
    from benchmarks.bench import run, table

    report = run(quick=args.quick, plot=args.plot, network=args.network, runs=args.runs,
                 long_runs=args.long_runs, decode_tokens=args.decode_tokens,
                 transport=transport_of(args))
    print(json.dumps(report, indent=1) if args.json else table(report))
