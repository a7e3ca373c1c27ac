"""The members a generation uses, as the dispatcher reads them: a frozen `Snapshot` (hosts,
holdings, routes) made anew by `Cluster` whenever its `Members` change, never inside a layer
call. Members: a `Membership` (Bonjour, config), `FixedMembers` (--workers), `with_local`."""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from coordinator.cluster.discovery import parse_endpoint
from coordinator.dataplane.hosts import ExpertHost, fresh_inventories
from coordinator.dataplane.link import CONNECT_TIMEOUT, LANE, Transport, WorkerLink, handshake
from coordinator.dataplane.link_errors import held, reason_of
from coordinator.dataplane.local_experts import LocalExperts, WithLocal
from engine.auth import Secret
from engine.errors import InvalidInput, ShoalError, Unavailable
from engine.manifest import ExpertKey, Manifest
from engine.placement import LayerRoutes, replica_routes
from proto import shoal_pb2


class Members(Protocol):
    """Where a Cluster's members come from: the live ones now, and a call to `watch` them
    (the callback runs, on whichever thread saw it, after every change)."""

    version: int

    def live(self) -> tuple[int, list[ExpertHost], list[frozenset[ExpertKey]]]: ...

    def absent(self) -> list[str]:
        """The members known but not serving now, each in words (who, where, why)."""
        ...

    def watch(self, changed: Callable[[], None]) -> None: ...

    def update_inventory(self, link: ExpertHost, inventory: shoal_pb2.Inventory) -> None: ...

    def report_failure(self, link: ExpertHost, detail: str) -> None: ...


@dataclass(frozen=True)
class Snapshot:
    """The members at one moment: `links` in a fixed order (replies are read in it), what
    each holds, every copy of each expert per layer (primary first), and, when some expert
    has no live holder, why (`missing`: the routes are then those of nothing): the experts
    none holds (`unheld`) and the members not serving (`absent`)."""

    links: tuple[ExpertHost, ...]
    holdings: tuple[frozenset[ExpertKey], ...]
    routes: dict[int, LayerRoutes]
    version: int
    unheld: str = ""
    absent: tuple[str, ...] = ()

    @property
    def missing(self) -> str:
        return self.without("")

    def without(self, address: str) -> str:
        """`missing`, less what it says of the worker at `address` (said already)."""
        named = re.compile(rf"{re.escape(address)}(?!\d)") if address else None
        absent = [a for a in self.absent if named is None or not named.search(a)]
        return f"{self.unheld}; not serving: {'; '.join(absent)}" if absent else self.unheld


def snapshot_of(members: Members, layers: dict[int, int]) -> Snapshot:
    """The members' live hosts now, with their routing table (pure over what `live` says)."""
    version, links, holdings = members.live()
    try:
        routes = replica_routes(layers, holdings)
    except Unavailable as e:
        return Snapshot(tuple(links), tuple(holdings), {}, version, str(e),
                        tuple(members.absent()))
    return Snapshot(tuple(links), tuple(holdings), routes, version)


class Cluster:
    """Follows its members: `current` is the snapshot of their last change."""

    def __init__(self, members: Members, layers: dict[int, int], current: Snapshot) -> None:
        self.members = members
        self.layers = layers  # layer -> number of experts
        self.current = current
        self.reloads = 0  # inventories fetched again because a worker's changed
        self._lock = threading.Lock()
        members.watch(self._follow)
        self._follow()  # a change between `current` and the watch above is not missed

    @classmethod
    def following(cls, members: Members, layers: dict[int, int]) -> Cluster:
        """The cluster of the members' live workers now, whether or not they hold every
        expert yet: a call made meanwhile raises Unavailable naming those none holds."""
        return cls(members, layers, snapshot_of(members, layers))

    @classmethod
    def of(cls, members: Members, layers: dict[int, int]) -> Cluster:
        """The cluster of the members' live workers now; raises Unavailable naming the
        experts none of them holds."""
        current = snapshot_of(members, layers)
        if current.missing:
            raise Unavailable(current.missing)
        return cls(members, layers, current)

    def _follow(self) -> None:
        # made outside the lock: `live` takes the members' own, which their thread may hold
        current = snapshot_of(self.members, self.layers)
        with self._lock:
            if current.version > self.current.version:  # versions only grow
                self.current = current

    # what the commands and tests read of the snapshot now
    @property
    def links(self) -> list[ExpertHost]:
        return list(self.current.links)

    @property
    def holdings(self) -> list[frozenset[ExpertKey]]:
        return list(self.current.holdings)

    @property
    def routes(self) -> dict[int, LayerRoutes]:
        return self.current.routes

    @property
    def version(self) -> int:
        return self.current.version

    def reload(self, index: int) -> None:
        """Worker `index` says its inventory changed (experts received, drained or deleted):
        fetch it again and route by it. Raises Unavailable if an expert is left unowned."""
        link = self.current.links[index]
        self.reloads += 1
        try:
            inventory = link.fetch_inventory()
        except ShoalError as e:
            self.lost(index, e)
            return
        self.members.update_inventory(link, inventory)
        if self.current.missing:
            # It gave up an expert that moved (shoal rebalance): the new holder took it in
            # before this worker let it go, but its inventory here may be older than that.
            self._fetch_others(link)
            if self.current.missing:
                raise Unavailable(self.current.missing)

    def _fetch_others(self, link: ExpertHost) -> None:
        """Fetch every other worker's inventory again (hosts.fresh_inventories)."""
        others = (o for o in self.current.links if o is not link)
        for other, inventory in fresh_inventories(others).items():
            self.reloads += 1
            self.members.update_inventory(other, inventory)

    def lost(self, index: int, error: ShoalError) -> None:
        """Worker `index` failed during a call: route around it if every expert still has a
        live owner (the caller then retries), else raise Unavailable naming those that do not."""
        link = self.current.links[index]
        self.members.report_failure(link, reason_of(error, link.address))
        if self.current.missing:  # the error says why this one is not serving: once
            raise Unavailable(f"{error}; {self.current.without(link.address)}")


# Seconds a listed worker may still answer its handshake once the others hold every expert.
LATE_GRACE = 1.0


class FixedMembers:
    """The workers at the addresses --workers lists. Each keeps its place in the links for
    good; one that fails holds nothing from then on, and one whose inventory changed holds
    what it now lists."""

    def __init__(self, addresses: list[str], secret: Secret,
                 transport: Transport = LANE) -> None:
        self.links = [transport.link(address, secret) for address in addresses]
        self._holdings: list[frozenset[ExpertKey]] = [frozenset()] * len(self.links)
        self.version = 0
        self._watchers: list[Callable[[], None]] = []
        self._failed: dict[int, str] = {}  # by link: why it was taken out

    def watch(self, changed: Callable[[], None]) -> None:
        self._watchers.append(changed)

    def absent(self) -> list[str]:
        return [f"worker {self.links[i].address}: {detail}"
                for i, detail in sorted(self._failed.items())]

    def _changed(self) -> None:
        self.version += 1
        for changed in self._watchers:
            changed()

    def join(self, manifest: Manifest, log: Callable[[str], None] | None = None,
             local: LocalExperts | None = None) -> Cluster:
        """Ask every worker what it holds (all at once), refuse mismatches, and build the
        routing table, with the coordinator's own experts (`local`) as the first member. A
        listed worker that does not answer is left out when the others hold every expert
        (said through `log`; it is routed around for good, as one lost later), else the run
        fails naming it. Closes the links if the join fails."""
        try:
            answers = self._ask_all(manifest, local)
            silent = []
            for i, answer in enumerate(answers):
                if isinstance(answer, Unavailable):
                    silent.append(answer)
                    continue
                if isinstance(answer, ShoalError):
                    raise answer
                inventory, problem = answer
                if problem:
                    raise ShoalError(problem)
                self._holdings[i] = held(inventory)
            self.version += 1
            try:
                cluster = Cluster.of(with_local(self, local), layer_sizes(manifest))
            except Unavailable as e:
                raise (Unavailable(f"{silent[0]}; without it, {e}") if silent else e) from None
            for error in silent:
                if log is not None:
                    log(f"{error}; going on without it: the others hold all of its experts")
            return cluster
        except BaseException:
            self.close()
            raise

    def _ask_all(self, manifest: Manifest, local: LocalExperts | None) -> list:
        """Every worker's handshake, asked at once: once those that answered hold every
        expert, the others get LATE_GRACE seconds more, then count as silent (a stopped
        worker would otherwise hold the start for CONNECT_TIMEOUT). Each is asked on a daemon
        thread of its own, so that one still waiting never holds the process's exit."""
        answers: list = [None] * len(self.links)
        arrived: queue.Queue = queue.Queue()
        for i, link in enumerate(self.links):
            threading.Thread(target=lambda i=i, link=link: arrived.put((i, _ask(link, manifest))),
                             name=f"handshake {link.address}", daemon=True).start()
        covered_at = None
        for _ in self.links:
            left = None if covered_at is None else covered_at + LATE_GRACE - time.monotonic()
            try:
                i, answer = arrived.get(timeout=left if left is None else max(left, 0.0))
            except queue.Empty:
                break
            answers[i] = answer
            if isinstance(answer, tuple) and not answer[1]:
                self._holdings[i] = held(answer[0])
            if covered_at is None and self._covers(manifest, local):
                covered_at = time.monotonic()
        for i, answer in enumerate(answers):
            if answer is None:
                answers[i] = Unavailable(
                    f"worker {self.links[i].address} did not answer its handshake within "
                    f"{LATE_GRACE:g} s of the others")
        return answers

    def _covers(self, manifest: Manifest, local: LocalExperts | None) -> bool:
        return not snapshot_of(with_local(self, local), layer_sizes(manifest)).missing

    def live(self) -> tuple[int, list[WorkerLink], list[frozenset[ExpertKey]]]:
        return self.version, list(self.links), list(self._holdings)

    def update_inventory(self, link: WorkerLink, inventory: shoal_pb2.Inventory) -> None:
        self._holdings[self.links.index(link)] = held(inventory)
        self._failed.pop(self.links.index(link), None)
        self._changed()

    def report_failure(self, link: WorkerLink, detail: str) -> None:
        self._holdings[self.links.index(link)] = frozenset()
        self._failed[self.links.index(link)] = detail
        self._changed()

    def close(self) -> None:
        for link in self.links:
            link.close()


def _ask(link: WorkerLink,
         manifest: Manifest) -> tuple[shoal_pb2.Inventory, str | None] | ShoalError:
    """One worker's handshake, or the ShoalError that says why there is none."""
    try:
        return handshake(link, manifest, CONNECT_TIMEOUT)
    except ShoalError as e:
        return e


def parse_addresses(text: str) -> list[str]:
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    if not addresses:
        raise InvalidInput("--workers needs at least one HOST:PORT")
    for address in addresses:
        parse_endpoint(address, "--workers")
    return addresses


def layer_sizes(manifest: Manifest) -> dict[int, int]:
    return {layer.layer: layer.num_experts for layer in manifest.layers}


def with_local(members: Members | None, local: LocalExperts | None) -> Members:
    """The members, with the coordinator's own experts as the first when it holds some."""
    if local is None:
        assert members is not None
        return members
    return WithLocal(local, members)
