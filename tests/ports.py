"""Ports for a process a test starts later on a port it names: below the kernel's ephemeral
range, so that no other test's outgoing connection or port-0 listener takes one meanwhile
(kernel-chosen ports were, under load), each with the port above it free (the expert lane)."""

import random
import socket
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")  # Linux; macOS starts at 49152


def ephemeral_start() -> int:
    try:
        return int(RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def free_ports(count: int) -> list[int]:
    """`count` ports nothing listens on now, each with the next one free too, drawn at random
    from below the ephemeral range (so parallel tests rarely draw the same)."""
    top = min(ephemeral_start(), 49152) - 2
    ports: list[int] = []
    for _ in range(1000):
        port = random.randrange(20000, top)
        if port in ports or port + 1 in ports or port - 1 in ports:
            continue
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise AssertionError(f"no {count} free port pairs below {top}")
