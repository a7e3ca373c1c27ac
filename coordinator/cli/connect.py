"""How a command reaches the workers its options name (--workers addresses, a cluster config,
or Bonjour browsing) and the coordinator's own stores (--local-store, a cluster config's
[coordinator]), and what a run leaves behind with them: its heat, recorded."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.cli.options import (
    browse_seconds,
    check_local_store_args,
    check_one_worker_source,
    cluster_secret,
    transport_of,
)
from coordinator.cluster.discovery import Candidate, read_cluster_config
from engine.advert import DEFAULT_CLUSTER, check_name
from engine.errors import InvalidInput, ShoalError, Unavailable
from engine.manifest import Manifest, read_manifest

if TYPE_CHECKING:
    from coordinator.cluster.membership import Membership
    from coordinator.decoding.generate import RemoteModel


def worker_addresses(text: str) -> list[str]:
    """--workers HOST:PORT,...: refused at once when nothing listens at one of them, rather
    than after loading the model and waiting for it to answer."""
    # lazy: start-up
    from coordinator.cluster.snapshot import parse_addresses
    from coordinator.ops.doctor import refused_at_once

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
    # lazy: start-up
    from coordinator.cluster.membership import Membership
    from coordinator.cluster.snapshot import parse_addresses
    from coordinator.dataplane.link import LANE

    # a command that computes (generate, serve) says how its Compute requests travel
    transport = transport_of(args) if hasattr(args, "transport") else LANE
    if getattr(args, "workers", None):
        addresses = parse_addresses(args.workers)
        membership = Membership(secret, cluster=DEFAULT_CLUSTER, manifest=manifest,
                                interface=args.interface, log=log, transport=transport,
                                listed=addresses)
        candidates = []
        for address in addresses:
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
    """The members to talk to, and how to let go of them: the coordinator's own stores
    (--local-store, a config's [coordinator]) first, as a member in this process; then
    --workers (each must answer), else the healthy workers of the cluster (Bonjour or
    --cluster-config) found within --wait, unless the local stores hold every expert."""
    # lazy: start-up
    from coordinator.cluster.membership import stderr_log
    from coordinator.dataplane.link import WorkerLink
    from coordinator.dataplane.local_experts import open_local_experts

    check_one_worker_source(args)
    check_local_store_args(args)
    stores, memory_budget = local_stores(args)
    local = [open_local_experts(stores, manifest, memory_budget=memory_budget, warm=False)
             ] if stores else []
    if args.workers or not needs_workers(args, manifest, stores):
        addresses = worker_addresses(args.workers) if args.workers else []
        links = [WorkerLink(address, secret) for address in addresses]

        def close() -> None:
            for link in [*local, *links]:
                link.close()

        return [*local, *links], close
    membership = open_membership(args, secret, manifest, log=stderr_log)
    membership.settle(args.wait, at_least=browse_seconds(args))

    def close_all() -> None:
        membership.close()
        for link in local:
            link.close()

    return [*local, *membership.live()[1]], close_all


def record_run_heat(model_dir: Path, manifest: Manifest, links: list) -> None:
    """Fold the workers' token counts into OUT_DIR/heat.msgpack; a failure only warns."""
    # lazy: start-up
    from coordinator.ops.heat_record import fetch_readings, record_heat

    try:
        record_heat(model_dir, manifest, fetch_readings(links))
    except ShoalError as e:
        print(f"shoal: warning: the heat of this run was not recorded: {e}", file=sys.stderr)


def local_stores(args: argparse.Namespace) -> tuple[list[Path], str | None]:
    """The coordinator's own store folders and their memory budget: --local-store (and
    --memory-budget), else the [coordinator] table of --cluster-config; none by default."""
    if args.local_store:
        return list(args.local_store), args.memory_budget
    if args.cluster_config:
        config = read_cluster_config(args.cluster_config)
        return list(config.local_stores), args.memory_budget or config.memory_budget
    return [], None


def needs_workers(args: argparse.Namespace, manifest: Manifest, stores: list[Path]) -> bool:
    """Whether to reach workers at all: when the options name some, or when the local stores
    lack some expert's file (then they are looked for with Bonjour); one Mac alone needs none."""
    if args.workers or args.cluster or args.cluster_config:
        return True
    present = {e.file for e in manifest.experts for store in stores if (store / e.file).is_file()}
    return len(present) < len(manifest.experts)


def members_secret(args: argparse.Namespace, manifest: Manifest) -> bytes:
    """The cluster secret, when workers are to be reached; one Mac alone needs none."""
    return cluster_secret(args) if needs_workers(args, manifest, local_stores(args)[0]) else b""


@contextlib.contextmanager
def remote_model(args: argparse.Namespace, secret: bytes,
                 say: Callable[[str], None]) -> Iterator[RemoteModel]:
    """The model of --model with its experts where the options say (model_options: --workers,
    the cluster, --local-store, --transport), let go of however the block ends, the run's
    heat recorded first from the members still serving (a worker given up would only make
    it wait). `say` hears what is waited for."""
    # lazy: start-up
    from coordinator.decoding.generate import open_remote_model

    manifest = read_manifest(args.model)
    stores, memory_budget = local_stores(args)
    addresses = worker_addresses(args.workers) if args.workers else []
    membership = None if args.workers or not needs_workers(args, manifest, stores) else \
        open_membership(args, secret, manifest, log=say)
    remote = None
    try:
        remote = open_remote_model(args.model, addresses, secret, membership=membership,
                                   wait=args.wait, on_wait=say, transport=transport_of(args),
                                   local_stores=stores, memory_budget=memory_budget)
        yield remote
    finally:
        if remote is not None:
            cluster = remote.cluster
            serving = [link for link, holds in zip(cluster.links, cluster.holdings,
                                                   strict=True) if holds]
            record_run_heat(args.model, remote.manifest, serving)
            remote.close()
        if membership is not None:
            membership.close()
