"""A long prompt beside running streams over two real workers (`shoal serve`'s engine): each
step's decode and prompt piece make every MoE layer's call together, every stream's tokens and
the prompt's are those each gets without the other, and a step with a piece stays a few decode
steps long."""

import queue
import statistics
import threading
from collections.abc import Iterator

import pytest

from coordinator.dataplane.merged_calls import MergedCalls
from coordinator.decoding.generate import RemoteModel, open_remote_model
from coordinator.ops.local_processes import start_workers, stop_workers
from coordinator.server.batching import BatchEngine, Event, Sampling
from engine.auth import load_secret
from engine.sharding import shard
from tests.coordinator.server.engine_runs import tokens_of

LONG = [(13 * i + 7) % 290 + 5 for i in range(1500)]
STREAMS = [[3, 8, 1, 2], [4, 8, 1, 2]]


@pytest.fixture(scope="module")
def remote(tiny_checkpoint, tmp_path_factory, secret_file) -> Iterator[RemoteModel]:
    root = tmp_path_factory.mktemp("beside")
    shard(tiny_checkpoint("qwen3_moe"), root / "sharded", workers=2, progress=False)
    workers = start_workers([[root / "sharded" / f"worker-{k}"] for k in range(2)],
                            secret_file, root / "logs", forked=True)
    opened = None
    try:
        opened = open_remote_model(root / "sharded", [w.address for w in workers],
                                   load_secret(secret_file))
        yield opened
    finally:
        if opened is not None:
            opened.close()
        stop_workers(workers)


def engine_of(remote: RemoteModel, name: str) -> BatchEngine:
    """The engine as `shoal serve` builds it: the dispatcher merges its forwards' calls."""
    merged = remote.dispatcher.merged = MergedCalls()
    return BatchEngine(remote.model, remote.tokenizer, cache_key=name, prefill_step_size=256,
                       merged=merged)


def test_a_piece_and_the_decode_step_share_each_layer_call_and_change_no_token(remote):
    engine = engine_of(remote, "beside")
    merged = engine.merged
    stop = threading.Event()
    streamed: list[list[int]] = [[] for _ in STREAMS]

    def stream(i: int) -> None:
        events: queue.Queue[Event] = queue.Queue()
        handle = engine.submit(STREAMS[i], Sampling(max_tokens=100_000, top_logprobs=0),
                               events.put)  # logprobs: an event for every token
        while not stop.is_set():
            event = events.get(timeout=120)
            assert event.error is None
            streamed[i] += [s.token for s in event.logprobs]
        handle.cancel()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(STREAMS))]
    try:
        for t in threads:
            t.start()
        while min(map(len, streamed)) < 20:  # each get() is bounded: a stuck engine fails it
            threads[0].join(0.05)
            assert all(t.is_alive() for t in threads)
        seen, merged_before = len(engine.pacer.pieces), merged.merged
        beside = tokens_of(engine, LONG, 4)
        pieces = list(engine.pacer.pieces)[seen:]
        merged_calls = merged.merged - merged_before
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        engine.close()
    assert not any(t.is_alive() for t in threads)

    engine = engine_of(remote, "alone")
    try:
        alone = tokens_of(engine, LONG, 4)
        streams_alone = [tokens_of(engine, prompt, len(got))
                         for prompt, got in zip(STREAMS, streamed, strict=True)]
    finally:
        engine.close()
    # greedy: the same tokens whether the piece rode with the decode step or not
    assert beside == alone
    for got, want in zip(streamed, streams_alone, strict=True):
        assert got == want
    # every piece but the first (the step that admits the prompt, as mlx-lm runs it) went
    # with the decode step: one call a MoE layer for both
    layers = len(remote.manifest.layers)
    assert len(pieces) >= 8 and all(p.streams for p in pieces), [p.tokens for p in pieces]
    assert merged_calls == layers * (len(pieces) - 1), (merged_calls, layers, len(pieces))
    # a step with a piece costs its decode step and about two more (the pacer's budget): a
    # bound loose enough for a loaded machine, whose load changes between the measurements
    settled = pieces[6:-1]
    assert statistics.median(p.step_seconds for p in settled) <= 6 * statistics.median(
        p.decode_seconds for p in settled), [(p.tokens, p.step_seconds, p.decode_seconds)
                                             for p in settled]
