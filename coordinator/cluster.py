"""Membership: connect to the workers, check what they hold, and keep one stream to each.

Each `WorkerLink` owns a gRPC channel and a long-lived bidirectional Compute stream; requests
are queued onto it and replies come back in order. Sending to every involved worker before
reading any reply is what makes the workers of one layer compute at the same time.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np

from engine.auth import METADATA_KEY, make_credential
from engine.checkpoint import Manifest
from engine.errors import InvalidInput, ShoalError, Unavailable
from engine.placement import routing_table
from proto import GRPC_OPTIONS, PROTOCOL_VERSION, shoal_pb2, shoal_pb2_grpc

CONNECT_TIMEOUT = 10.0
REPLY_TIMEOUT = 120.0  # a prefill chunk on a slow CPU worker can take a while
_CLOSE = object()


def parse_addresses(text: str) -> list[str]:
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    if not addresses:
        raise InvalidInput("--workers needs at least one HOST:PORT")
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidInput(f"worker address {address!r} is not HOST:PORT")
    return addresses


def _describe(error: grpc.RpcError) -> str:
    return f"{error.code().name}: {error.details()}"


class WorkerLink:
    """One worker: its channel, its inventory, and the Compute stream to it."""

    def __init__(self, address: str, secret: bytes) -> None:
        self.address = address
        self._secret = secret
        self._channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self._stub = shoal_pb2_grpc.ExpertServiceStub(self._channel)
        self._requests: queue.SimpleQueue | None = None
        self._replies: Iterator[shoal_pb2.ExpertReply] | None = None
        self.inventory: shoal_pb2.Inventory | None = None

    def _metadata(self, method: str) -> list[tuple[str, str]]:
        return [(METADATA_KEY, make_credential(self._secret, f"/shoal.v1.ExpertService/{method}"))]

    def fetch_inventory(self, timeout: float = CONNECT_TIMEOUT) -> shoal_pb2.Inventory:
        try:
            self.inventory = self._stub.GetInventory(
                shoal_pb2.InventoryRequest(), timeout=timeout,
                metadata=self._metadata("GetInventory"), wait_for_ready=True,
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                message = f"worker {self.address} did not answer in {timeout:.0f} s"
                raise Unavailable(message) from None
            raise Unavailable(f"worker {self.address}: {_describe(e)}") from None
        return self.inventory

    def send(self, request: shoal_pb2.ExpertRequest) -> None:
        if self._requests is None:
            self._requests = queue.SimpleQueue()
            self._replies = self._stub.Compute(
                iter(self._requests.get, _CLOSE), metadata=self._metadata("Compute")
            )
        self._requests.put(request)

    def receive(self) -> shoal_pb2.ExpertReply:
        try:
            return next(self._replies)
        except grpc.RpcError as e:
            self._reset()
            raise Unavailable(f"worker {self.address} failed: {_describe(e)}") from None
        except StopIteration:
            self._reset()
            raise Unavailable(f"worker {self.address} closed its stream") from None

    def _reset(self) -> None:
        if self._requests is not None:
            self._requests.put(_CLOSE)
        self._requests = self._replies = None

    def close(self) -> None:
        self._reset()
        self._channel.close()


@dataclass
class Cluster:
    links: list[WorkerLink]
    owners: dict[int, np.ndarray]  # layer -> worker index per expert

    def close(self) -> None:
        for link in self.links:
            link.close()


def connect(addresses: list[str], secret: bytes, manifest: Manifest) -> Cluster:
    """Ask every worker what it holds, refuse mismatches, and build the routing table."""
    links = [WorkerLink(address, secret) for address in addresses]
    try:
        holdings = []
        for link in links:
            inventory = link.fetch_inventory()
            if inventory.protocol_version != PROTOCOL_VERSION:
                raise ShoalError(
                    f"worker {link.address} speaks protocol {inventory.protocol_version}, "
                    f"this coordinator {PROTOCOL_VERSION}: upgrade Shoal on both"
                )
            if inventory.fingerprint != manifest.fingerprint:
                raise ShoalError(
                    f"worker {link.address} serves a different model "
                    f"({inventory.model_type} {inventory.fingerprint[:12]}, expected "
                    f"{manifest.model_type} {manifest.fingerprint[:12]})"
                )
            holdings.append({(h.layer, h.expert) for h in inventory.experts})
        layers = {layer.layer: layer.num_experts for layer in manifest.layers}
        return Cluster(links, routing_table(layers, holdings))
    except BaseException:
        for link in links:
            link.close()
        raise
