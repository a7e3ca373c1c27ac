"""A worker as the membership sees it: the frozen `Member` and its pure transitions (a
health check folded in, when to shake hands again), and how a member that is not healthy is
said (`in_words`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from coordinator.cluster.discovery import Candidate
from coordinator.dataplane.link_errors import dead_worker, incompatibility
from engine.advert import Advert
from engine.interfaces import Interface, Route, choose_route
from engine.manifest import ExpertKey, Manifest

DEAD_AFTER = 2.0  # no good health check for this long: unreachable
RETRY_AFTER = 5.0  # a refused handshake (other secret, other model) is tried again this often
# A healthy worker's inventory is fetched again this often, so experts it received (shoal
# rebalance) are used even by a coordinator that sends it nothing; a worker that is sent work
# says so in every reply (Cluster.reload).
INVENTORY_REFRESH = 5.0
# unreachable: no answer to health checks for DEAD_AFTER; incompatible: another protocol or
# model; unauthenticated: another cluster's secret
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


def in_words(member: Member) -> str:
    """A worker that is not healthy, and why, as every surface says it."""
    if member.state == "unreachable":
        return dead_worker(member.node_id, member.address, member.detail or "no answer")
    name = member.node_id or member.key
    named = member.address if name == member.address else f"{name} at {member.address}"
    return f"worker {named} is {member.state}" + (f" ({member.detail})" if member.detail else "")


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
