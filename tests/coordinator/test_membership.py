"""Membership rules as pure functions (liveness, duplicates, configs), and its threaded view as
an expert moves between scripted workers."""

import time
from dataclasses import replace
from pathlib import Path

import pytest

from coordinator.cluster import member as member_module
from coordinator.cluster.discovery import (
    Candidate,
    parse_cluster_config,
    read_cluster_config,
    same_cluster,
)
from coordinator.cluster.member import (
    DEAD_AFTER,
    RETRY_AFTER,
    after_check,
    duplicate_ids,
    in_words,
    member_for,
    needs_handshake,
    stale_twins,
)
from coordinator.cluster.membership import Membership
from coordinator.cluster.snapshot import parse_addresses
from engine.advert import Advert
from engine.errors import InvalidInput
from engine.interfaces import Interface
from proto import PROTOCOL_VERSION, shoal_pb2

REPO = Path(__file__).resolve().parents[2]
LOCAL = [Interface("lo0", "127.0.0.1", 8), Interface("en0", "10.0.0.5", 24, "Wi-Fi"),
         Interface("bridge0", "169.254.7.1", 16)]


class FakeManifest:
    fingerprint = "f" * 64
    model_type = "qwen3_moe"


def advert(**changes) -> Advert:
    base = Advert("studio-a", "desk", PROTOCOL_VERSION, "f" * 64, "0" * 16, 12, 1 << 30, 1 << 40)
    return replace(base, **changes)


def candidate(**changes) -> Candidate:
    return Candidate("studio-a._shoal._tcp.local.",
                     (("10.0.0.9", 50551), ("169.254.3.4", 50551)), advert(**changes))


def test_only_the_same_cluster_counts():
    assert same_cluster(advert(), "desk")
    assert not same_cluster(advert(cluster="other"), "desk")


def test_a_new_member_takes_the_thunderbolt_path_and_waits_for_its_handshake():
    member = member_for(candidate(), LOCAL, prefer=None, manifest=FakeManifest(), now=5.0)
    assert member.address == "169.254.3.4:50551"
    assert member.route.describe() == "bridge0 (thunderbolt)"
    assert (member.state, member.node_id, member.experts_held) == ("connecting", "studio-a", 12)
    assert needs_handshake(member, now=5.0)
    wifi = member_for(candidate(), LOCAL, prefer="en0", manifest=FakeManifest(), now=5.0)
    assert wifi.address == "10.0.0.9:50551"


def test_other_models_and_protocols_are_incompatible_without_connecting():
    other_model = member_for(candidate(model="e" * 64), LOCAL, prefer=None,
                             manifest=FakeManifest(), now=0.0)
    assert other_model.state == "incompatible" and "different model" in other_model.detail
    old = member_for(candidate(protocol=PROTOCOL_VERSION + 1), LOCAL, prefer=None,
                     manifest=None, now=0.0)
    assert old.state == "incompatible" and "protocol" in old.detail
    anything = member_for(candidate(model="e" * 64), LOCAL, prefer=None, manifest=None, now=0.0)
    assert anything.state == "connecting"  # `shoal workers` without --model judges no model


def test_liveness_tolerates_one_slow_check_but_not_an_outage():
    member = replace(member_for(candidate(), LOCAL, prefer=None, manifest=None, now=0.0),
                     state="healthy")
    member = after_check(member, 1.0, rtt=0.002)
    assert member.rtt_ms == pytest.approx(2.0) and member.last_ok == 1.0
    blip = after_check(member, 1.5, failure="UNAVAILABLE")
    assert blip.state == "healthy"
    gone = after_check(blip, 1.0 + DEAD_AFTER, failure="UNAVAILABLE: connection refused")
    assert gone.state == "unreachable" and "refused" in gone.detail and gone.rtt_ms is None
    back = after_check(gone, 9.0, rtt=0.004)
    assert back.state == "connecting" and back.detail == "" and needs_handshake(back, 9.0)


def test_a_member_that_is_not_healthy_is_said_by_its_address_alone_unless_it_has_a_name():
    listed = member_for(Candidate(key="10.0.0.9:5", endpoints=(("10.0.0.9", 5),)), LOCAL,
                        prefer=None, manifest=None, now=0.0)
    dead = replace(listed, state="unreachable", detail="connection refused at once: nothing "
                   "listens on that port")
    assert in_words(dead) == ("worker 10.0.0.9:5 is unreachable: connection refused at once: "
                              "nothing listens on that port")
    named = replace(dead, node_id="studio-b", state="unauthenticated", detail="other secret")
    assert in_words(named) == "worker studio-b at 10.0.0.9:5 is unauthenticated (other secret)"


def test_refused_handshakes_are_retried_now_and_then():
    member = replace(member_for(candidate(), LOCAL, prefer=None, manifest=None, now=0.0),
                     state="unauthenticated", handshake_at=10.0)
    assert not needs_handshake(member, 10.0 + RETRY_AFTER / 2)
    assert needs_handshake(member, 10.0 + RETRY_AFTER)
    assert not needs_handshake(replace(member, state="healthy"), 100.0)


def test_a_duplicated_node_id_is_reported_unless_one_copy_is_a_dead_entry():
    a = member_for(candidate(), LOCAL, prefer=None, manifest=None, now=0.0)
    b = replace(a, key="studio-a-2._shoal._tcp.local.", address="10.0.0.10:50551")
    assert duplicate_ids([a, b]) == {"studio-a": ["10.0.0.10:50551", "169.254.3.4:50551"]}
    assert duplicate_ids([a, replace(b, state="unreachable")]) == {}


def test_a_worker_restarted_on_another_port_replaces_its_dead_entry_only():
    old = member_for(candidate(), LOCAL, prefer=None, manifest=None, now=0.0)
    new = replace(old, key="studio-a-9f9f9f._shoal._tcp.local.", address="10.0.0.10:50552")
    assert stale_twins([old, new], new) == []  # alive: a real duplicate, reported
    dead = replace(old, state="unreachable")
    assert stale_twins([dead, new], new) == [dead.key]
    other = replace(dead, node_id="studio-b")
    assert stale_twins([other, new], new) == []


def test_shipped_cluster_configs_parse():
    two = read_cluster_config(REPO / "cluster-configs" / "two-macs-thunderbolt.toml")
    assert len(two.workers) == 2 and two.interface == "bridge0"
    assert two.workers[0].endpoints[0] == ("169.254.10.2", 50551)
    four = read_cluster_config(REPO / "cluster-configs" / "four-macs-thunderbolt.toml")
    assert len(four.workers) == 4 and all(w.interface == "bridge0" for w in four.workers)
    local = read_cluster_config(REPO / "cluster-configs" / "coordinator-and-one-worker.toml")
    assert len(local.workers) == 1 and local.memory_budget == "40G"
    assert local.local_stores == (Path("/Volumes/Fast/out/worker-0"),)


@pytest.mark.parametrize("data,message", [
    ({"workers": [{"address": "a:1"}]}, "give the cluster a name"),
    ({"name": "desk"}, "list the workers"),
    ({"name": "desk", "workers": [{"address": "a"}]}, "is not HOST:PORT"),
    ({"name": "desk", "workers": [{"address": "a:99999"}]}, "port 99999 is out of range"),
    ({"name": "desk", "workers": [{"adress": "a:1"}]}, "unknown setting(s) adress"),
    ({"name": "desk", "nodes": []}, "unknown setting(s) nodes"),
    ({"name": "desk", "workers": [{"address": "a:1"}, {"address": "a:1"}]}, "listed twice"),
    ({"name": "two words", "workers": [{"address": "a:1"}]}, "cluster name"),
    ({"name": "desk", "coordinator": {"stores": "a"}}, "stores must be a list"),
    ({"name": "desk", "coordinator": {"store": ["a"]}}, "unknown setting(s) store"),
    ({"name": "desk", "coordinator": {"memory_budget": "25%"}}, "memory_budget needs stores"),
])
def test_cluster_config_mistakes_are_explained(data, message):
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_cluster_config(data, "desk.toml")


def test_a_config_worker_interface_applies_unless_the_command_line_names_one():
    config = parse_cluster_config({"name": "desk", "interface": "en0", "workers": [
        {"addresses": ["169.254.3.4:50551", "10.0.0.9:50551"]},
        {"addresses": ["169.254.3.5:50551", "10.0.0.8:50551"], "interface": "bridge0"},
    ]}, "desk.toml")
    first, second = (member_for(c, LOCAL, prefer=None, manifest=None, now=0.0)
                     for c in config.workers)
    assert first.address == "10.0.0.9:50551" and second.address == "169.254.3.5:50551"
    assert first.node_id == "10.0.0.9:50551"  # until its handshake says otherwise
    forced = member_for(config.workers[1], LOCAL, prefer="en0", manifest=None, now=0.0)
    assert forced.address == "10.0.0.8:50551"


def test_a_config_may_name_the_coordinators_own_stores_relative_to_itself(tmp_path):
    config = parse_cluster_config({"name": "desk", "coordinator": {
        "stores": ["out/worker-0", "/Volumes/B/worker-0"], "memory_budget": "25%"}},
        "desk.toml", tmp_path)
    assert config.local_stores == (tmp_path / "out/worker-0", Path("/Volumes/B/worker-0"))
    assert config.memory_budget == "25%" and config.workers == ()  # one Mac alone


@pytest.mark.parametrize("text,message", [
    ("127.0.0.1:99999", "port 99999 is out of range (1-65535)"),
    (":99999", "port 99999 is out of range"),
    ("mac-a.local", "is not HOST:PORT"),
    ("a:b", "is not HOST:PORT"),
])
def test_a_worker_address_says_what_is_wrong_with_it(text, message):
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_addresses(text)


def test_what_a_membership_waits_for_is_named_as_the_user_gave_it():
    found = Membership(b"", cluster="desk", local=LOCAL)
    assert found.workers == "the workers of cluster 'desk'"
    assert found.absent() == ["no worker of cluster 'desk' found yet"]  # in /health and 503s
    listed = Membership(b"", local=LOCAL, listed=["10.0.0.9:5", "10.0.0.8:5"])
    assert listed.workers == "the workers at 10.0.0.9:5, 10.0.0.8:5"


class ScriptedLink:
    """A worker link whose inventory the test sets: healthy, answering at once."""

    def __init__(self, address: str, held: set) -> None:
        self.address, self.held = address, set(held)

    def check_health(self, timeout: float) -> float:
        return 0.001

    def fetch_inventory(self, timeout: float = 5.0) -> shoal_pb2.Inventory:
        return shoal_pb2.Inventory(
            node_id=self.address, protocol_version=PROTOCOL_VERSION, fingerprint="f" * 64,
            experts=[shoal_pb2.HeldExpert(layer=layer, expert=expert)
                     for layer, expert in sorted(self.held)])

    def close(self) -> None:
        pass


class ScriptedTransport:
    def __init__(self, held: dict[str, set]) -> None:
        self.links = {address: ScriptedLink(address, experts) for address, experts in held.items()}

    def link(self, address: str, secret: bytes) -> ScriptedLink:
        return self.links[address]


def test_an_expert_that_moves_never_shows_without_a_holder(monkeypatch):
    """A rebalance copies expert (0, 1) from a to b, then a drains it. When a's next look
    finds it gone before b's has found it arrive, the others are asked again first: the view
    never shows (0, 1) unheld (serve would answer 503 in that window)."""
    monkeypatch.setattr(member_module, "INVENTORY_REFRESH", 1.0)
    transport = ScriptedTransport({"10.0.0.9:1": {(0, 1), (0, 2)}, "10.0.0.9:2": {(0, 3)}})
    membership = Membership(b"", manifest=FakeManifest(), local=LOCAL, transport=transport)
    views: list[frozenset] = []

    def changed() -> None:
        healthy = [m.experts for m in membership._members.values() if m.state == "healthy"]
        views.append(frozenset().union(*healthy))

    membership.watch(changed)
    try:
        for port, name in ((1, "a"), (2, "b")):
            membership.offer(Candidate(f"{name}._shoal._tcp.local.", (("10.0.0.9", port),),
                                       advert(node_id=name)))
            time.sleep(0.5)  # a looks again half a second before b does
        deadline = time.monotonic() + 10
        while len(views) < 2 or views[-1] != {(0, 1), (0, 2), (0, 3)}:
            assert time.monotonic() < deadline, views
            time.sleep(0.05)
        transport.links["10.0.0.9:2"].held.add((0, 1))  # copied to b
        transport.links["10.0.0.9:1"].held.discard((0, 1))  # then drained on a
        deadline = time.monotonic() + 10
        while views[-1] != {(0, 1), (0, 2), (0, 3)} or not any(
                (0, 1) in m.experts for m in membership.snapshot() if m.address.endswith(":2")):
            assert time.monotonic() < deadline, views
            time.sleep(0.05)
    finally:
        membership.close()
    full = views.index(frozenset({(0, 1), (0, 2), (0, 3)}))
    assert all((0, 1) in view for view in views[full:]), views
