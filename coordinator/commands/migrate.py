"""`shoal deploy` and `shoal rebalance`: their arguments, the run (coordinator/rebalance.py
plans and executes), and the report's wording, as text and as JSON."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from coordinator.commands.connect import members_secret, open_live_workers
from coordinator.commands.options import AddParser, live_options
from engine.errors import InvalidInput, ShoalError

if TYPE_CHECKING:
    from coordinator.rebalance import Report

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
        p.add_argument("--spare", type=float, default=10.0, metavar="PCT",
                       help="share of each worker's memory budget to leave free (default 10)")
        p.add_argument("--replan", action="store_true",
                       help="plan afresh instead of finishing an interrupted run's target")
        p.add_argument("--json", action="store_true", help="print the plan and result as JSON")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.set_defaults(main=main)


def max_bytes(args: argparse.Namespace) -> int | None:
    """--max-bytes (rebalance only) in bytes; None: no limit."""
    from engine.cache_policy import parse_budget

    if not getattr(args, "max_bytes", None):
        return None
    limit = parse_budget(args.max_bytes).bytes
    if limit is None:
        raise InvalidInput("--max-bytes takes a size such as 512M or 20G")
    return limit


def main(args: argparse.Namespace) -> None:
    from coordinator.rebalance import migrate
    from engine.manifest import read_manifest

    limit = max_bytes(args)
    manifest = read_manifest(args.model)
    links, close = open_live_workers(args, members_secret(args, manifest), manifest)
    try:
        report = migrate(args.model, links, deploy=args.command == "deploy",
                         dry_run=args.dry_run, max_bytes=limit, spare=args.spare / 100,
                         replan=args.replan, progress=not (args.json or args.quiet))
    finally:
        close()
    if args.json:
        print(json.dumps(report_json(report), indent=1))
    else:
        print("\n".join(describe(report)))
    blocked = report.proposal.plan.blocked
    if blocked and not args.dry_run:
        raise ShoalError(f"{len(blocked)} experts were left where they are (listed above); "
                         "free disk or start the workers that hold them, then run it again")


def describe(report: Report, *, steps: int = 20) -> list[str]:
    """What a plan does, for --dry-run and after a run."""
    from engine.cache_policy import format_bytes
    from engine.rebalance_plan import MIN_GAIN

    p = report.proposal
    plan = p.plan
    lines = [f"{report.mode} over {len(report.workers)} workers ({', '.join(report.workers)})"
             + (" [finishing an interrupted run]" if p.resumed else "")]
    if not plan.steps and not plan.blocked:
        why = ("every expert is served by a live worker (`shoal rebalance` moves them)"
               if report.mode == "deploy" else
               f"no placement found lowers the predicted imbalance by {MIN_GAIN:.0%} or more")
        lines.append(f"nothing to do: {why}")
    moved: dict[str, list[int]] = {w: [0, 0, 0] for w in report.workers}  # in, bytes in, out
    for s in plan.steps:
        if s.kind == "copy":
            moved[s.worker][0] += 1
            moved[s.worker][1] += s.bytes
        elif s.kind == "delete":
            moved[s.worker][2] += 1
    lines.append(f"  copies {plan.count('copy')} ({format_bytes(plan.copy_bytes)}), "
                 f"keeps {plan.count('keep')}, drops {plan.count('delete')}; "
                 f"{len(plan.steps)} steps")
    for w, (n_in, b_in, n_out) in moved.items():
        held = sum(1 for names in p.target.values() if w in names)
        lines.append(f"  {w:<24} +{n_in} ({format_bytes(b_in)})  -{n_out}  -> {held} experts")
    replicas = sum(len(v) > 1 for v in p.target.values())
    now = "-" if p.imbalance_now is None else f"{p.imbalance_now:.2f}"
    lines.append(f"  predicted imbalance (busiest worker / mean, per layer): {now} now, "
                 f"{p.imbalance_after:.2f} after; {replicas} experts with replicas")
    for key, why in sorted(plan.blocked.items()):
        lines.append(f"  left as is: expert {key[0]}/{key[1]}: {why}")
    shown = plan.steps[:steps]
    lines += [f"    {s.describe()}" for s in shown]
    if len(plan.steps) > len(shown):
        lines.append(f"    ... and {len(plan.steps) - len(shown)} more steps")
    e = report.execution
    if e is not None:
        rate = e.copied_bytes / e.seconds if e.seconds else 0.0
        lines.append(f"done: {e.steps_done} steps in {e.seconds:.1f} s, sent "
                     f"{format_bytes(e.copied_bytes)} ({format_bytes(rate)}/s)"
                     + (f", {format_bytes(e.resumed_bytes)} resumed" if e.resumed_bytes else ""))
    return lines


def report_json(report: Report) -> dict:
    """The plan and its result for --json: every step, what was left as is, the target."""
    p = report.proposal
    e = report.execution
    return {
        "mode": report.mode,
        "workers": report.workers,
        "resumed": p.resumed,
        "imbalance_now": p.imbalance_now,
        "imbalance_after": p.imbalance_after,
        "copy_bytes": p.plan.copy_bytes,
        "steps": [{"kind": s.kind, "layer": s.key[0], "expert": s.key[1], "worker": s.worker,
                   "source": s.source, "bytes": s.bytes} for s in p.plan.steps],
        "blocked": {f"{k[0]}/{k[1]}": why for k, why in p.plan.blocked.items()},
        "target": {f"{k[0]}/{k[1]}": list(v) for k, v in sorted(p.target.items())},
        "execution": None if e is None else {"steps": e.steps_done, "seconds": e.seconds,
                                             "copied_bytes": e.copied_bytes,
                                             "resumed_bytes": e.resumed_bytes,
                                             "by_kind": e.counts},
    }
