"""The cluster's one path over its members, and how failed calls on a link read, without a
network: WorkerLinks open their channels lazily, and gRPC errors are stood in for."""

import grpc
import pytest

from coordinator.cluster.snapshot import Cluster, FixedMembers
from coordinator.dataplane.link_errors import (
    CALL,
    HEALTH,
    INVENTORY,
    REFUSED,
    STREAM,
    Unreachable,
    dead_worker,
    error_for,
    reason_of,
    unreachable_reason,
)
from engine.auth import load_secret
from engine.errors import InvalidInput, Moved, Unauthenticated, Unavailable
from proto import shoal_pb2


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_failed_listed_worker_keeps_its_place_and_is_routed_around(secret_file):
    members = FixedMembers(["127.0.0.1:1", "127.0.0.1:2"], load_secret(secret_file))
    try:
        both = shoal_pb2.Inventory(experts=[shoal_pb2.HeldExpert(layer=0, expert=e)
                                            for e in range(2)])
        for link in members.links:
            members.update_inventory(link, both)
        cluster = Cluster.of(members, {0: 2})
        routes = cluster.routes
        members.watch(lambda: None)  # a watcher more changes nothing: the same table
        assert cluster.routes is routes
        cluster.lost(1, Unavailable("worker b failed"))
        assert cluster.links == members.links  # indices stay: replies are read in their order
        assert cluster.holdings == [frozenset({(0, 0), (0, 1)}), frozenset()]
        with pytest.raises(Unavailable, match="its lane; no live worker holds") as lost:
            cluster.lost(0, Unavailable("worker 127.0.0.1:1 failed: it closed its lane"))
        # its own reason once, the other worker's after it
        assert str(lost.value).count("127.0.0.1:1") == 1, lost.value
        assert str(lost.value).endswith("not serving: worker 127.0.0.1:2: worker b failed")
        # what a later call (or `shoal serve`'s 503) says names the workers taken out
        # (each named once, by the address the failure's lead named: reason_of)
        assert "not serving: worker 127.0.0.1:1: it closed its lane; worker 127.0.0.1:2: " \
               "worker b failed" in cluster.current.missing
    finally:
        members.close()


def test_a_failed_call_reads_as_the_workers_refusal_or_names_what_did_not_get_through():
    refused = error_for(_Failed(grpc.StatusCode.INVALID_ARGUMENT, "bad layer"), "h:1", CALL)
    assert isinstance(refused, InvalidInput) and str(refused) == "worker h:1: bad layer"
    moved = error_for(_Failed(grpc.StatusCode.ABORTED, "expert moved"), "h:1", STREAM)
    assert isinstance(moved, Moved) and str(moved) == "worker h:1: expert moved"
    # on the Compute stream any other failure loses the worker for this call
    lost = error_for(_Failed(grpc.StatusCode.INVALID_ARGUMENT, "bad layer"), "h:1", STREAM)
    assert isinstance(lost, Unavailable)
    assert str(lost) == "worker h:1 failed: INVALID_ARGUMENT: bad layer"
    clock = error_for(_Failed(grpc.StatusCode.UNAUTHENTICATED, "stale"), "h:1", INVENTORY)
    assert isinstance(clock, Unauthenticated)
    assert str(clock) == "worker h:1: UNAUTHENTICATED: stale"
    tls = error_for(_Failed(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; "
                            "last error: UNKNOWN: ipv4:h:1: Tls handshake failed "
                            "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: BAD_SIGNATURE: certificate "
                            "signature failure"), "h:1", INVENTORY)
    assert isinstance(tls, Unauthenticated) and "TLS identity" in str(tls)
    # a handshake cut on the way says nothing about identity: the worker is unreachable
    cut = error_for(_Failed(grpc.StatusCode.UNAVAILABLE, "Tls handshake failed "
                            "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SYSCALL: Socket closed"), "h:1",
                    INVENTORY)
    assert type(cut) is Unavailable and "TLS identity" not in str(cut)


def test_a_worker_nothing_answers_for_is_said_in_plain_words_never_grpcs():
    refused = error_for(_Failed(grpc.StatusCode.UNAVAILABLE, "failed to connect to all "
                                "addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to "
                                "connect to remote host: Connection refused"), "127.0.0.1:1",
                        HEALTH, 1.0)
    assert isinstance(refused, Unreachable) and refused.reason == REFUSED
    assert str(refused) == f"worker 127.0.0.1:1 is unreachable: {REFUSED}"
    assert reason_of(refused) == REFUSED and reason_of(Unavailable("busy")) == "busy"
    silent = error_for(_Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), "h:1",
                       HEALTH, 1.0)
    assert str(silent) == ("worker h:1 is unreachable: no answer within 1 s: the host is off, "
                           "asleep or firewalled")
    # a deadline on the Compute stream is a slow worker, not a silent host
    assert not isinstance(error_for(_Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline "
                                            "Exceeded"), "h:1", STREAM), Unreachable)
    routeless = error_for(_Failed(grpc.StatusCode.UNAVAILABLE, "failed to connect to all "
                                  "addresses; last error: UNKNOWN: ipv4:10.0.0.9:5: Failed to "
                                  "connect to remote host: No route to host"), "10.0.0.9:5", CALL)
    assert str(routeless) == "worker 10.0.0.9:5 is unreachable: cannot connect: no route to host"
    # a socket's own words (doctor's TCP probe) read the same
    assert unreachable_reason("Connection refused") == REFUSED
    assert unreachable_reason("timed out", 2.0).startswith("no answer within 2 s")
    assert dead_worker("studio-b", "10.0.0.9:5", REFUSED) == \
        f"worker studio-b at 10.0.0.9:5 is unreachable: {REFUSED}"


@pytest.mark.parametrize("details,reason", [
    ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:5: Failed to "
     "connect to remote host: Connection refused", REFUSED),
    ("errors resolving nosuch.invalid:5: [field:hostname lookup error:address lookup failed "
     "for nosuch.invalid:5: Domain name not found]", "cannot connect: domain name not found"),
    ("connections to all backends failing; last error: UNAVAILABLE: ipv4:10.0.0.9:5: No route "
     "to host", "cannot connect: no route to host"),
])
def test_a_worker_that_cannot_be_reached_is_named_once_with_one_reason(details, reason):
    for wording in (CALL, INVENTORY, STREAM):
        error = error_for(_Failed(grpc.StatusCode.UNAVAILABLE, details), "h:5", wording)
        assert isinstance(error, Unreachable)
        assert str(error) == f"worker h:5 is unreachable: {reason}"
        # how a line that names the worker itself quotes it
        assert reason_of(error, "h:5") == reason
    late = error_for(_Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), "h:5",
                     STREAM)
    assert str(late) == "worker h:5 failed: deadline exceeded"
    assert reason_of(str(late), "h:5") == "deadline exceeded"


def _inventory(*experts: int) -> shoal_pb2.Inventory:
    return shoal_pb2.Inventory(experts=[shoal_pb2.HeldExpert(layer=0, expert=e)
                                        for e in experts])


def test_a_worker_that_let_a_moved_expert_go_sends_us_to_its_new_holder(secret_file):
    """Expert 1 moved from worker 0 to worker 1, and worker 0's change is noticed first: the
    reload finds the new holder instead of declaring the expert lost."""
    members = FixedMembers(["127.0.0.1:1", "127.0.0.1:2"], load_secret(secret_file))
    try:
        members.update_inventory(members.links[0], _inventory(0, 1))
        members.update_inventory(members.links[1], _inventory(2))
        cluster = Cluster.of(members, {0: 3})
        now = {0: _inventory(0), 1: _inventory(1, 2)}  # what each worker answers now
        for i, link in enumerate(members.links):
            link.fetch_inventory = lambda timeout=None, i=i: now[i]
        cluster.reload(0)
        assert cluster.routes[0].copies[1, 0] == 1
        assert cluster.holdings == [frozenset({(0, 0)}), frozenset({(0, 1), (0, 2)})]

        now[1] = _inventory(2)  # expert 1 really is nowhere now: lost, and said so
        members.update_inventory(members.links[0], _inventory(0, 1))
        members.update_inventory(members.links[1], _inventory(2))  # followed: an event
        with pytest.raises(Unavailable, match="no live worker holds these experts: layer 0: "
                                              "experts? 1"):
            cluster.reload(0)
    finally:
        members.close()


def test_a_change_while_the_cluster_starts_following_is_not_missed(secret_file):
    """A worker's handshake lands between the cluster's first snapshot and its watch (serve
    starts while its workers come up): the cluster still routes by it, not by the snapshot
    without it (which answered 503 for good under load)."""
    members = FixedMembers(["127.0.0.1:1", "127.0.0.1:2"], load_secret(secret_file))
    try:
        members.update_inventory(members.links[0], _inventory(0))
        watch = members.watch

        def late_watch(changed):  # the second worker's inventory arrives just before
            members.update_inventory(members.links[1], _inventory(1))
            watch(changed)

        members.watch = late_watch
        cluster = Cluster.following(members, {0: 2})
        assert not cluster.current.missing, cluster.current.missing
        assert cluster.holdings == [frozenset({(0, 0)}), frozenset({(0, 1)})]
    finally:
        members.close()
