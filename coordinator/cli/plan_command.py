"""`shoal plan`: an offline what-if over a model and some Macs (coordinator/ops/planning.py; the
plan as plain data, also its --json, is coordinator/decoding/report.py's)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from coordinator.cli.options import AddParser
from coordinator.ops.hub import local_model
from engine.errors import InvalidInput
from engine.heat import check_heat_matches, read_heat
from engine.manifest import MANIFEST_NAME, read_manifest

QUANTIZE_BITS = (2, 3, 4, 5, 6, 8)  # what mlx-lm's affine quantization takes


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "plan", help="what-if: would a model fit these Macs, where would experts go, how fast",
        description="Plan a placement offline: whether the model fits the workers' memory "
        "(or only their disks), which experts go where with hot experts replicated, the "
        "predicted imbalance before and after replication, and a rough bound on decode "
        "tokens/s. MODEL is a folder written by `shoal shard`, or a model's config.json "
        "(a Hugging Face original or an mlx-community conversion: sizes are then estimated "
        "from its dtype and quantization, per-layer overrides included). Exit status: 0 fits "
        "in memory, 3 fits only by streaming experts from disk, 4 does not fit, 2 bad input.",
    )
    p.add_argument("--model", type=Path, required=True, metavar="OUT_DIR_OR_CONFIG",
                   help="a folder written by `shoal shard`, a model folder, its config.json, "
                   "or a repository id ORG/NAME in the Hugging Face cache (`shoal pull`)")
    p.add_argument("--bits", type=int, metavar="BITS",
                   help="what if the experts and dense weights were quantized to BITS "
                   "(2, 3, 4, 5, 6 or 8) as `shoal shard --quantize BITS` does (config only)")
    p.add_argument("--group-size", type=int, default=64, metavar="G",
                   help="quantization group size for --bits (default 64)")
    p.add_argument("--worker", action="append", required=True, metavar="NAME=MEMORY[:DISK]",
                   help="a Mac: memory for experts and free disk, e.g. studio=192G:2TB (repeat). "
                   "G, T (and GiB, TiB) are binary, 2^30 and 2^40 bytes; GB, TB are decimal, as "
                   "drives are sold: a 2 TB SSD is 2TB (1.82 TiB). The plan prints disks in both")
    p.add_argument("--heat", type=Path, metavar="HEAT.json",
                   help='tokens per expert, {"<layer>": {"<expert>": count}} as written by '
                   "`shoal heat --json` (default: for a folder written by `shoal shard`, the "
                   "heat its cluster recorded there, OUT_DIR/heat.msgpack; else uniform)")
    p.add_argument("--uniform", action="store_true",
                   help="plan with uniform heat even when the model folder has recorded heat")
    p.add_argument("--spare", type=float, default=10.0, metavar="PCT",
                   help="share of each worker's memory to leave free (default 10)")
    p.add_argument("--memory-gbps", type=float, default=400.0, metavar="GB/S",
                   help="memory bandwidth per Mac for the speed bound (default 400)")
    p.add_argument("--disk-gbps", type=float, default=5.0, metavar="GB/S",
                   help="SSD read bandwidth for the speed bound (default 5)")
    p.add_argument("--round-trip-ms", type=float, default=0.3, metavar="MS",
                   help="network round trip per MoE layer for the speed bound (default 0.3)")
    p.add_argument("--scaling", action="store_true",
                   help="forecast streamed decode on the first 1, 2, 4, ... of the --worker Macs "
                   "(without it, only when the model streams, on all of them)")
    p.add_argument("--skew", type=float, default=0.0, metavar="S",
                   help="with no heat, the forecast's routing: expert e of a layer gets "
                   "1/(e+1)^S of its tokens (default 0: uniform)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(main=main)


def main(args: argparse.Namespace) -> None:
    # lazy: start-up
    from coordinator.ops.ops_report import plan_report
    from coordinator.ops.planning import VERDICT_EXIT, parse_worker_capacity, print_plan
    from engine.placement import SpeedAssumptions
    from engine.sizes import read_sizes

    if args.bits is not None and args.bits not in QUANTIZE_BITS:
        raise InvalidInput(f"--bits takes {', '.join(map(str, QUANTIZE_BITS))}, not {args.bits}")
    workers = [parse_worker_capacity(w) for w in args.worker]
    args.model = local_model(str(args.model))
    sizes = read_sizes(args.model, bits=args.bits, group_size=args.group_size)
    if args.heat and args.uniform:
        raise InvalidInput("give --heat or --uniform, not both")
    heat, origin = (read_heat(args.heat), f"from {args.heat}") if args.heat else (None, "uniform")
    if heat is None and not args.uniform:
        heat, origin = recorded_heat(args.model)
    if heat is not None:
        check_heat_matches(heat, sizes.experts)
    assume = SpeedAssumptions(args.memory_gbps, args.disk_gbps, args.round_trip_ms)
    if sizes.estimated and not sizes.source_bytes:  # published as the config says: bf16...
        sizes = replace(sizes, source_bytes=download_bytes(args.model, sizes, args.bits,
                                                           args.group_size))
    report = plan_report(sizes, workers, heat, args.spare / 100, assume, heat_origin=origin)
    report["advice"] = advice(report, sizes, args, workers, heat, assume)
    if args.scaling or report["verdict"] == "streams":
        # lazy: start-up
        from coordinator.ops.stream_forecast import print_forecast, streaming_forecast

        report["streaming"] = streaming_forecast(sizes, workers, heat, args.spare / 100, assume,
                                                 skew=args.skew, scaling=args.scaling)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_plan(report)
        if "streaming" in report:
            print_forecast(report["streaming"], assume)
    sys.exit(VERDICT_EXIT[report["verdict"]])


def recorded_heat(model: Path) -> tuple[dict | None, str]:
    """The heat the cluster recorded in a sharded model's folder (`shoal heat` shows it), and
    where it came from; (None, "uniform") when there is none."""
    # lazy: start-up
    from coordinator.ops.heat_record import load_record, record_path

    if not (Path(model) / MANIFEST_NAME).is_file() or not record_path(model).is_file():
        return None, "uniform"
    total = load_record(record_path(model), read_manifest(model).fingerprint).total()
    if not total:
        return None, "uniform"
    return ({key: float(count) for key, count in total.items()},
            f"recorded in {record_path(model)}: {sum(total.values())} (token, expert) pairs; "
            "--uniform ignores it")


def download_bytes(model: Path, sizes, bits: int | None, group_size: int) -> int:
    """What downloading a model known only by its config takes: its weights in the config's
    own storage (the split's size, unless --bits asks what quantizing would change)."""
    # lazy: start-up
    from engine.sizes import read_sizes

    if bits is not None:
        sizes = read_sizes(model)
    return sum(sizes.experts.values()) + sizes.dense_bytes


def advice(report: dict, sizes, args: argparse.Namespace, workers: list, heat,
           assume) -> list[str]:
    """What to try when the model does not fit in memory: the fewest bits that make it fit
    (a config not yet quantized), and the disk sizes a streaming verdict needs."""
    # lazy: start-up
    from coordinator.ops.ops_report import plan_report
    from engine.sizes import read_sizes

    out = []
    if report["verdict"] != "fits" and args.bits is None and sizes.estimated and (
            sizes.expert_bits >= 16):
        for bits in (8, 6, 4, 3, 2):
            smaller = read_sizes(args.model, bits=bits, group_size=args.group_size)
            if plan_report(smaller, workers, heat, args.spare / 100, assume)["verdict"] == "fits":
                out.append(f"with --bits {bits} (`shoal shard --quantize {bits}`) it would fit "
                           f"in memory: experts {sum(smaller.experts.values()) / 2**30:.1f} GiB")
                break
        else:
            out.append("even at --bits 2 it would not fit in these Macs' memory: add Macs or "
                       "memory")
    if report["verdict"] == "streams" and any(w.disk is None for w in workers):
        out.append("streaming keeps experts on the workers' drives: give each --worker its "
                   "free disk (NAME=MEMORY:DISK, e.g. a=192G:2TB) to check that they fit there")
    return out
