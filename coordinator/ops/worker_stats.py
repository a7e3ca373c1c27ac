"""Reading the workers' cache, prefetch and drive counters (the `GetStats` RPC): `shoal generate
--stats` reports the difference across a run, `shoal workers --stats` one reading."""

from __future__ import annotations

from collections.abc import Iterable

from coordinator.dataplane.link import WorkerLink
from engine.errors import ShoalError
from proto import shoal_pb2


def fetch_worker_stats(address: str, secret: bytes) -> shoal_pb2.WorkerStats:
    """One worker's counters since it started (raises Unavailable if it does not answer)."""
    link = WorkerLink(address, secret)
    try:
        return link.fetch_stats()
    finally:
        link.close()


def read_stats(links: Iterable[WorkerLink]) -> dict[str, shoal_pb2.WorkerStats]:
    """A reading of every worker that answers, by address."""
    out = {}
    for link in links:
        try:
            out[link.address] = link.fetch_stats()
        except ShoalError:
            continue
    return out
