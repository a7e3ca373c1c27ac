"""The Thunderbolt-like network of `shoal bench --network thunderbolt`: a worker-side echo in
its own namespace answers through the delay relay, every round trip takes at least the 0.4 ms
the relay adds, and closing removes the namespaces. Needs root and iproute2, as CI has."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.echo import round_trips
from benchmarks.network import ONE_WAY_DELAY, ThunderboltNetwork
from coordinator.ops.local_processes import stop_process
from engine.errors import ShoalError

# the cables take 10.213.0.0/16 on the host, as `shoal bench --network thunderbolt` does: one
# at a time (test_bench_smoke's thunderbolt run is in this group too)
pytestmark = pytest.mark.xdist_group("host-network")

REPO = Path(__file__).resolve().parents[2]


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          timeout=30).stdout


def test_round_trips_through_the_cable_take_at_least_the_added_delay(tmp_path):
    net = ThunderboltNetwork.build(1)
    server = None
    try:
        cable = net.cables[0]
        assert cable.netns in namespaces()
        log = tmp_path / "echo.log"
        with open(log, "w") as out:
            server = subprocess.Popen(
                [*cable.prefix(), sys.executable, "-m", "benchmarks.echo", "serve", "--host",
                 cable.address, "--reply-bytes", "16384"],
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
            )
        deadline = time.monotonic() + 60
        while not (match := re.search(r"on (\S+:\d+)", log.read_text())):
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        address = match.group(1)
        assert address.startswith(cable.address)

        delayed = round_trips([net.relay(address)], 4096, 30, warmup=5)
        assert delayed >= 2 * ONE_WAY_DELAY  # the relay holds each chunk, both ways
        round_trips([address], 4096, 5, warmup=1)  # the cable alone carries it too (or raises)
    finally:
        try:
            if server is not None:
                stop_process(server, 30)
        finally:
            net.close()  # whatever the echo did: a namespace left behind takes the addresses
    assert cable.netns not in namespaces()


def dead_pid() -> int:
    """A process id no process has now (one that ran and was reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60)
    return int(done.stdout)


def test_a_namespace_left_by_a_killed_run_is_removed_and_one_in_use_is_named(tmp_path):
    """A run killed before its close() leaves its namespace and the host's 10.213.0.1 behind:
    the next build removes it (else its packets go to the dead namespace). An address the
    build cannot account for is refused with its interface named."""
    left = f"shtb{dead_pid()}"
    run = ["ip", "netns", "add", f"{left}-w0"], \
          ["ip", "link", "add", f"{left}w0", "type", "veth", "peer", "name", "eth0", "netns",
           f"{left}-w0"], \
          ["ip", "addr", "add", "10.213.0.1/30", "dev", f"{left}w0"]
    for command in run:
        subprocess.run(command, check=True, capture_output=True, timeout=30)
    net = ThunderboltNetwork.build(1)
    try:
        assert f"{left}-w0" not in namespaces() and net.cables[0].netns in namespaces()
    finally:
        net.close()
    foreign = "shoaltest0"  # not a name the builds make: refused, not removed
    subprocess.run(["ip", "link", "add", foreign, "type", "veth", "peer", "name", "shoaltest1"],
                   check=True, timeout=30)
    try:
        subprocess.run(["ip", "addr", "add", "10.213.5.1/30", "dev", foreign], check=True,
                       timeout=30)
        with pytest.raises(ShoalError, match=f"already on {foreign} .10.213.5.1/30"):
            ThunderboltNetwork.build(1)
    finally:
        subprocess.run(["ip", "link", "del", foreign], capture_output=True, timeout=30)
    assert "shtb" not in namespaces()


def test_the_option_refuses_clearly_where_it_cannot_work(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(ShoalError, match="run it as root"):
        ThunderboltNetwork.build(1)
