"""`shoal heat`: the tokens routed to each expert, read from the live workers into the record
kept in OUT_DIR/heat.msgpack (coordinator/ops/heat_record.py), then shown."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from coordinator.cli.connect import members_secret, open_live_workers
from coordinator.cli.options import AddParser, live_options
from engine.manifest import read_manifest


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "heat", help="tokens routed to each expert: hottest experts, skew, load per worker",
        description="Read every live worker's count of the tokens it computed per (layer, "
        "expert), add them to the record kept in OUT_DIR/heat.msgpack (it outlives runs and "
        "restarts; `shoal generate` adds to it too), and show the hottest experts, the skew "
        "of each layer and the load of each worker.",
    )
    live_options(p)
    p.add_argument("--layer", type=int, metavar="L", help="only this MoE layer")
    p.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="also draw a layer x expert heat map (needs matplotlib)")
    p.add_argument("--json", action="store_true",
                   help='print {"<layer>": {"<expert>": tokens}}, the file `shoal plan --heat` '
                   "reads")
    p.add_argument("--offline", action="store_true",
                   help="show the record as it is, without asking the workers")
    p.add_argument("--reset", action="store_true", help="forget the recorded heat")
    p.set_defaults(main=main)


def main(args: argparse.Namespace) -> None:
    # lazy: start-up
    from coordinator.ops.heat_record import (
        fetch_readings,
        format_heat_summary,
        load_record,
        plot_heat,
        record_heat,
        record_path,
        reset_heat,
        summarize_heat,
    )
    from coordinator.ops.ops_report import heat_report

    manifest = read_manifest(args.model)
    if args.reset:
        reset_heat(args.model)
        print(f"cleared the recorded heat in {record_path(args.model)}", file=sys.stderr)
        return
    if args.offline:
        record = load_record(record_path(args.model), manifest.fingerprint)
    else:
        links, close = open_live_workers(args, members_secret(args, manifest), manifest)
        try:
            record = record_heat(args.model, manifest, fetch_readings(links))
        finally:
            close()
    summary = summarize_heat(record, manifest, layer=args.layer)  # also checks --layer
    if args.json:
        print(json.dumps(heat_report(record, layer=args.layer), indent=1))
    else:
        print(format_heat_summary(summary))
    if args.plot:
        plot_heat(record, manifest, args.plot)
        print(f"wrote the heat map to {args.plot}", file=sys.stderr)
