"""A prompt pass goes to each worker as pieces (coordinator/dataplane/dispatch.py: PIECE_PAIRS); a
worker killed after answering some of its pieces is routed around like any lost worker, and
the pass's output is the one every worker up gives, bit for bit. A worker that streams experts
from its drives gets its share whole."""

import mlx.core as mx
import pytest

from coordinator.decoding.generate import open_remote_model
from coordinator.ops.local_processes import start_workers, stop_workers
from engine.auth import load_secret
from engine.sharding import shard

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 99, 7, 250, 33, 64, 128, 12, 3, 77]


def test_a_worker_lost_between_the_pieces_of_a_prompt_pass_is_routed_around(
        replicated_stores, secret_file, tmp_path):
    sharded, stores = replicated_stores
    workers = start_workers([[s] for s in stores], secret_file, tmp_path / "logs", forked=True)
    remote = None
    try:
        remote = open_remote_model(sharded, [w.address for w in workers],
                                   load_secret(secret_file))
        dispatcher = remote.dispatcher
        dispatcher.piece_pairs = 2
        expected = remote.model(mx.array([PROMPT]))
        mx.eval(expected)
        assert dispatcher.stats.worker_requests[workers[1].address] > 0, "worker 1 unused"

        link = dispatcher.cluster.links[1]
        receive, replies = link.receive, []

        def receive_then_die(timeout: float, lane: int = 0) -> bytes:
            data = receive(timeout, lane)
            replies.append(data)
            if len(replies) == 1:  # its first piece answered: the others never will be
                workers[1].proc.kill()
                workers[1].proc.wait(10)
            return data

        link.receive = receive_then_die
        dispatcher.stats.reset()
        again = remote.model(mx.array([PROMPT]))
        assert len(replies) >= 1 and workers[1].proc.poll() is not None
        assert mx.array_equal(again, expected)
        dispatcher.stats.reset()  # worker 1 holds nothing now: every piece goes to worker 0
        assert mx.array_equal(remote.model(mx.array([PROMPT])), expected)
        assert set(dispatcher.stats.worker_requests) == {workers[0].address}
    finally:
        if remote is not None:
            remote.close()
        stop_workers(workers)


def test_a_worker_that_streams_from_its_drives_gets_its_share_whole(
        tiny_checkpoint, secret_file, tmp_path, start_worker):
    # Each piece would read again from the drives what a small cache could not keep.
    sharded = tmp_path / "sharded"
    shard(tiny_checkpoint("qwen3_moe"), sharded, workers=2, progress=False)
    workers = [start_worker([sharded / "worker-0"]),
               start_worker([sharded / "worker-1"], "--memory-budget", "10%")]
    remote = open_remote_model(sharded, [w.address for w in workers], load_secret(secret_file))
    try:
        dispatcher = remote.dispatcher
        dispatcher.piece_pairs = 0
        whole = remote.model(mx.array([PROMPT]))
        mx.eval(whole)
        dispatcher.piece_pairs = 2
        dispatcher.stats.reset()
        pieced = remote.model(mx.array([PROMPT]))
        assert mx.array_equal(pieced, whole)
        calls = dispatcher.stats.prefill.calls
        requests = dispatcher.stats.worker_requests
        assert requests[workers[0].address] > calls  # in memory: in pieces
        assert 0 < requests[workers[1].address] <= calls  # streams: one request a call
    finally:
        remote.close()
