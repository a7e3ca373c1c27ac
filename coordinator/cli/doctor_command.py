"""`shoal doctor`: check this machine, and the workers the options name, for what Shoal needs
(the checks themselves are coordinator/ops/doctor.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from coordinator.cli.connect import open_membership
from coordinator.cli.options import (
    AddParser,
    browse_seconds,
    check_one_worker_source,
    discovery_options,
    secret_option,
)
from coordinator.cluster.discovery import Candidate, parse_endpoint
from engine.advert import DEFAULT_CLUSTER
from engine.auth import load_secret, secret_path
from engine.manifest import read_manifest


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "doctor", help="check this machine (and the cluster's workers) for what Shoal needs",
        description="Check, with a verdict for each: the cluster secret (present, private), "
        "the network interfaces and the addresses a worker here would announce (Thunderbolt "
        "Bridge first), whether Bonjour works from this process (on macOS it needs the "
        "Local Network permission), memory, each --store folder and its drive, and MLX's "
        "device. With --workers, --cluster or --cluster-config, also each worker: reachable "
        "(a refused connection is told apart from a silent host), the path and round trip, "
        "its protocol version and model fingerprint; with none of them, the workers of the "
        "default cluster found with Bonjour (unless --no-mdns). Exit status 1 when something "
        "is wrong.",
    )
    p.add_argument("--workers", metavar="HOST:PORT[,HOST:PORT...]",
                   help="check these workers (by address)")
    discovery_options(p, wait=4.0, wait_help="how long to look for and check workers "
                      "(default 4)")
    p.add_argument("--store", action="append", type=Path, metavar="DIR",
                   help="a store folder a worker on this machine would serve (repeat)")
    p.add_argument("--model", type=Path, metavar="OUT_DIR",
                   help="the sharded model the workers should serve (checks fingerprints)")
    p.add_argument("--no-mdns", action="store_true", help="skip the Bonjour check")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    secret_option(p)
    p.set_defaults(main=main)


def main(args: argparse.Namespace) -> None:
    # lazy: start-up
    from coordinator.cluster.membership import Membership
    from coordinator.cluster.snapshot import parse_addresses
    from coordinator.ops.doctor import (
        Check,
        check_mdns,
        check_memory,
        check_mlx,
        check_network,
        check_secret,
        check_stores,
        check_workers,
        failed,
        format_checks,
        inspect_workers,
    )
    from coordinator.ops.ops_report import doctor_report, member_rows

    check_one_worker_source(args)
    addresses = parse_addresses(args.workers) if args.workers else []
    manifest = read_manifest(args.model) if args.model else None
    path = secret_path(args.secret_file)
    checks = [check_secret(path)]
    network, announced = check_network(args.interface)
    checks += network
    if not args.no_mdns:
        checks.append(check_mdns(announced))
    checks += [check_memory(), *check_stores(args.store or []), check_mlx()]
    # With no workers named, the cluster `shoal generate` would use: Bonjour's default one.
    default = not (addresses or args.cluster or args.cluster_config or args.no_mdns)
    if addresses or args.cluster or args.cluster_config or default:
        secret = load_secret(path) if checks[0].verdict == "ok" else os.urandom(32)
        if addresses:
            membership = Membership(secret, cluster="doctor", manifest=manifest,
                                    interface=args.interface)
            membership.add_static(Candidate(a, (parse_endpoint(a, "--workers"),))
                                  for a in addresses)
        else:
            membership = open_membership(args, secret, manifest)
        try:
            browse = browse_seconds(args, static=bool(addresses))
            rows = member_rows(membership.settle(args.wait, at_least=browse))
        finally:
            membership.close()
        if rows or not default:
            checks += check_workers(inspect_workers(rows, secret),
                                    manifest.fingerprint if manifest else None)
        else:  # a Mac that only runs a worker, or serves every expert itself, needs none
            checks.append(Check("worker", "warn", f"no worker of cluster '{DEFAULT_CLUSTER}' "
                                f"answered Bonjour within {args.wait:g} s (what `shoal "
                                "generate` uses without --workers): start `shoal-worker`, or "
                                "give --workers / --cluster / --cluster-config"))
    if args.json:
        print(json.dumps(doctor_report(checks), indent=1))
    else:
        print(format_checks(checks))
    sys.exit(1 if failed(checks) else 0)
