"""The background scrub: one pass finds a file that rotted after start, that file stops
being served (the expert too, with no other copy), the pass keeps to its rate, and a real
worker started with --scrub reports the rot and stops offering the expert by itself."""

import shutil
import time

import numpy as np
import pytest

from coordinator.dataplane.link import WorkerLink
from engine.auth import load_secret
from engine.errors import InvalidInput
from engine.sharding import shard
from worker.residency import Request, Residency
from worker.scrub import Scrubber, parse_rate
from worker.store import scan_stores


@pytest.fixture
def stores(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, progress=False)
    first, second = tmp_path / "a", tmp_path / "b"
    shutil.copytree(out / "experts", first)
    shutil.copytree(out / "experts", second)
    return out, first, second


def rot(path):
    data = bytearray(path.read_bytes())
    data[-8] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_pass_finds_rot_and_stops_serving_that_file_then_that_expert(stores):
    _, first, second = stores
    problems = []
    residency = Residency(scan_stores([first, second]), report=problems.append)
    manifest = residency.scan.manifest
    try:
        scrubber = Scrubber(residency, 1 << 30)
        clean = scrubber.check_pass()
        assert clean.files == 2 * len(manifest.experts) and not clean.rotted
        name = manifest.expert(2, 6).file
        rot(first / name)
        found = scrubber.check_pass()
        assert found.rotted == [f"{first / name}: checksum does not match the manifest"]
        assert (2, 6) in residency.held()  # the copy on the other drive is intact
        assert residency.cache.copies((2, 6)) == [(1, second / name)]
        rot(second / name)
        assert len(scrubber.check_pass().rotted) == 1
        assert (2, 6) not in residency.held()
        assert any(str(second / name) in p and "scrub" in p for p in problems)
        assert any("expert 2/6 is no longer served" in p for p in problems)
        hidden = np.ones((1, 64), np.float32)
        residency.compute(Request(2, hidden, "float32", np.zeros(1, np.int32),
                                  np.array([5], np.int32)))  # the others still work
    finally:
        residency.close()


def test_a_pass_keeps_to_its_rate(stores):
    _, first, _ = stores
    residency = Residency(scan_stores([first]))
    try:
        total = residency.expert_bytes
        started = time.monotonic()
        found = Scrubber(residency, total * 2).check_pass()  # half a second at this rate
        elapsed = time.monotonic() - started
        assert found.bytes == total and not found.rotted
        assert 0.4 < elapsed < 5.0
    finally:
        residency.close()


def test_rates_are_sizes_per_second():
    assert parse_rate("32M") == 32 << 20
    assert parse_rate("1G") == 1 << 30
    for bad in ("50%", "fast", "0", "-1M"):
        with pytest.raises(InvalidInput, match="--scrub"):
            parse_rate(bad)


@pytest.mark.processes  # 1.2 s here: not slow
def test_a_worker_started_with_scrub_finds_rot_on_its_own(stores, start_worker, secret_file):
    _, first, _ = stores
    worker = start_worker([first], "--no-advertise", "--scrub", "64M")
    link = WorkerLink(worker.address, load_secret(secret_file))
    try:
        manifest = scan_stores([first], verify=False).manifest
        victim = first / manifest.expert(1, 1).file
        rot(victim)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            inventory = link.fetch_inventory()
            if (1, 1) not in {(h.layer, h.expert) for h in inventory.experts}:
                break
            time.sleep(0.2)
        held = {(h.layer, h.expert) for h in inventory.experts}
        assert (1, 1) not in held and len(held) == len(manifest.experts) - 1
        problems = link.fetch_stats().problems
        assert any(str(victim) in p and "scrub" in p for p in problems), problems
        while "scrub pass 1" not in worker.output() and time.monotonic() < deadline:
            time.sleep(0.1)  # the rot may have been found during the first pass
        assert "scrub pass 1" in worker.output()
    finally:
        link.close()
