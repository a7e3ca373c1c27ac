"""Bonjour registration of a worker (`_shoal._tcp.local.`) and its node id, stable per machine
and made anew when the config folder was copied from another Mac; a worker also warns when
another worker of its cluster announces its node id."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

from engine.advert import SERVICE_TYPE, Advert, decode_txt, encode_txt
from engine.auth import default_secret_path
from engine.errors import InvalidInput
from engine.manifest import write_atomic

# The node id file is JSON: {"node_id": "studio-3f9a1c", "machine": "<fingerprint>"}; the
# fingerprint hashes the platform's machine identity, so a config folder restored onto another
# Mac (Migration Assistant, dotfile sync) is noticed and not reused.
NODE_ID_FILE = "node-id"
REGISTER_TIMEOUT = 10.0
RESOLVE_TIMEOUT_MS = 3000


def node_id_path() -> Path:
    """Next to the default secret: $XDG_CONFIG_HOME/shoal/node-id, else ~/.config/shoal/node-id."""
    return default_secret_path().parent / NODE_ID_FILE


@dataclass(frozen=True)
class NodeIdChoice:
    node_id: str
    write: bool  # whether the file must be (re)written
    note: str | None  # why the stored id was not used, for the log


def choose_node_id(
    stored: Mapping | None, machine: str, hostname: str, token: str
) -> NodeIdChoice:
    """Keep the stored id if it was made on this machine; else make `<host>-<token>`."""
    fresh = f"{host_label(hostname)}-{token}"
    if stored is None:
        return NodeIdChoice(fresh, True, None)
    stored_id, stored_machine = stored.get("node_id"), stored.get("machine")
    if not isinstance(stored_id, str) or not stored_id:
        return NodeIdChoice(fresh, True, "the node id file was unreadable; made a new one")
    if stored_machine != machine:
        return NodeIdChoice(
            fresh, True,
            f"node id {stored_id!r} was made on another machine (a copied config folder?); "
            f"this machine now uses {fresh!r}",
        )
    return NodeIdChoice(stored_id, False, None)


def host_label(hostname: str) -> str:
    """'Jans-MacBook-Pro.local' -> 'jans-macbook-pro': a DNS-safe start for a node id."""
    label = re.sub(r"[^a-z0-9-]+", "-", hostname.split(".")[0].lower()).strip("-")
    return label[:40] or "worker"


def load_node_id(path: Path, *, log: Callable[[str], None]) -> str:
    """The persisted node id of this machine, created (or replaced) as needed."""
    try:
        stored = json.loads(path.read_text())
        stored = stored if isinstance(stored, dict) else {}
    except FileNotFoundError:
        stored = None
    except (OSError, ValueError):
        stored = {}
    machine = machine_fingerprint()
    choice = choose_node_id(stored, machine, socket.gethostname(), secrets.token_hex(3))
    if choice.note:
        log(f"{choice.note} ({path})")
    if choice.write:
        data = {"node_id": choice.node_id, "machine": machine}
        try:
            write_atomic(path, (json.dumps(data) + "\n").encode())
        except OSError as e:
            log(f"cannot save the node id to {path} ({e.strerror}); it will change next start")
    return choice.node_id


def instance_name(node_id: str, machine: str, port: int) -> str:
    """The Bonjour instance name: the node id and a tag of this machine and port.

    Coordinators know workers by instance name, so two workers that share a node id must never
    share one. mDNS would rename a conflicting registration, but only if the probe's answer
    gets through, and answers to probes are unicast, which not every mDNS socket of a Mac
    receives: then both registered the same name and one worker hid the other. The tag stays
    the same when a worker restarts on the same port, so its new advert replaces the old one.
    """
    tag = hashlib.sha256(f"{machine}:{port}".encode()).hexdigest()[:6]
    return f"{node_id[:56]}-{tag}"


def machine_fingerprint() -> str:
    """A hash of this machine's identity: IOPlatformUUID on macOS, machine-id on Linux,
    else the hardware address, else the host name. Stable across restarts of one machine."""
    identity = _macos_platform_uuid() if sys.platform == "darwin" else None
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        if identity:
            break
        try:
            identity = Path(path).read_text().strip()
        except OSError:
            pass
    if not identity:
        node = uuid.getnode()
        # uuid.getnode() makes up a random number (multicast bit set) when it finds no MAC.
        identity = f"mac:{node:012x}" if not node & (1 << 40) else f"host:{socket.gethostname()}"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def _macos_platform_uuid() -> str | None:
    try:
        text = subprocess.run(
            ["ioreg", "-rd1", "-c", "IOPlatformExpertDevice"],
            capture_output=True, text=True, timeout=5, check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r'"IOPlatformUUID"\s*=\s*"([^"]+)"', text)
    return match.group(1) if match else None


class Advertiser:
    """Announces one worker on the local network; `close()` withdraws it (goodbye packets).

    Registration probes the network for about 1.5 s, so it runs in a thread: the worker
    serves meanwhile. Zeroconf is bound to the advertised addresses only.
    """

    def __init__(
        self, advert: Advert, addresses: list[str], port: int, *, log: Callable[[str], None]
    ) -> None:
        self.advert = advert
        self.addresses = addresses
        self.port = port
        self.log = log
        self.name: str | None = None  # the instance name in use once registered
        self.duplicates: set[str] = set()  # instance names of others that use our node id
        self._zc = None
        self._info = None
        self._watch = None
        self._resolver = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="watch")
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._register, name="advertise", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _register(self) -> None:
        from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, Zeroconf

        wanted = f"{instance_name(self.advert.node_id, machine_fingerprint(), self.port)}." \
            f"{SERVICE_TYPE}"
        try:
            with self._lock:
                if self._closed:
                    return
                self._zc = Zeroconf(interfaces=self.addresses, ip_version=IPVersion.V4Only)
            self._info = ServiceInfo(
                SERVICE_TYPE, wanted,
                addresses=[socket.inet_aton(a) for a in self.addresses],
                port=self.port,
                properties=encode_txt(self.advert),
                # A host name of its own: several workers may share a machine or a host name.
                server=f"shoal-{secrets.token_hex(4)}.local.",
            )
            self._zc.register_service(self._info, allow_name_change=True)
        except Exception as e:  # whatever zeroconf raises, the worker keeps serving
            self.log(
                f"warning: cannot advertise on the local network ({e}); coordinators can "
                "still reach this worker with --workers or --cluster-config"
            )
            return
        self.name = self._info.name
        self.log(
            f"advertising {SERVICE_TYPE[:-7]} in cluster {self.advert.cluster!r} on "
            + ", ".join(f"{a}:{self.port}" for a in self.addresses)
        )
        with self._lock:
            if not self._closed:
                self._watch = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._seen])

    def _seen(self, zeroconf: object, service_type: str, name: str, state_change: object) -> None:
        from zeroconf import ServiceStateChange

        if name != self.name and state_change is not ServiceStateChange.Removed:
            with self._lock:
                if not self._closed:
                    self._resolver.submit(self._check_other, name)

    def _check_other(self, name: str) -> None:
        from zeroconf import IPVersion, ServiceInfo

        info = ServiceInfo(SERVICE_TYPE, name)
        if self._closed or not info.request(self._zc, RESOLVE_TIMEOUT_MS):
            return
        try:
            other = decode_txt(info.properties)
        except InvalidInput:
            return
        same = (other.node_id, other.cluster) == (self.advert.node_id, self.advert.cluster)
        if not same or name in self.duplicates:
            return
        self.duplicates.add(name)
        where = ", ".join(f"{a}:{info.port}" for a in info.parsed_addresses(IPVersion.V4Only))
        self.log(
            f"warning: another worker on this network already uses node id "
            f"{self.advert.node_id!r} in cluster {self.advert.cluster!r} (at {where}); "
            "coordinators mark both `duplicate id`. Give each worker its own --node-id "
            "(or delete the node-id file on the copy)"
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._thread.join(REGISTER_TIMEOUT)
        if self._watch is not None:
            self._watch.cancel()
        self._resolver.shutdown(wait=True, cancel_futures=True)
        if self._zc is None:
            return
        try:
            if self.name is not None:
                self._zc.unregister_service(self._info)
        finally:
            self._zc.close()
