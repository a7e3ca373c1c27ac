"""A Thunderbolt-like network for `shoal bench --network thunderbolt`: each worker in its own
Linux network namespace behind a veth pair capped at 10 Gbit/s, with delay added by a relay
process on the coordinator's side (this kernel has no `netem`). Needs root and iproute2."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import ShoalError

ONE_WAY_DELAY = 0.0002  # seconds added each way: Thunderbolt Bridge TCP, about 0.4 ms RTT
RATE = "10gbit"
SUBNET = "10.213"
CHUNK = 1 << 20
REPO = Path(__file__).resolve().parents[1]


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise ShoalError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")


def check_can_build() -> None:
    """Refuse early, with the reason, where namespaces cannot be made."""
    if not hasattr(os, "geteuid") or sys.platform != "linux":
        raise ShoalError("--network thunderbolt uses Linux network namespaces; run it on Linux")
    if os.geteuid() != 0:
        raise ShoalError("--network thunderbolt makes network namespaces: run it as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ShoalError(f"--network thunderbolt needs `{tool}` (apt-get install iproute2)")


@dataclass
class Cable:
    """One worker's namespace and the veth pair to it."""

    netns: str
    host_side: str
    address: str  # the worker's address inside its namespace

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]


TAG = "shtb"  # namespaces are named TAG, the making process's id, "-w" and the host's number


def remove_left_behind() -> None:
    """Remove the namespaces of runs whose process is gone (one killed before its `close()`),
    then refuse, naming it, if anything else on this machine holds the cables' addresses: the
    kernel would send their packets there."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        owner = name.removeprefix(TAG).partition("-w")[0]
        if name.startswith(TAG) and owner.isdigit() and not _alive(int(owner)):
            _remove(name, name.replace("-w", "w"))
    taken = subprocess.run(["ip", "-o", "-4", "addr", "show", "to", f"{SUBNET}.0.0/16"],
                           capture_output=True, text=True, timeout=30).stdout.split()
    if taken:
        raise ShoalError(f"{SUBNET}.0.0/16, which --network thunderbolt uses, is already on "
                         f"{taken[1]} ({taken[3]}): remove it (`ip addr del {taken[3]} dev "
                         f"{taken[1]}`, or that namespace) or wait for the run that made it")


def _remove(netns: str, host_side: str) -> None:
    """Remove a cable: its veth pair first (at once; a namespace's own go some time after
    `ip netns del`, and meanwhile the host still holds their addresses), then the namespace."""
    subprocess.run(["ip", "link", "del", host_side], capture_output=True, timeout=30)
    subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# The coordinator talks to the relay on loopback; the relay holds every chunk for the delay
# before passing it on, in each direction, and `relay_floor()` measures what it costs itself.
# Everything is named after this process's id, only 10.213.0.0/16 inside the namespaces made
# here is used, and `close()` removes it all.
@dataclass
class ThunderboltNetwork:
    cables: list[Cable] = field(default_factory=list)
    _relays: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def build(cls, hosts: int) -> ThunderboltNetwork:
        check_can_build()
        remove_left_behind()
        net = cls()
        tag = f"{TAG}{os.getpid()}"  # its veth is tag + "w" + k: 15 characters at most
        try:
            for k in range(hosts):
                cable = Cable(f"{tag}-w{k}", f"{tag}w{k}", f"{SUBNET}.{k}.2")
                _run("ip", "netns", "add", cable.netns)
                net.cables.append(cable)
                _run("ip", "link", "add", cable.host_side, "type", "veth", "peer", "name", "eth0",
                     "netns", cable.netns)
                _run("ip", "addr", "add", f"{SUBNET}.{k}.1/30", "dev", cable.host_side)
                _run("ip", "link", "set", cable.host_side, "up")
                _run("ip", "-n", cable.netns, "addr", "add", f"{cable.address}/30", "dev", "eth0")
                _run("ip", "-n", cable.netns, "link", "set", "eth0", "up")
                _run("ip", "-n", cable.netns, "link", "set", "lo", "up")
                # 10 Gbit/s each way; the bucket holds one 1 ms tick's worth at that rate.
                shape = ("root", "tbf", "rate", RATE, "burst", "1250kb", "latency", "5ms")
                _run("tc", "qdisc", "add", "dev", cable.host_side, *shape)
                _run("tc", "-n", cable.netns, "qdisc", "add", "dev", "eth0", *shape)
        except BaseException:
            net.close()
            raise
        return net

    def places(self) -> list[tuple[list[str], str]]:
        """(command prefix, address) to run each host's server in its namespace."""
        return [(cable.prefix(), cable.address) for cable in self.cables]

    def relay(self, target: str, delay: float = ONE_WAY_DELAY) -> str:
        """Start a relay process from a loopback port to `target`; returns its address."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.network", "relay", "--to", target,
             "--delay-us", str(round(delay * 1e6))],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True, cwd=REPO,
        )
        self._relays.append(proc)
        line = proc.stdout.readline()  # "relay on 127.0.0.1:PORT -> ..." once it listens
        if not line.startswith("relay on "):
            raise ShoalError(f"the delay relay to {target} did not start: {line.strip()}")
        return line.split()[2]

    def close(self) -> None:
        """Stop the relays, then remove the cables."""
        for proc in self._relays:  # (not local_processes.stop_process: a relay starts light)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self._relays.clear()
        for cable in reversed(self.cables):
            _remove(cable.netns, cable.host_side)
        self.cables.clear()


# -- the relay: a TCP forwarder that delays each chunk, run as its own process ----------------


def _pump(source: socket.socket, sink: socket.socket, delay: float) -> None:
    """Copy source -> sink, each chunk leaving `delay` seconds after it arrived (a wire's
    propagation delay: chunks queue behind each other, none is held longer)."""
    queue: deque[tuple[float, bytes]] = deque()
    ready = threading.Condition()

    def read() -> None:
        while True:
            try:
                data = source.recv(CHUNK)
            except OSError:
                data = b""
            with ready:
                queue.append((time.perf_counter() + delay, data))
                ready.notify()
            if not data:
                return

    threading.Thread(target=read, daemon=True).start()
    while True:
        with ready:
            while not queue:
                ready.wait()
            due, data = queue.popleft()
        wait = due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        if not data:
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            return
        try:
            sink.sendall(data)
        except OSError:
            return


def _connection(client: socket.socket, target: tuple[str, int], delay: float) -> None:
    with client, socket.create_connection(target, timeout=10) as upstream:
        upstream.settimeout(None)
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        back = threading.Thread(target=_pump, args=(upstream, client, delay), daemon=True)
        back.start()
        _pump(client, upstream, delay)
        back.join()


def serve_relay(target: str, delay: float) -> None:
    host, port = target.rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"relay on 127.0.0.1:{listener.getsockname()[1]} -> {target}, "
          f"{delay * 1e6:.0f} us each way", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    listener.settimeout(1.0)  # its handler runs once the main thread wakes: echo.py's TICK
    while True:
        try:
            client, _ = listener.accept()
        except TimeoutError:
            continue
        client.settimeout(None)
        threading.Thread(target=_connection, args=(client, (host, int(port)), delay),
                         daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description="delay relay for shoal bench --network")
    parser.add_argument("command", choices=["relay"])
    parser.add_argument("--to", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--delay-us", type=int, default=round(ONE_WAY_DELAY * 1e6))
    args = parser.parse_args()
    serve_relay(args.to, args.delay_us / 1e6)


if __name__ == "__main__":
    main()
