"""Membership: which workers of the cluster are up, what they hold, and the path to each; a
thin threaded shell over member.py's pure transitions that checks health every CHECK_INTERVAL
and verifies each worker with an authenticated handshake."""
# Bonjour is never the liveness signal: a crashed worker stays in mDNS caches for a long time.

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from coordinator.cluster.discovery import Browser, Candidate
from coordinator.cluster.member import (
    Member,
    after_check,
    duplicate_ids,
    in_words,
    inventory_stale,
    member_for,
    needs_handshake,
    stale_twins,
)
from coordinator.cluster.snapshot import Cluster, layer_sizes, with_local
from coordinator.dataplane.hosts import fresh_inventories
from coordinator.dataplane.link import LANE, Transport, WorkerLink, handshake
from coordinator.dataplane.link_errors import Unreachable, dead_worker, held, reason_of
from engine.advert import DEFAULT_CLUSTER
from engine.errors import Unauthenticated, Unavailable
from engine.interfaces import Interface, local_interfaces, select_interface
from engine.manifest import ExpertKey, Manifest

if TYPE_CHECKING:
    from coordinator.dataplane.local_experts import LocalExperts

CHECK_INTERVAL = 0.5  # seconds between health checks of one worker
CHECK_TIMEOUT = 1.0
HANDSHAKE_TIMEOUT = 5.0
SEEN_SHOWN = 3  # workers of another cluster named in an error, per cluster


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
        listed: Sequence[str] = (),
    ) -> None:
        self.cluster = cluster
        self.listed = tuple(listed)  # the addresses the user gave (--workers), if any
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
            except Unreachable as e:
                rtt, failure = None, e.reason
            except Unavailable as e:
                rtt, failure = None, reason_of(e, link.address)
            now = time.monotonic()
            with self._changed:
                if stop.is_set():
                    return
                before = self._members[key]
                member = after_check(before, now, rtt=rtt, failure=failure)
                self._set_locked(member)
            if member.state == "unreachable" and before.state != "unreachable":
                self._say(dead_worker(member.node_id, member.address, failure or ""))
            if failure is None and (needs_handshake(member, now) or inventory_stale(member, now)):
                self._handshake(key, link, stop)
            stop.wait(CHECK_INTERVAL)

    def _handshake(self, key: str, link: WorkerLink, stop: threading.Event) -> None:
        changes: dict = {"handshake_at": time.monotonic()}
        try:
            inventory, problem = handshake(link, self.manifest, HANDSHAKE_TIMEOUT)
        except Unauthenticated as e:
            changes.update(state="unauthenticated", detail=str(e))
        except Unreachable as e:
            changes.update(detail=e.reason)  # the next health check decides
        except Unavailable as e:
            changes.update(detail=reason_of(e, link.address))  # the next check decides
        else:
            changes.update(
                node_id=inventory.node_id,
                state="incompatible" if problem else "healthy",
                detail=problem or "",
                experts=frozenset() if problem else held(inventory),
                memory_budget=inventory.memory_budget,
                free_disk=inventory.free_disk,
            )
        gave_up = self._members[key].experts - changes.get("experts", frozenset())
        # An expert that moved (shoal rebalance) was taken in by its new holder before this
        # worker let it go, but the new holder's inventory here may be older than that: ask
        # the others again first, so that the view never shows the expert without a holder.
        others = self._fetch_others(key) if gave_up and "experts" in changes else {}
        with self._changed:
            if stop.is_set():
                return
            for other, experts in others.items():
                if self._members[other].state == "healthy":
                    self._set_locked(replace(self._members[other], experts=experts,
                                             handshake_at=time.monotonic()))
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
                self._say(in_words(member))

    def _fetch_others(self, key: str) -> dict[str, frozenset[ExpertKey]]:
        """What every other healthy worker holds, asked now (hosts.fresh_inventories)."""
        with self._changed:
            others = {k: self._links[k] for k, m in self._members.items()
                      if k != key and m.state == "healthy" and k in self._links}
        answered = fresh_inventories(others.values())
        return {k: held(answered[link]) for k, link in others.items() if link in answered}

    def update_inventory(self, link: WorkerLink, inventory) -> None:
        """A worker's inventory changed (seen in a reply): route by the new one now."""
        with self._changed:
            for key, known in self._links.items():
                if known is link and self._members[key].state == "healthy":
                    self._set_locked(replace(self._members[key], experts=held(inventory),
                                             handshake_at=time.monotonic()))

    def report_failure(self, link: WorkerLink, detail: str) -> None:
        """A call on `link` failed: take its worker out now rather than at the next check.
        `detail` is the failure's reason_of."""
        with self._changed:
            for key, known in self._links.items():
                if known is link and self._members[key].state != "unreachable":
                    self._set_locked(replace(self._members[key], state="unreachable",
                                             detail=detail,
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
        """Workers found but not healthy, each with its node id, address, state and why (or,
        when none is found at all, that)."""
        with self._changed:
            if not self._members:
                return [f"no worker of cluster {self.cluster!r} found yet"]
            return [in_words(m) for m in sorted(self._members.values(),
                                                key=lambda m: (m.node_id, m.key))
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

    @property
    def workers(self) -> str:
        """The workers this membership looks for, as the user named them."""
        if self.listed:
            return f"the workers at {', '.join(self.listed)}"
        return f"the workers of cluster {self.cluster!r}"

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
                    raise Unavailable(f"waited {wait:g} s for {self.workers}: {missing}"
                                      f"{self._seen_locked()}. {self._hint()}")
                if on_wait and said != healthy:  # said once, then only as workers come
                    on_wait(f"waiting up to {remaining:.0f} s for {self.workers} ({healthy} "
                            f"healthy; {missing})" if said is None
                            else f"{healthy} of {self.workers} healthy; not every expert "
                            "held yet")
                    said = healthy
                self._changed.wait(min(remaining, 1.0))

    def _hint(self) -> str:
        if self.listed:
            return (f"Is shoal-worker running at each of those addresses? `shoal doctor "
                    f"--workers {','.join(self.listed)}` checks each")
        return (f"Is `shoal-worker --cluster {self.cluster}` running on every machine, and can "
                "multicast reach this one? `shoal workers` shows what is found (see "
                "docs/operations.md)")

    def _seen_locked(self) -> str:
        """The healthy workers found (those that are not, `absent` names already), and those
        of other clusters, in words; "" when there are none."""
        parts = [f"found {m.node_id} at {m.address} healthy, {m.experts_held} experts"
                 for m in sorted(self._members.values(), key=lambda m: (m.node_id, m.key))
                 if m.state == "healthy"]
        by_cluster: dict[str, list[str]] = {}
        for cluster, worker in sorted(self._browser.elsewhere.values() if self._browser else ()):
            by_cluster.setdefault(cluster, []).append(worker)
        if by_cluster:
            parts.append("seen in other clusters: " + "; ".join(
                f"{cluster!r}: {', '.join(workers[:SEEN_SHOWN])}"
                + (f" and {len(workers) - SEEN_SHOWN} more" if len(workers) > SEEN_SHOWN else "")
                for cluster, workers in by_cluster.items()))
        return "".join(f"; {part}" for part in parts)

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
