"""The shoal-worker process itself: SIGTERM while a coordinator computes on it ends it with
status 0, every time (it used to abort with SIGABRT in about one stop in three)."""

import signal
import threading

import mlx.core as mx
import pytest

from coordinator.generate import open_remote_model
from engine.auth import load_secret
from engine.checkpoint import shard

STOPS = 6


@pytest.mark.slow
def test_sigterm_mid_compute_exits_cleanly_every_time(tiny_checkpoint, tmp_path, start_worker,
                                                      secret_file):
    sharded = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), sharded, progress=False)
    secret = load_secret(secret_file)
    codes = []
    for _ in range(STOPS):
        worker = start_worker([sharded / "experts"], "--no-advertise")
        remote = open_remote_model(sharded, [worker.address], secret)
        computed = threading.Event()
        stop = threading.Event()

        def compute(dispatcher=remote.dispatcher, computed=computed, stop=stop):
            while not stop.is_set():
                try:
                    dispatcher(0, mx.ones((1, 4, 64)), mx.array([[[0, 1]] * 4]))
                except Exception:  # the worker went away: expected, this is the test
                    return
                computed.set()

        thread = threading.Thread(target=compute, daemon=True)
        thread.start()
        assert computed.wait(30)
        worker.proc.send_signal(signal.SIGTERM)
        codes.append(worker.proc.wait(30))
        stop.set()
        thread.join(30)
        remote.close()
        assert "stopped" in worker.output()
    assert codes == [0] * STOPS
