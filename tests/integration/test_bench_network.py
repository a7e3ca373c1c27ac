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
        if server is not None:
            server.terminate()
            server.wait(10)
        net.close()
    assert cable.netns not in namespaces()


def test_the_option_refuses_clearly_where_it_cannot_work(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(ShoalError, match="run it as root"):
        ThunderboltNetwork.build(1)
