"""`shoal bench`: Shoal against mlx-lm and bare echoes, and `--report`, the docs' figures
rendered from the records; the harness (benchmarks/) is loaded from the checkout it runs in."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

from coordinator.cli.options import AddParser, transport_of, transport_options
from engine.errors import NotFound
from engine.process import launch_directly

HARNESS = "benchmarks.bench"


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "bench", help="measure Shoal against mlx-lm and bare transport echoes on one checkpoint",
        description="Build (once) a DeepSeek-V3-shaped 4-bit benchmark checkpoint, start two "
        "local workers, and measure decode and prefill tokens/s, per-layer round trips and "
        "bytes per token; then the same with every expert served by the coordinator itself "
        "(one machine, no worker) and with one store local and one worker; run mlx-lm in one "
        "process, mlx-lm's own two-process tensor- and pipeline-parallel generation "
        "(mlx.launch, ring backend), and bare expert-lane and gRPC echoes with the same "
        "message sizes, and report Shoal's ratios to each. Run it from a Shoal checkout.",
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
    p.add_argument("--lengths", type=prompt_lengths, metavar="N,N,...",
                   help="prompt lengths whose prefill is timed, the shortest also the decode "
                   "figure's (default 16,128,512,4096; with --quick 16,64); the record's name "
                   "ends in -prefill")
    transport_options(p)
    p.add_argument("--json", action="store_true", help="print the whole record as JSON")
    p.add_argument("--report", action="store_true",
                   help="measure nothing: render docs/benchmarks.md's figures from the newest "
                   "records in the results folder (docs/measurements/, or $SHOAL_RESULTS)")
    p.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="draw decode speed against prompt length (needs matplotlib)")
    p.set_defaults(main=main)


def main(args: argparse.Namespace) -> None:
    if args.report:
        print(f"rendered {load_harness('benchmarks.figures').render_docs()}")
        return
    launch_directly()  # before the harness's first kernel: its workers' runs evaluate per layer
    harness = load_harness()
    record = harness.run(quick=args.quick, plot=args.plot, network=args.network,
                         runs=args.runs, long_runs=args.long_runs,
                         decode_tokens=args.decode_tokens, lengths=args.lengths,
                         transport=transport_of(args))
    load_harness("benchmarks.records").save(record)
    print(json.dumps(record, indent=1) if args.json else harness.table(record))


def prompt_lengths(text: str) -> list[int]:
    """--lengths: prompt lengths, comma-separated, each at least 1; sorted, once each."""
    try:
        lengths = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of prompt lengths: {text!r} (e.g. "
                                         "16,512,4096)") from None
    if not lengths or lengths[0] < 1:
        raise argparse.ArgumentTypeError(f"prompt lengths must be at least 1: {text!r}")
    return lengths


def load_harness(name: str = HARNESS) -> ModuleType:
    """benchmarks/bench.py: importable where the checkout is on the path (tests, `python -m`),
    else found beside the checkout's `coordinator/` (an editable install maps only the
    product's packages); an installed wheel has no benchmarks at all."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name not in ("benchmarks", name):
            raise
    checkout = Path(__file__).resolve().parents[2]  # the folder that holds coordinator/
    if not (checkout / "benchmarks" / "bench.py").is_file():
        raise NotFound("`shoal bench` runs from a Shoal checkout: its benchmarks are not "
                       "installed with the package. Clone the repository, run "
                       "scripts/setup.sh there, and run that checkout's .venv/bin/shoal bench")
    sys.path.insert(0, str(checkout))
    return importlib.import_module(name)
