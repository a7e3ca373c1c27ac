"""Path choice is a pure function of our interfaces and a worker's addresses."""

import pytest

from engine.errors import InvalidInput
from engine.interfaces import (
    Interface,
    advertised_addresses,
    choose_route,
    kind_of,
    route_to,
    select_interface,
)

# A MacBook: Thunderbolt Bridge (self-assigned), Ethernet adapter, Wi-Fi on en0, a VPN, a VM bridge.
MAC = [
    Interface("lo0", "127.0.0.1", 8),
    Interface("en0", "10.0.0.5", 24, "Wi-Fi"),
    Interface("en7", "192.168.1.10", 24, "USB 10/100/1000 LAN"),
    Interface("bridge0", "169.254.7.1", 16),
    Interface("utun3", "100.64.0.2", 10),
    Interface("bridge100", "192.168.64.1", 24),
]


@pytest.mark.parametrize("interface,kind", [
    (Interface("bridge0", "169.254.7.1", 16), "thunderbolt"),
    (Interface("bridge0", "10.77.0.1", 24, "Thunderbolt Bridge"), "thunderbolt"),
    (Interface("thunderbolt0", "10.77.0.1", 24), "thunderbolt"),
    (Interface("en5", "10.1.0.1", 24, "Thunderbolt Ethernet Slot 1"), "wired"),
    (Interface("bridge100", "192.168.64.1", 24), "virtual"),
    (Interface("en0", "10.0.0.5", 24, "Wi-Fi"), "wireless"),
    (Interface("wlp2s0", "10.0.0.5", 24), "wireless"),
    (Interface("eth0", "10.0.0.5", 24, "wireless"), "wireless"),
    (Interface("en0", "10.0.0.5", 24), "wired"),
    (Interface("eth0", "10.251.0.2", 24), "wired"),
    (Interface("utun3", "100.64.0.2", 10), "virtual"),
    (Interface("docker0", "172.17.0.1", 16), "virtual"),
    (Interface("lo0", "127.0.0.1", 8), "local"),
])
def test_interfaces_are_classified_by_platform_label_name_and_address(interface, kind):
    assert kind_of(interface) == kind


def test_thunderbolt_beats_wired_beats_wireless():
    worker = ["10.0.0.7", "192.168.1.20", "169.254.3.4"]
    route = choose_route(worker, MAC)
    assert (route.address, route.interface, route.kind) == ("169.254.3.4", "bridge0", "thunderbolt")
    assert route.describe() == "bridge0 (thunderbolt)"
    assert choose_route(worker[:2], MAC).kind == "wired"
    assert choose_route(worker[:1], MAC).interface == "en0"
    assert choose_route(worker[:1], MAC).kind == "wireless"


def test_interface_option_overrides_the_ranking_when_the_worker_is_on_it():
    worker = ["10.0.0.7", "192.168.1.20", "169.254.3.4"]
    assert choose_route(worker, MAC, prefer="en0").address == "10.0.0.7"
    assert choose_route(worker[2:], MAC, prefer="en0").interface == "bridge0"  # not on en0


def test_link_local_on_several_interfaces_prefers_the_bridge():
    both = [Interface("en7", "169.254.9.9", 16), Interface("bridge0", "169.254.7.1", 16)]
    assert route_to("169.254.3.4", both).interface == "bridge0"


def test_loopback_unrouted_and_host_names():
    assert route_to("127.0.0.1", MAC) == route_to("127.0.0.1", MAC)
    assert (route_to("127.0.0.1", MAC).kind, route_to("127.0.0.1", MAC).interface) == (
        "local", "lo0")
    assert route_to("8.8.8.8", MAC).kind == "routed"
    assert route_to("studio.local", MAC).kind == "routed"
    assert choose_route(["8.8.8.8", "100.64.0.9"], MAC).address == "8.8.8.8"  # VPN last
    with pytest.raises(InvalidInput):
        choose_route([], MAC)


def test_a_worker_announces_its_physical_addresses_unless_told_otherwise():
    assert advertised_addresses("0.0.0.0", None, MAC) == ["10.0.0.5", "192.168.1.10",
                                                          "169.254.7.1"]
    assert advertised_addresses("0.0.0.0", "bridge0", MAC) == ["169.254.7.1"]
    assert advertised_addresses("127.0.0.1", None, MAC) == ["127.0.0.1"]
    assert advertised_addresses("0.0.0.0", None, MAC[:1]) == ["127.0.0.1"]  # no network
    with pytest.raises(InvalidInput, match=r"no IPv4 interface 'en9'.*bridge0 \(thunderbolt\)"):
        select_interface("en9", MAC)
    assert select_interface("192.168.1.10", MAC)[0].name == "en7"
