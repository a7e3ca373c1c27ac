"""Forked local workers behave as launched ones: they serve, report a failed start with the
daemon's own message, and stop by PID."""

import pytest

from coordinator.ops.local_processes import start_worker
from engine.errors import ShoalError
from engine.sharding import shard


def test_a_forked_worker_serves_and_stops(tiny_checkpoint, tmp_path, secret_file):
    shard(tiny_checkpoint("qwen3_moe"), tmp_path / "sharded", workers=1, progress=False)
    worker = start_worker([tmp_path / "sharded" / "worker-0"], secret_file,
                          tmp_path / "worker.log", ("--no-advertise",), forked=True)
    try:
        assert worker.address.startswith("127.0.0.1:")
        assert "serving 24 experts" in worker.output()
    finally:
        worker.stop()
    assert worker.proc.poll() == 0


def test_a_forked_worker_that_fails_to_start_says_why(tmp_path, secret_file):
    message = r"exited with status 2:\nshoal-worker: error: .*no-such-store does not exist"
    with pytest.raises(ShoalError, match=message):
        start_worker([tmp_path / "no-such-store"], secret_file, tmp_path / "worker.log",
                     ("--no-advertise",), forked=True)


def test_a_forked_worker_takes_no_command_prefix(tmp_path, secret_file):
    with pytest.raises(ShoalError, match="cannot run through a command prefix"):
        start_worker([tmp_path], secret_file, tmp_path / "worker.log",
                     prefix=("ip", "netns", "exec", "x"), forked=True)
