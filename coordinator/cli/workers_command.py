"""`shoal workers`: the workers of a cluster, their health and, with --stats, their counters;
the table it prints (its --json and --stats are coordinator/decoding/report.py's)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from coordinator.cli.connect import open_membership
from coordinator.cli.options import (
    AddParser,
    browse_seconds,
    check_one_worker_source,
    cluster_secret,
    discovery_options,
    secret_option,
)
from coordinator.dataplane.link_errors import dead_worker
from engine.auth import Secret
from engine.errors import ShoalError
from engine.manifest import read_manifest
from engine.tls import make_identity


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "workers", help="list the workers found on the local network, and their health",
        description="Browse for shoal-worker daemons of a cluster (Bonjour, or a cluster "
        "config), check each one's health and credentials, and show: node id, address and "
        "the path used to reach it (Thunderbolt Bridge, wired, wireless), state (healthy, "
        "unreachable, incompatible, unauthenticated), experts held, memory budget, round trip. "
        "Exit status 1 when no worker is healthy (with --workers: when any listed one is not).",
    )
    p.add_argument("--workers", metavar="HOST:PORT[,HOST:PORT...]",
                   help="check the workers at these addresses instead of browsing (for "
                   "networks where multicast does not get through)")
    discovery_options(p, wait=4.0, wait_help="how long to listen and check (default 4)")
    p.add_argument("--model", type=Path, metavar="OUT_DIR",
                   help="also mark workers that serve another model as incompatible")
    p.add_argument("--stats", action="store_true",
                   help="also show each healthy worker's counters since it started: memory "
                   "budget and resident experts, cache hit rate, prefetch recall and "
                   "precision, bytes read per drive")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    secret_option(p)
    p.set_defaults(main=main)


def main(args: argparse.Namespace) -> None:
    # lazy: start-up
    from coordinator.ops.ops_report import member_rows, workers_report, workers_stats_lines

    check_one_worker_source(args)
    try:
        secret = cluster_secret(args)
    except ShoalError as e:
        print(f"shoal: warning: {e}; every worker will show as unauthenticated", file=sys.stderr)
        secret = Secret(os.urandom(32), make_identity())  # no cluster's: refused by all
    manifest = read_manifest(args.model) if args.model else None
    membership = open_membership(args, secret, manifest)
    try:
        browse = browse_seconds(args, static=bool(args.workers))
        rows = member_rows(membership.settle(args.wait, at_least=browse))
    finally:
        membership.close()
    if args.stats:
        add_worker_stats(rows, secret)
    if args.json:
        print(json.dumps(workers_report(membership.cluster, rows), indent=1))
    elif rows:
        print(format_table(rows))
        if args.stats:
            print("\n".join(workers_stats_lines(rows)))
    else:
        print(
            f"no workers of cluster {membership.cluster!r} answered within {args.wait:g} s. "
            "Check that shoal-worker runs with the same --cluster, that this process may use "
            "the local network (macOS: Local Network permission), or list them with --workers "
            "or --cluster-config; see docs/operations.md",
            file=sys.stderr,
        )
    healthy = [row for row in rows if row["state"] == "healthy"]
    if not healthy or (args.workers and len(healthy) < len(rows)):
        sys.exit(1)


def add_worker_stats(rows: list[dict], secret: bytes) -> None:
    """Each healthy worker's cache, prefetch and drive counters since it started, as `stats`."""
    # lazy: start-up
    from coordinator.decoding.report import summarize_stats
    from coordinator.ops.worker_stats import fetch_worker_stats

    for row in rows:
        if row["state"] != "healthy":
            continue
        try:
            row["stats"] = summarize_stats(fetch_worker_stats(row["address"], secret))
        except ShoalError as e:
            row["stats_error"] = str(e)


def format_table(rows: Sequence[dict]) -> str:
    header = ("NODE ID", "ADDRESS", "PATH", "STATE", "EXPERTS", "MEMORY", "RTT")
    lines = [header]
    for r in rows:
        path = f"{r['interface']} ({r['path']})" if r["interface"] else r["path"]
        rtt = "-" if r["rtt_ms"] is None else f"{r['rtt_ms']:.1f} ms"
        state = r["state"] + (" (duplicate id)" if r["duplicate_node_id"] else "")
        lines.append((r["node_id"], r["address"], path, state, str(r["experts"]),
                      _size(r["memory_budget"]), rtt))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = "\n".join(
        "  ".join(cell.rjust(w) if i in (4, 5, 6) else cell.ljust(w)
                  for i, (cell, w) in enumerate(zip(line, widths, strict=True))).rstrip()
        for line in lines
    )
    notes = [dead_worker(r["node_id"], r["address"], r["detail"]) if r["state"] == "unreachable"
             else (r["address"] if r["node_id"] == r["address"] else
                   f"{r['node_id']} ({r['address']})") + f": {r['detail']}"
             for r in rows if r["detail"]]
    notes += [
        f"node id {node_id} is used by several workers ({', '.join(addresses)}): give each "
        "its own --node-id, or delete the copied ~/.config/shoal/node-id"
        for node_id, addresses in _duplicates_of(rows).items()
    ]
    return text + "".join(f"\n  {note}" for note in notes)


def _duplicates_of(rows: Sequence[dict]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for r in rows:
        if r["duplicate_node_id"]:
            found.setdefault(r["node_id"], []).append(r["address"])
    return found


def _size(count: int) -> str:
    # lazy: start-up
    from engine.cache_policy import format_bytes

    return format_bytes(count) if count else "-"

