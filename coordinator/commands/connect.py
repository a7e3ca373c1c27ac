"""How a command reaches the workers its options name (--workers addresses, a cluster config,
or Bonjour browsing), and what a run leaves behind with them: its heat, recorded."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from coordinator.commands.options import browse_seconds, check_one_worker_source, transport_of
from engine.errors import InvalidInput, ShoalError, Unavailable

if TYPE_CHECKING:
    from pathlib import Path

    from coordinator.membership import Membership
    from engine.manifest import Manifest


def worker_addresses(text: str) -> list[str]:
    """--workers HOST:PORT,...: refused at once when nothing listens at one of them, rather
    than after loading the model and waiting for it to answer."""
    from coordinator.cluster import parse_addresses
    from coordinator.doctor import refused_at_once

    addresses = parse_addresses(text)
    refused = [a for a in addresses if refused_at_once(a)]
    if refused:
        raise Unavailable(
            f"nothing listens at {', '.join(refused)} (the connection was refused at once): "
            "is shoal-worker running there, on that port? `shoal doctor --workers ...` checks"
        )
    return addresses


def open_membership(
    args: argparse.Namespace,
    secret: bytes,
    manifest: Manifest | None = None,
    log: Callable[[str], None] | None = None,
) -> Membership:
    """Workers from --cluster-config, else from Bonjour browsing for --cluster; for a command
    that follows --workers too (`shoal serve`), those addresses, watched like a config's."""
    from coordinator.cluster import parse_addresses
    from coordinator.discovery import Candidate, read_cluster_config
    from coordinator.link import LANE
    from coordinator.membership import Membership
    from engine.advert import DEFAULT_CLUSTER, check_name

    # a command that computes (generate, serve) says how its Compute requests travel
    transport = transport_of(args) if hasattr(args, "transport") else LANE
    if getattr(args, "workers", None):
        membership = Membership(secret, cluster=DEFAULT_CLUSTER, manifest=manifest,
                                interface=args.interface, log=log, transport=transport)
        candidates = []
        for address in parse_addresses(args.workers):
            host, _, port = address.rpartition(":")
            candidates.append(Candidate(key=address, endpoints=((host, int(port)),)))
        membership.add_static(candidates)
        return membership
    config = read_cluster_config(args.cluster_config) if args.cluster_config else None
    if config and args.cluster and args.cluster != config.name:
        raise InvalidInput(f"{args.cluster_config} describes cluster {config.name!r}, "
                           f"not {args.cluster!r}")
    name = config.name if config else check_name(args.cluster or DEFAULT_CLUSTER, "cluster")
    membership = Membership(secret, cluster=name, manifest=manifest,
                            interface=args.interface, log=log, transport=transport)
    if config:
        membership.add_static(config.workers)
    else:
        membership.browse()
    return membership


def open_live_workers(
    args: argparse.Namespace, secret: bytes, manifest: Manifest
) -> tuple[list, Callable[[], None]]:
    """The workers to talk to, and how to let go of them: --workers (each must answer), else
    the healthy workers of the cluster (Bonjour or --cluster-config) found within --wait."""
    from coordinator.link import WorkerLink
    from coordinator.membership import stderr_log

    check_one_worker_source(args)
    if args.workers:
        links = [WorkerLink(address, secret) for address in worker_addresses(args.workers)]

        def close() -> None:
            for link in links:
                link.close()

        return links, close
    membership = open_membership(args, secret, manifest, log=stderr_log)
    membership.settle(args.wait, at_least=browse_seconds(args))
    return membership.live()[1], membership.close


def record_run_heat(model_dir: Path, manifest: Manifest, links: list) -> None:
    """Fold the workers' token counts into OUT_DIR/heat.msgpack; a failure only warns."""
    from coordinator.heat import fetch_readings, record_heat

    try:
        record_heat(model_dir, manifest, fetch_readings(links))
    except ShoalError as e:
        print(f"shoal: warning: the heat of this run was not recorded: {e}", file=sys.stderr)
