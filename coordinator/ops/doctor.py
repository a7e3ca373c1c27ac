"""`shoal doctor`: what this machine and its cluster look like to Shoal, each finding (`Check`,
plain data) with a verdict; the cluster part reuses the membership `shoal generate` uses, so
doctor sees the workers exactly as a run would."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from coordinator.dataplane.link import WorkerLink
from coordinator.dataplane.link_errors import REFUSED, dead_worker, unreachable_reason
from engine.auth import load_secret, secret_mode
from engine.cache_policy import DEFAULT_MEMORY_SHARE, format_bytes
from engine.errors import ShoalError
from engine.interfaces import (
    advertised_addresses,
    announced_addresses,
    kind_of,
    listen_host,
    local_interfaces,
    rank,
)
from engine.manifest import not_written_by_shard, read_manifest
from proto import PROTOCOL_VERSION
from worker.open_stores import physical_memory

VERDICTS = ("ok", "warn", "fail")
MDNS_PROBE_TYPE = "_shoal-doctor._tcp.local."  # not _shoal._tcp: coordinators never see it
MDNS_TIMEOUT = 4.0
TCP_TIMEOUT = 2.0


@dataclass(frozen=True)
class Check:
    area: str  # secret, network, mdns, memory, store, mlx, worker
    verdict: str  # one of VERDICTS
    detail: str


def failed(checks: Sequence[Check]) -> list[Check]:
    return [c for c in checks if c.verdict == "fail"]


# ---------------------------------------------------------------------------------------
# This machine


def check_secret(path: Path) -> Check:
    """The cluster secret: present, long enough, and readable by its owner only (load_secret
    refuses it otherwise, as every command does)."""
    try:
        load_secret(path)
    except ShoalError as e:
        return Check("secret", "fail", str(e))
    return Check("secret", "ok", f"{path} (mode {secret_mode(path):04o})")


def check_network(interface: str | None) -> tuple[list[Check], list[str]]:
    """The interfaces of this machine, ranked as Shoal ranks paths; where a worker started here
    would listen and what it would announce (the same functions shoal-worker calls); and the
    addresses to probe Bonjour on (--interface's, else every physical one, where workers on
    other machines are found)."""
    local = local_interfaces()
    ranked = sorted(local, key=lambda i: (rank(kind_of(i)), i.name))
    listing = ", ".join(
        f"{i.name} {i.address}/{i.prefix} ({kind_of(i)}{', ' + i.label if i.label else ''})"
        for i in ranked
    )
    checks = [Check("network", "ok", f"interfaces: {listing or 'none'}")]
    try:
        probe = advertised_addresses("0.0.0.0", interface, local)
        host = listen_host(None, interface, local)
        announced = announced_addresses(host, interface, local)
    except ShoalError as e:
        return [*checks, Check("network", "fail", str(e))], []
    kinds = {kind_of(i) for i in local if i.address in probe}
    if "thunderbolt" in kinds:
        checks.append(Check("network", "ok", "Thunderbolt Bridge is up: workers on it are "
                            "reached through it first"))
    elif sys.platform == "darwin":
        checks.append(Check("network", "warn", "no Thunderbolt Bridge address: Macs linked by "
                            "a Thunderbolt cable need System Settings > Network > Thunderbolt "
                            "Bridge active (a self-assigned 169.254.x.x address is fine)"))
    if kinds <= {"local"}:
        checks.append(Check("network", "warn", "only loopback: workers here are reachable "
                            "from this machine only"))
    option = f"shoal-worker --interface {interface}" if interface else "shoal-worker"
    hint = ("" if interface else "; it serves this machine only: give --interface (e.g. "
            "bridge0, Thunderbolt Bridge) to serve others")
    checks.append(Check("network", "ok", f"`{option}` started here listens on {host} and "
                        f"announces {', '.join(announced) or 'nothing'}{hint}"))
    return checks, probe


def check_mdns(addresses: list[str], timeout: float = MDNS_TIMEOUT) -> Check:
    """Announce a probe service on `addresses` and browse for it from a second zeroconf: does
    multicast DNS get out of this process and back in?"""
    from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

    if not addresses:
        return Check("mdns", "fail", "no address to announce on")
    name = f"doctor-{os.getpid()}-{time.monotonic_ns() % 10**6}.{MDNS_PROBE_TYPE}"
    seen = threading.Event()

    probe = name

    # zeroconf calls handlers with these keyword names.
    def changed(zeroconf: object, service_type: str, name: str, state_change: object) -> None:
        if name == probe and state_change is ServiceStateChange.Added:
            seen.set()

    started = time.monotonic()
    announcer = Zeroconf(interfaces=addresses, ip_version=IPVersion.V4Only)
    listener = Zeroconf(interfaces=addresses, ip_version=IPVersion.V4Only)
    try:
        browser = ServiceBrowser(listener, MDNS_PROBE_TYPE, handlers=[changed])
        info = ServiceInfo(MDNS_PROBE_TYPE, name, port=9,
                           addresses=[socket.inet_aton(a) for a in addresses])
        announcer.register_service(info)
        got = seen.wait(timeout)
        browser.cancel()
        announcer.unregister_service(info)
    except Exception as e:  # whatever zeroconf raises is the finding
        return Check("mdns", "fail", f"cannot use multicast DNS here: {e}")
    finally:
        announcer.close()
        listener.close()
    if got:
        return Check("mdns", "ok", f"Bonjour works on {', '.join(addresses)} (an announcement "
                     f"was seen in {time.monotonic() - started:.1f} s)")
    hint = (" On macOS, allow Local Network access for the terminal app (System Settings > "
            "Privacy & Security > Local Network), then open a new terminal."
            if sys.platform == "darwin" else " Is a firewall dropping UDP port 5353?")
    return Check("mdns", "fail", f"an announcement on {', '.join(addresses)} was not seen "
                 f"within {timeout:g} s: workers will not be found by Bonjour (use "
                 f"--cluster-config).{hint}")


def available_memory() -> int | None:
    """Bytes of memory available without swapping: MemAvailable on Linux, free + inactive +
    speculative pages on macOS; None where the platform does not say."""
    try:
        if sys.platform == "darwin":
            text = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout
            page = int(text.split("page size of ")[1].split()[0])
            pages = {line.split(":")[0].strip(): int(line.split(":")[1].strip(" .\n"))
                     for line in text.splitlines()[1:] if ":" in line}
            return page * sum(pages.get(k, 0) for k in
                              ("Pages free", "Pages inactive", "Pages speculative"))
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None
    return None


def check_memory() -> Check:
    physical = physical_memory()
    free = available_memory()
    budget = int(physical * DEFAULT_MEMORY_SHARE)
    detail = (f"{format_bytes(physical)} physical, "
              f"{'unknown' if free is None else format_bytes(free)} available now; a worker's "
              f"default memory budget here is {format_bytes(budget)} "
              f"({DEFAULT_MEMORY_SHARE:.0%})")
    if free is not None and free < budget // 2:
        return Check("memory", "warn", detail + ": other programs hold much of it, so a "
                     "worker's experts may be paged out; close them or give --memory-budget")
    return Check("memory", "ok", detail)


def check_stores(stores: Sequence[Path]) -> list[Check]:
    """Each store folder: written by `shoal shard` (its manifest), experts, free disk."""
    checks = []
    for store in stores:
        if problem := not_written_by_shard(store):
            checks.append(Check("store", "fail", f"{problem} (give a store folder written by "
                                "`shoal shard`, OUT_DIR/worker-K)"))
            continue
        try:
            manifest = read_manifest(store)
        except ShoalError as e:
            checks.append(Check("store", "fail", str(e)))
            continue
        files = [store / e.file for e in manifest.experts if (store / e.file).exists()]
        held = sum(f.stat().st_size for f in files)
        free = shutil.disk_usage(store).free
        checks.append(Check("store", "ok" if free > 1 << 30 else "warn",
                            f"{store}: {len(files)} expert files ({format_bytes(held)}) of "
                            f"{manifest.model_type}, model {manifest.fingerprint[:12]}; "
                            f"{format_bytes(free)} free on its drive"))
    return checks


def check_mlx() -> Check:
    import mlx.core as mx

    device = mx.default_device()
    gpu = mx.metal.is_available()
    detail = f"MLX {getattr(mx, '__version__', '?')} computes on {device}"
    if sys.platform == "darwin" and not gpu:
        return Check("mlx", "warn", detail + ": Metal is not available, so experts run on "
                     "the CPU (slow). Is this an Apple silicon Mac, with a native arm64 Python?")
    return Check("mlx", "ok", detail + (" (Metal)" if gpu else ""))


# ---------------------------------------------------------------------------------------
# The cluster


def tcp_reach(address: str, timeout: float = TCP_TIMEOUT) -> str | None:
    """None when something accepts TCP connections at HOST:PORT, else why not, in words."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return None
    except TimeoutError:
        return unreachable_reason("timed out", timeout)
    except OSError as e:
        return unreachable_reason(e.strerror or str(e), timeout)


def refused_at_once(address: str) -> bool:
    """True when nothing listens at `address` (a refusal, told apart from a slow network)."""
    reason = tcp_reach(address, timeout=TCP_TIMEOUT)
    return reason == REFUSED


def check_workers(rows: Sequence[dict], fingerprint: str | None) -> list[Check]:
    """Verdicts on the workers as `shoal workers` lists them (member_rows, plus `reach`,
    `protocol` and `fingerprint` where doctor asked). `fingerprint`: the model to serve."""
    models = {r["fingerprint"] for r in rows if r.get("fingerprint")}
    checks = []
    for r in rows:
        name = r["address"] if r["node_id"] == r["address"] else \
            f"{r['node_id']} at {r['address']}"
        if r["state"] == "unreachable":  # the area says "worker" already
            said = dead_worker(r["node_id"], r["address"], r.get("reach") or r["detail"])
            checks.append(Check("worker", "fail", said.removeprefix("worker ")))
            continue
        if r["state"] != "healthy":
            why = r.get("reach") or r["detail"] or r["state"]
            checks.append(Check("worker", "fail", f"{name}: {r['state']}: {why}"))
            continue
        rtt = "?" if r["rtt_ms"] is None else f"{r['rtt_ms']:.2f} ms"
        via = f"{r['interface']} ({r['path']})" if r["interface"] else r["path"]
        detail = (f"{name}: healthy via {via}, round trip {rtt}, protocol "
                  f"{r.get('protocol', '?')}, model {(r.get('fingerprint') or '?')[:12]}, "
                  f"{r['experts']} experts")
        problems = []
        if r.get("protocol") not in (None, PROTOCOL_VERSION):
            problems.append(f"protocol {r['protocol']}, this coordinator speaks "
                            f"{PROTOCOL_VERSION}: upgrade Shoal on every machine")
        if fingerprint and r.get("fingerprint") and r["fingerprint"] != fingerprint:
            problems.append("serves another model than --model")
        elif len(models) > 1:
            problems.append("the workers serve different models (copy every store from one "
                            "`shoal shard` output)")
        if problems:
            checks.append(Check("worker", "fail", f"{detail}; " + "; ".join(problems)))
        elif r["duplicate_node_id"] or r["path"] == "wireless":
            why = ("another worker uses its node id: give each its own --node-id"
                   if r["duplicate_node_id"] else "reached over Wi-Fi, which is slow and "
                   "jittery for expert traffic: prefer Thunderbolt Bridge or Ethernet")
            checks.append(Check("worker", "warn", f"{detail}; {why}"))
        else:
            checks.append(Check("worker", "ok", detail))
    if not rows:
        checks.append(Check("worker", "fail", "no worker found (is shoal-worker running with "
                            "the same --cluster? see docs/operations.md)"))
    return checks


def inspect_workers(rows: list[dict], secret: bytes) -> list[dict]:
    """Add what a health check does not say: why an unreachable one is (TCP), and each
    healthy one's protocol version and model fingerprint (its inventory)."""
    out = []
    for row in rows:
        row = dict(row)
        if row["state"] == "unreachable":
            row["reach"] = tcp_reach(row["address"]) or row["detail"]
        elif row["state"] == "healthy":
            link = WorkerLink(row["address"], secret)
            try:
                inventory = link.fetch_inventory()
                row["protocol"] = inventory.protocol_version
                row["fingerprint"] = inventory.fingerprint
            except ShoalError as e:
                row["reach"] = str(e)
            finally:
                link.close()
        out.append(row)
    return out


def format_checks(checks: Sequence[Check]) -> str:
    marks = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
    lines = [f"  {marks[c.verdict]}  {c.area:<8} {c.detail}" for c in checks]
    bad, warned = failed(checks), [c for c in checks if c.verdict == "warn"]
    if bad:
        lines.append(f"verdict: {len(bad)} problem{'s' * (len(bad) > 1)} to fix"
                     + (f", {len(warned)} warning{'s' * (len(warned) > 1)}" if warned else ""))
    else:
        lines.append("verdict: ready" + (f" ({len(warned)} warning"
                                         f"{'s' * (len(warned) > 1)})" if warned else ""))
    return "\n".join(lines)
