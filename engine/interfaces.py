"""Network interfaces and the path to a worker: Thunderbolt Bridge first, then wired, then
wireless. Ranking is a pure function of plain data; only `local_interfaces()` looks at the
machine (ifaddr, plus the platform's own names for its ports where it has them)."""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InvalidInput

# Best first. "local": a loopback address, so the worker is on this machine. "routed": no
# interface of ours is on the worker's subnet. "virtual": VPN tunnels, VM and container bridges.
KINDS = ("local", "thunderbolt", "wired", "wireless", "routed", "virtual")
_RANK = {kind: rank for rank, kind in enumerate(KINDS)}
_LINK_LOCAL = ipaddress.ip_network("169.254.0.0/16")
_VIRTUAL_PREFIXES = (
    "docker", "br-", "veth", "virbr", "vmnet", "vboxnet", "utun", "tun", "tap", "awdl",
    "llw", "anpi", "gif", "stf", "ap1", "zt", "tailscale", "wg", "lxc", "cni", "flannel",
)
_WIRELESS_WORDS = ("wi-fi", "wifi", "wireless", "airport", "wlan", "802.11")


@dataclass(frozen=True)
class Interface:
    """One IPv4 address of one interface of this machine."""

    name: str  # bridge0, en0, eth0, ...
    address: str
    prefix: int  # network prefix length
    label: str = ""  # the platform's name for the port: "Thunderbolt Bridge", "Wi-Fi", "wireless"


@dataclass(frozen=True)
class Route:
    """The path this machine uses to reach one address of a worker."""

    address: str  # the worker's address we connect to (IP, or a host name we could not rank)
    interface: str  # our interface on that path; "" when not known
    kind: str  # one of KINDS

    def describe(self) -> str:
        return f"{self.interface} ({self.kind})" if self.interface else self.kind


def kind_of(interface: Interface) -> str:
    """Classify an interface. macOS's Thunderbolt Bridge is a `bridge*` interface, usually with
    a self-assigned 169.254.0.0/16 address; the platform label wins when there is one."""
    name, label = interface.name.lower(), interface.label.lower()
    address = ipaddress.ip_address(interface.address)
    if address.is_loopback or name in ("lo", "lo0"):
        return "local"
    if "thunderbolt" in label and "ethernet" not in label:
        return "thunderbolt"
    if name.startswith("thunderbolt") or (name.startswith("bridge") and address in _LINK_LOCAL):
        return "thunderbolt"
    if any(word in label for word in _WIRELESS_WORDS) or name.startswith(("wl", "wifi")):
        return "wireless"
    if name.startswith(_VIRTUAL_PREFIXES) or name.startswith("bridge"):
        return "virtual"  # a bridge without a link-local address: VMs, Internet Sharing
    return "wired"


def rank(kind: str) -> int:
    return _RANK.get(kind, len(KINDS))


def route_to(address: str, local: Sequence[Interface]) -> Route:
    """How this machine reaches `address`: through the best of our interfaces on its subnet."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return Route(address, "", "routed")  # a host name: the system resolver decides
    if ip.is_loopback:
        loopback = next((i.name for i in local if kind_of(i) == "local"), "")
        return Route(address, loopback, "local")
    on_link = [
        i for i in local
        if ip.version == ipaddress.ip_address(i.address).version
        and ip in ipaddress.ip_network(f"{i.address}/{i.prefix}", strict=False)
        and kind_of(i) != "local"
    ]
    if not on_link:
        return Route(address, "", "routed")
    best = min(on_link, key=lambda i: rank(kind_of(i)))
    return Route(address, best.name, kind_of(best))


def choose_route(
    addresses: Sequence[str], local: Sequence[Interface], prefer: str | None = None
) -> Route:
    """The best path to a worker that answers on several addresses.

    `prefer` (an interface name of ours, from --interface) wins when the worker has an address
    reachable through it; otherwise local, then Thunderbolt, wired, wireless, routed, virtual.
    Ties keep the worker's own order, so the choice is the same on every run.
    """
    if not addresses:
        raise InvalidInput("the worker advertised no address")
    routes = [route_to(address, local) for address in addresses]
    if prefer:
        preferred = [r for r in routes if r.interface == prefer]
        if preferred:
            return preferred[0]
    return min(routes, key=lambda r: rank(r.kind))


def is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "[::]")


def advertised_addresses(
    host: str, interface: str | None, local: Sequence[Interface]
) -> list[str]:
    """The IPv4 addresses a worker listening on `host` announces.

    A specific --host is announced as it is; --interface narrows to that interface; otherwise
    every physical interface's address (not loopback, tunnels or VM bridges), falling back to
    loopback on a machine with no network.
    """
    if interface:
        return [i.address for i in select_interface(interface, local)]
    if not is_wildcard(host):
        return [host]
    physical = [i.address for i in local if kind_of(i) not in ("local", "virtual")]
    return physical or [i.address for i in local if kind_of(i) == "local"]


def listen_host(
    host: str | None, interface: str | None, local: Sequence[Interface] | None = None
) -> str:
    """Where a worker listens: --host as given; else on --interface's address only (bridge0:
    Thunderbolt Bridge); else on loopback, so that a worker is never reachable from a network
    by default. `shoal-worker` and `shoal doctor` both ask this."""
    if host:
        return host
    if interface:
        local = local_interfaces() if local is None else local
        return select_interface(interface, local)[0].address
    return "127.0.0.1"


def announced_addresses(
    host: str, interface: str | None, local: Sequence[Interface] | None = None
) -> list[str]:
    """The IPv4 addresses a worker listening on `host` announces with Bonjour: --interface's,
    else --host's (resolved), else (a wildcard host) every physical interface's."""
    if not interface and not is_wildcard(host):
        try:
            return [socket.gethostbyname(host)]
        except OSError as e:
            raise InvalidInput(f"cannot resolve --host {host!r}: {e}") from None
    return advertised_addresses(host, interface, local_interfaces() if local is None else local)


def select_interface(name_or_address: str, local: Sequence[Interface]) -> list[Interface]:
    """The addresses of --interface, given as an interface name (bridge0) or one of its IPs."""
    chosen = [i for i in local if name_or_address in (i.name, i.address)]
    if not chosen:
        names = ", ".join(sorted({f"{i.name} ({kind_of(i)})" for i in local})) or "none"
        raise InvalidInput(
            f"no IPv4 interface {name_or_address!r} on this machine; it has: {names}"
        )
    return chosen


def local_interfaces() -> list[Interface]:
    """Every IPv4 address of this machine's interfaces, labelled where the platform says more."""
    import ifaddr

    labels = _platform_labels()
    found = []
    for adapter in ifaddr.get_adapters():
        name = adapter.nice_name
        label = labels.get(name) or (name if sys.platform == "win32" else "")
        for ip in adapter.ips:
            if ip.is_IPv4:
                found.append(Interface(name, str(ip.ip), int(ip.network_prefix), label))
    return found


def _platform_labels() -> dict[str, str]:
    """Interface name -> the platform's word for it; empty where the platform has none."""
    if sys.platform == "darwin":
        return _macos_hardware_ports()
    if sys.platform.startswith("linux"):
        labels = {}
        for path in Path("/sys/class/net").glob("*"):
            if (path / "wireless").exists() or (path / "phy80211").exists():
                labels[path.name] = "wireless"
        return labels
    return {}


def _macos_hardware_ports() -> dict[str, str]:
    """`networksetup -listallhardwareports`: 'Hardware Port: Wi-Fi' / 'Device: en0' pairs."""
    try:
        text = subprocess.run(
            ["networksetup", "-listallhardwareports"],
            capture_output=True, text=True, timeout=5, check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    labels, port = {}, ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Hardware Port":
            port = value.strip()
        elif key.strip() == "Device" and port:
            labels[value.strip()] = port
    return labels


def busy_port(host: str, port: int) -> str:
    return (f"cannot listen on {host}:{port}: the port is in use (another shoal-worker, or "
            f"another program: `lsof -i :{port}` names it) or not an address of this host; "
            "give another --port")


def port_taken(host: str, port: int) -> bool:
    """Whether host:port cannot be bound now (in use, or not an address of this host)."""
    import socket

    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError:
            return True
    return False
