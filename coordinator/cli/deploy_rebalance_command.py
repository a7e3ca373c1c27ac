"""`shoal deploy` and `shoal rebalance`: their arguments and the run (coordinator/ops/rebalancer.py
plans, executes and words the result; coordinator/decoding/report.py makes its --json)."""

from __future__ import annotations

import argparse
import json

from coordinator.cli.connect import members_secret, open_live_workers
from coordinator.cli.options import AddParser, live_options
from engine.errors import InvalidInput, ShoalError
from engine.manifest import read_manifest

COMMANDS = (
    ("deploy", "place the experts on the live workers and send them the files",
     "Plan a placement for the live workers (by memory and disk, replicating hot experts "
     "if a heat record exists) and send each worker its expert files over gRPC: in chunks, "
     "checked against the manifest, resumed where an interrupted transfer stopped. Workers "
     "may start with a store folder that holds only OUT_DIR/manifest.json."),
    ("rebalance", "move and replicate experts by the recorded heat, while serving",
     "From the recorded heat (`shoal heat`), plan a better placement and migrate to it "
     "while generation goes on: copy to the new holder, verify, let coordinators route to "
     "it, then drain and delete copies no longer planned. Every expert keeps a verified, "
     "served copy at every step; if a run stops, run it again to finish."),
)


def setup_arg_parser(add_parser: AddParser) -> None:
    for name, help_text, description in COMMANDS:
        p = add_parser(name, help=help_text, description=description)
        live_options(p)
        p.add_argument("--dry-run", action="store_true",
                       help="print the plan (moves, bytes, predicted imbalance) and change nothing")
        if name == "rebalance":
            p.add_argument("--max-bytes", metavar="SIZE",
                           help="copy at most this much (e.g. 2G): the most useful moves first")
        p.add_argument("--member", action="append", metavar="NAME=[MEMORY]:READ",
                       help="a worker's drive read speed (and memory budget, else the one it "
                       "reports), by node id or address, e.g. studio-a=:40MB/s (repeat; also "
                       "a cluster config's read_speed). Default: as measured from its drive "
                       "counters once it has read. With every worker's speed known, a model "
                       "beyond their memory is placed for streaming: hot sets in memory, cold "
                       "reads in proportion to drive speed")
        p.add_argument("--spare", type=float, default=10.0, metavar="PCT",
                       help="share of each worker's memory budget to leave free (default 10)")
        p.add_argument("--drive-copies", type=int, default=1, metavar="N",
                       help="with streamed placement, each cold expert (one not in memory) on N "
                       "members' drives, each miss read from the copy whose drive ends soonest; "
                       "N times the cold experts' disk (default 1; docs/streaming.md: when "
                       "it pays)")
        p.add_argument("--replan", action="store_true",
                       help="plan afresh instead of finishing an interrupted run's target")
        p.add_argument("--json", action="store_true", help="print the plan and result as JSON")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.set_defaults(main=main)


def max_bytes(args: argparse.Namespace) -> int | None:
    """--max-bytes (rebalance only) in bytes; None: no limit."""
    # lazy: start-up
    from engine.cache_policy import parse_budget

    if not getattr(args, "max_bytes", None):
        return None
    limit = parse_budget(args.max_bytes).bytes
    if limit is None:
        raise InvalidInput("--max-bytes takes a size such as 512M or 20G")
    return limit


def main(args: argparse.Namespace) -> None:
    # lazy: start-up
    from coordinator.ops.planning import live_members
    from coordinator.ops.rebalancer import describe, migrate

    limit = max_bytes(args)
    members = live_members(args.member, args.cluster_config)
    manifest = read_manifest(args.model)
    links, close = open_live_workers(args, members_secret(args, manifest), manifest)
    try:
        report = migrate(args.model, links, deploy=args.command == "deploy",
                         dry_run=args.dry_run, max_bytes=limit, spare=args.spare / 100,
                         replan=args.replan, progress=not (args.json or args.quiet),
                         members=members, drive_copies=args.drive_copies)
    finally:
        close()
    if args.json:
        # lazy: start-up
        from coordinator.ops.ops_report import migration_report

        print(json.dumps(migration_report(report), indent=1))
    else:
        print("\n".join(describe(report)))
    blocked = report.proposal.plan.blocked
    if blocked and not args.dry_run:
        raise ShoalError(f"{len(blocked)} experts were left where they are (listed above); "
                         "free disk or start the workers that hold them, then run it again")
