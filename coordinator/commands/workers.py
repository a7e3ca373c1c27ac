"""`shoal workers`: the workers of a cluster, their health and, with --stats, their counters."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from coordinator.commands.connect import open_membership
from coordinator.commands.options import (
    AddParser,
    browse_seconds,
    check_one_worker_source,
    cluster_secret,
    discovery_options,
    secret_option,
)
from engine.errors import ShoalError


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
    from coordinator.commands.worker_rows import format_table, member_rows
    from engine.manifest import read_manifest

    check_one_worker_source(args)
    try:
        secret = cluster_secret(args)
    except ShoalError as e:
        print(f"shoal: warning: {e}; every worker will show as unauthenticated", file=sys.stderr)
        secret = os.urandom(32)
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
        print(json.dumps({"cluster": membership.cluster, "workers": rows}, indent=1))
    elif rows:
        print(format_table(rows))
        if args.stats:
            print_worker_stats(rows)
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
    from coordinator.worker_stats import fetch_worker_stats, summarize_stats

    for row in rows:
        if row["state"] != "healthy":
            continue
        try:
            row["stats"] = summarize_stats(fetch_worker_stats(row["address"], secret))
        except ShoalError as e:
            row["stats_error"] = str(e)


def print_worker_stats(rows: list[dict]) -> None:
    from coordinator.worker_stats import format_stats_summary

    print("\nsince each worker started:")
    for row in rows:
        if "stats" in row:
            print("\n".join(format_stats_summary(row["address"], row["stats"])))
        elif "stats_error" in row:
            print(f"  {row['address']}: no stats ({row['stats_error']})")
