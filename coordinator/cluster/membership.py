"""Membership: which workers of the cluster are up, what they hold, and the path to each;
pure transitions over frozen `Member`s, fed by a thin threaded shell (`Membership`) that
checks health every CHECK_INTERVAL and verifies each worker with an authenticated handshake."""
# Bonjour is never the liveness signal: a crashed worker stays in mDNS caches for a long time.
# States: connecting, healthy, unreachable, incompatible (other protocol or model),
# unauthenticated (other secret).

from __future__ import annotations

import math
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from coordinator.cluster.discovery import Browser, Candidate
from coordinator.cluster.snapshot import Cluster, layer_sizes, with_local
from coordinator.dataplane.link import LANE, Transport, WorkerLink, handshake
from coordinator.dataplane.link_errors import held, incompatibility, reason_of
from engine.advert import DEFAULT_CLUSTER, Advert
from engine.errors import Unauthenticated, Unavailable
from engine.interfaces import Interface, Route, choose_route, local_interfaces, select_interface
from engine.manifest import ExpertKey, Manifest

if TYPE_CHECKING:
    from coordinator.dataplane.local_experts import LocalExperts

CHECK_INTERVAL = 0.5  # seconds between health checks of one worker
CHECK_TIMEOUT = 1.0
DEAD_AFTER = 2.0  # no good health check for this long: unreachable
HANDSHAKE_TIMEOUT = 5.0
RETRY_AFTER = 5.0  # a refused handshake (other secret, other model) is tried again this often
# A healthy worker's inventory is fetched again this often, so experts it received (shoal
# rebalance) are used even by a coordinator that sends it nothing; a worker that is sent work
# says so in every reply (Cluster.reload).
INVENTORY_REFRESH = 5.0
SEEN_SHOWN = 3  # workers of another cluster named in an error, per cluster
STATES = ("connecting", "healthy", "unreachable", "incompatible", "unauthenticated")


@dataclass(frozen=True)
class Member:
    key: str  # Bonjour instance name or configured address
    node_id: str
    address: str  # HOST:PORT in use
    route: Route
    state: str  # one of STATES
    detail: str = ""  # why it is not healthy, for the user
    experts: frozenset[ExpertKey] = frozenset()  # from the handshake
    advert: Advert | None = None
    memory_budget: int = 0
    free_disk: int = 0
    rtt_ms: float | None = None  # smoothed health-check round trip
    last_ok: float = 0.0  # monotonic time of the last good check (first: when it appeared)
    handshake_at: float = -math.inf

    @property
    def experts_held(self) -> int:
        if self.experts or self.advert is None:
            return len(self.experts)
        return self.advert.experts


def member_for(
    candidate: Candidate,
    local: Sequence[Interface],
    *,
    prefer: str | None,
    manifest: Manifest | None,
    now: float,
) -> Member:
    """A worker just announced or configured: its path (--interface `prefer` first, then the
    interface its cluster config names, then the ranking), and whether its advert already
    shows it cannot serve this model (then it is never connected to)."""
    route = choose_route([host for host, _ in candidate.endpoints], local,
                         prefer or candidate.interface)
    port = next(p for host, p in candidate.endpoints if host == route.address)
    address = f"{route.address}:{port}"
    advert = candidate.advert
    problem = advert and incompatibility(address, advert.protocol, advert.model, manifest)
    return Member(
        key=candidate.key,
        node_id=advert.node_id if advert else (candidate.node_id or address),
        address=address,
        route=route,
        state="incompatible" if problem else "connecting",
        detail=problem or "",
        advert=advert,
        memory_budget=advert.memory_budget if advert else 0,
        free_disk=advert.free_disk if advert else 0,
        last_ok=now,
    )


def after_check(
    member: Member, now: float, *, rtt: float | None = None, failure: str | None = None
) -> Member:
    """Fold one health check into a member. A good check after an outage starts a new
    handshake; failures mark it unreachable once no check has succeeded for DEAD_AFTER."""
    if failure is None:
        rtt_ms = 1e3 * (rtt or 0.0)
        smoothed = rtt_ms if member.rtt_ms is None else 0.7 * member.rtt_ms + 0.3 * rtt_ms
        if member.state == "unreachable":
            return replace(member, state="connecting", detail="", last_ok=now, rtt_ms=smoothed)
        return replace(member, last_ok=now, rtt_ms=smoothed)
    if member.state != "unreachable" and now - member.last_ok >= DEAD_AFTER:
        return replace(member, state="unreachable", detail=failure, rtt_ms=None)
    return member


def needs_handshake(member: Member, now: float) -> bool:
    if member.state == "connecting":
        return True
    refused = member.state in ("unauthenticated", "incompatible")
    return refused and now - member.handshake_at >= RETRY_AFTER


def inventory_stale(member: Member, now: float) -> bool:
    return member.state == "healthy" and now - member.handshake_at >= INVENTORY_REFRESH


def stale_twins(members: Iterable[Member], newcomer: Member) -> list[str]:
    """Keys of unreachable members with the newcomer's node id: the same worker restarted on
    another port (its old advert outlived it when it died without a goodbye)."""
    return [m.key for m in members if m.key != newcomer.key and m.state == "unreachable"
            and m.node_id == newcomer.node_id]


def duplicate_ids(members: Iterable[Member]) -> dict[str, list[str]]:
    """Node ids claimed by more than one live worker -> their addresses. (A stale entry of a
    worker that restarted elsewhere is unreachable, and does not count.)"""
    by_id: dict[str, list[str]] = {}
    for member in members:
        if member.state != "unreachable":
            by_id.setdefault(member.node_id, []).append(member.address)
    return {node_id: sorted(a) for node_id, a in by_id.items() if len(a) > 1}


class Membership:
    """The live view of one cluster's workers; thread-safe. `version` changes whenever the set
    of healthy workers (or what they hold) changes, which is what a Cluster follows."""

    def __init__(
        self,
        secret: bytes,
        *,
        cluster: str = DEFAULT_CLUSTER,
        manifest: Manifest | None = None,
        interface: str | None = None,
        local: Sequence[Interface] | None = None,
        log: Callable[[str], None] | None = None,
        transport: Transport = LANE,
    ) -> None:
        self.cluster = cluster
        self.transport = transport
        self.manifest = manifest
        self._secret = secret
        self._local = list(local_interfaces() if local is None else local)
        self._bind = select_interface(interface, self._local) if interface else None
        self._prefer = self._bind[0].name if self._bind else None
        self._log = log
        self._members: dict[str, Member] = {}
        self._links: dict[str, WorkerLink] = {}
        self._stops: dict[str, threading.Event] = {}
        self._changed = threading.Condition()
        self._healthy: tuple = ()
        self._browser: Browser | None = None
        self._closed = False
        self.version = 0
        self._watchers: list[Callable[[], None]] = []

    # sources -------------------------------------------------------------------------

    def browse(self) -> None:
        """Find workers of this cluster with Bonjour (on --interface only, if given)."""
        interfaces = [i.address for i in self._bind] if self._bind else None
        self._browser = Browser(self.cluster, self.offer, self.withdraw, interfaces=interfaces)

    def add_static(self, candidates: Iterable[Candidate]) -> None:
        """Workers from a cluster config; host names are resolved here, once."""
        for candidate in candidates:
            endpoints = []
            for host, port in candidate.endpoints:
                endpoints += [(ip, port) for ip in _resolve(host)] or [(host, port)]
            self.offer(replace(candidate, endpoints=tuple(dict.fromkeys(endpoints))))

    def offer(self, candidate: Candidate) -> None:
        """A worker appeared or changed its announcement."""
        with self._changed:
            if self._closed:
                return
            member = member_for(candidate, self._local, prefer=self._prefer,
                                manifest=self.manifest, now=time.monotonic())
            old = self._members.get(candidate.key)
            if old and (old.address, old.advert) == (member.address, member.advert):
                return  # a repeated announcement
            self._forget_locked(candidate.key)
            for key in stale_twins(self._members.values(), member):
                self._forget_locked(key)
                del self._members[key]
            self._set_locked(member)
            if member.state == "incompatible":
                self._say(f"ignoring worker {member.node_id}: {member.detail}")
                return
            link = self.transport.link(member.address, self._secret)
            stop = threading.Event()
            self._links[member.key], self._stops[member.key] = link, stop
            threading.Thread(target=self._probe, args=(member.key, link, stop),
                             name=f"probe {member.address}", daemon=True).start()

    def withdraw(self, key: str) -> None:
        """A worker said goodbye on Bonjour (it stopped cleanly)."""
        with self._changed:
            member = self._members.get(key)
            self._forget_locked(key)
            self._members.pop(key, None)
            self._set_locked(None)
        if member is not None and member.state == "healthy":
            self._say(f"worker {member.node_id} left")

    # liveness ------------------------------------------------------------------------

    def _probe(self, key: str, link: WorkerLink, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                rtt, failure = link.check_health(CHECK_TIMEOUT), None
            except Unauthenticated as e:  # the TLS handshake failed: another cluster
                with self._changed:
                    before = self._members[key]
                    if before.state != "unauthenticated":
                        self._set_locked(replace(before, state="unauthenticated",
                                                 detail=str(e)))
                if before.state != "unauthenticated":
                    self._say(f"worker {before.node_id or key} is unauthenticated: {e}")
                stop.wait(CHECK_INTERVAL)
                continue
            except Unavailable as e:
                rtt, failure = None, reason_of(str(e), link.address)
            now = time.monotonic()
            with self._changed:
                if stop.is_set():
                    return
                before = self._members[key]
                member = after_check(before, now, rtt=rtt, failure=failure)
                self._set_locked(member)
            if member.state == "unreachable" and before.state != "unreachable":
                self._say(f"worker {member.node_id} is unreachable: {failure}")
            if failure is None and (needs_handshake(member, now) or inventory_stale(member, now)):
                self._handshake(key, link, stop)
            stop.wait(CHECK_INTERVAL)

    def _handshake(self, key: str, link: WorkerLink, stop: threading.Event) -> None:
        changes: dict = {"handshake_at": time.monotonic()}
        try:
            inventory, problem = handshake(link, self.manifest, HANDSHAKE_TIMEOUT)
        except Unauthenticated as e:
            changes.update(state="unauthenticated", detail=str(e))
        except Unavailable as e:
            changes.update(detail=reason_of(str(e), link.address))  # the next check decides
        else:
            changes.update(
                node_id=inventory.node_id,
                state="incompatible" if problem else "healthy",
                detail=problem or "",
                experts=frozenset() if problem else held(inventory),
                memory_budget=inventory.memory_budget,
                free_disk=inventory.free_disk,
            )
        with self._changed:
            if stop.is_set():
                return
            before = self._members[key]
            changes["node_id"] = changes.get("node_id") or before.node_id
            member = replace(before, **changes)
            self._set_locked(member)
            duplicated = duplicate_ids(self._members.values()).get(member.node_id)
        if duplicated and member.state == "healthy" and before.state != "healthy":
            self._say(f"warning: node id {member.node_id} is used by several workers "
                      f"({', '.join(duplicated)}): give each its own --node-id")
        if member.state != before.state and member.state != "connecting":
            if member.state == "healthy":
                self._say(f"worker {member.node_id} at {member.address} via "
                          f"{member.route.describe()}: {member.experts_held} experts")
            else:
                self._say(f"worker {member.node_id} is {member.state}: {member.detail}")

    def update_inventory(self, link: WorkerLink, inventory) -> None:
        """A worker's inventory changed (seen in a reply): route by the new one now."""
        with self._changed:
            for key, known in self._links.items():
                if known is link and self._members[key].state == "healthy":
                    self._set_locked(replace(self._members[key], experts=held(inventory),
                                             handshake_at=time.monotonic()))

    def report_failure(self, link: WorkerLink, detail: str) -> None:
        """A call on `link` failed: take its worker out now rather than at the next check."""
        with self._changed:
            for key, known in self._links.items():
                if known is link and self._members[key].state != "unreachable":
                    self._set_locked(replace(self._members[key], state="unreachable",
                                             detail=reason_of(detail, link.address),
                                             rtt_ms=None))

    # state ---------------------------------------------------------------------------

    def _set_locked(self, member: Member | None) -> None:
        if member is not None:
            self._members[member.key] = member
        # A worker gets a new link only as a new member, which starts out "connecting": so a
        # changed link always passes through a version without it.
        healthy = tuple(
            (m.key, m.address, m.experts) for m in self._members.values() if m.state == "healthy"
        )
        if healthy != self._healthy:
            self._healthy = healthy
            self.version += 1
            for changed in self._watchers:
                changed()
        self._changed.notify_all()

    def _forget_locked(self, key: str) -> None:
        stop, link = self._stops.pop(key, None), self._links.pop(key, None)
        if stop is not None:
            stop.set()
        if link is not None:
            link.close()

    def absent(self) -> list[str]:
        """Workers found but not healthy, each with its node id, address, state and why."""
        with self._changed:
            return [f"worker {m.node_id or m.key} at {m.address} is {m.state}"
                    + (f" ({m.detail})" if m.detail else "")
                    for m in sorted(self._members.values(), key=lambda m: (m.node_id, m.key))
                    if m.state != "healthy"]

    def watch(self, changed: Callable[[], None]) -> None:
        """Call `changed` after every change of the healthy workers (under this one's lock)."""
        with self._changed:
            self._watchers.append(changed)

    def snapshot(self) -> list[Member]:
        with self._changed:
            return sorted(self._members.values(), key=lambda m: (m.node_id, m.key))

    def live(self) -> tuple[int, list[WorkerLink], list[frozenset[ExpertKey]]]:
        """(version, links, holdings) of the healthy workers, in a fixed order."""
        with self._changed:
            healthy = sorted((m for m in self._members.values() if m.state == "healthy"),
                             key=lambda m: (m.node_id, m.key))
            return self.version, [self._links[m.key] for m in healthy], [
                m.experts for m in healthy
            ]

    def settle(self, timeout: float, *, at_least: float = 0.0) -> list[Member]:
        """Wait (bounded) until every worker found so far has answered or timed out; with
        Bonjour, browse for `at_least` seconds first. For `shoal workers`."""
        started = time.monotonic()
        deadline = started + timeout
        with self._changed:
            while (now := time.monotonic()) < deadline:
                pending = any(m.state == "connecting" for m in self._members.values()) or (
                    self._browser is not None and self._browser.resolving())
                if not pending and now - started >= at_least:
                    break
                self._changed.wait(min(deadline - now, 0.2))
        return self.snapshot()

    def join(
        self, manifest: Manifest, *, wait: float, on_wait: Callable[[str], None] | None = None,
        local: LocalExperts | None = None,
    ) -> Cluster:
        """A Cluster that follows this membership (and the coordinator's own experts, `local`,
        as its first member), once every expert has a live owner. Waits at most `wait`
        seconds, then raises Unavailable naming the experts missing."""
        layers = layer_sizes(manifest)
        members = with_local(self, local)
        deadline = time.monotonic() + wait
        said = None
        with self._changed:
            while True:
                try:
                    return Cluster.of(members, layers)
                except Unavailable as e:
                    missing = str(e)
                healthy = sum(m.state == "healthy" for m in self._members.values())
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Unavailable(
                        f"waited {wait:.0f} s for the workers of cluster {self.cluster!r}: "
                        f"{missing}; {self._seen_locked()}. Is `shoal-worker --cluster "
                        f"{self.cluster}` running on every machine, and can multicast reach "
                        "this one? `shoal workers` shows what is found (see "
                        "docs/operations.md)"
                    )
                if on_wait and said != healthy:  # said once, then only as workers come
                    on_wait(f"waiting up to {remaining:.0f} s for workers of cluster "
                            f"{self.cluster!r} ({healthy} healthy; {missing})" if said is None
                            else f"{healthy} worker{'s' * (healthy != 1)} of cluster "
                            f"{self.cluster!r} healthy; not every expert held yet")
                    said = healthy
                self._changed.wait(min(remaining, 1.0))

    def _seen_locked(self) -> str:
        """Every worker found, healthy or not, and those of other clusters, in words."""
        found = [f"{m.node_id} at {m.address} {m.state}"
                 + (f" ({m.detail})" if m.detail else f", {m.experts_held} experts")
                 for m in sorted(self._members.values(), key=lambda m: (m.node_id, m.key))]
        text = f"found {'; '.join(found)}" if found else "found no worker of this cluster"
        by_cluster: dict[str, list[str]] = {}
        for cluster, worker in sorted(self._browser.elsewhere.values() if self._browser else ()):
            by_cluster.setdefault(cluster, []).append(worker)
        if by_cluster:
            text += "; seen in other clusters: " + "; ".join(
                f"{cluster!r}: {', '.join(workers[:SEEN_SHOWN])}"
                + (f" and {len(workers) - SEEN_SHOWN} more" if len(workers) > SEEN_SHOWN else "")
                for cluster, workers in by_cluster.items())
        return text

    def _say(self, message: str) -> None:
        if self._log is not None:
            self._log(message)

    def close(self) -> None:
        with self._changed:
            self._closed = True
        if self._browser is not None:
            self._browser.close()
        with self._changed:
            for key in list(self._links):
                self._forget_locked(key)


def _resolve(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def stderr_log(message: str) -> None:
    print(f"shoal: {message}", file=sys.stderr, flush=True)
