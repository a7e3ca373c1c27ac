"""The scaling benchmark's member limits: a real cgroup that a real process joins, with the
read limit on the store's disk; and which member holds which expert file."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.scale_members import holders_of
from benchmarks.stream_limits import CGROUP_ROOT, MemberLimits, block_device
from engine.sharding import shard

needs_cgroups = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0 or not (CGROUP_ROOT / "memory").is_dir(),
    reason="cgroup limits need Linux, root and cgroup v1 here")


@needs_cgroups
def test_a_member_process_runs_inside_its_memory_and_read_limits(tmp_path):
    device = block_device(tmp_path)
    assert device.count(":") == 1 and all(part.isdigit() for part in device.split(":"))
    limits = MemberLimits(f"shoal-test-{os.getpid()}", 256 << 20, 5_000_000, device)
    try:
        assert "cgroup v1 memory.limit_in_bytes" in limits.kinds and not limits.missing
        out = subprocess.run(limits.wrap(["cat", "/proc/self/cgroup"]), capture_output=True,
                             text=True, timeout=30, check=True).stdout
        assert f"memory:/shoal-test-{os.getpid()}" in out
        if limits.blkio is not None:
            assert f"blkio:/shoal-test-{os.getpid()}" in out
            rule = (limits.blkio / "blkio.throttle.read_bps_device").read_text().split()
            assert rule == [device, "5000000"]
            assert limits.bytes_read() is not None
    finally:
        limits.close()
    assert not any(group.exists() for group in limits.groups)


def test_holders_follow_the_store_folders(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, workers=2, progress=False)
    holders = holders_of(out, 2)
    files = {f"member-{i}": len(list(Path(out, f"worker-{i}").glob("L*/E*.safetensors")))
             for i in range(2)}
    assert sum(files.values()) == len(holders) > 0
    assert all(len(names) == 1 for names in holders.values())
    assert {name: sum(n == (name,) for n in holders.values()) for name in files} == files
