"""Prefill pieces sized by time: the pacer's rule over plain numbers, and the batching engine
over a local tiny model, where a long prompt arriving beside running streams is computed in
pieces of about two of their decode steps, and whole when it comes alone."""

import queue
import statistics
import threading

import pytest
from mlx_lm.utils import load_model, load_tokenizer

from coordinator.server.batching import BatchEngine, Event, Sampling
from coordinator.server.prefill_pacing import FIRST_PIECE, REFRESH, WHOLE, PrefillPacer
from tests.coordinator.server.engine_runs import tokens_of


def run_pacer(pacer: PrefillPacer, cost, decode: float, prompt: int) -> list[tuple[int, float]]:
    """Feed the pacer a prompt of `prompt` tokens beside running streams whose decode step
    costs `decode` seconds, a piece of n tokens at context c costing cost(n, c): the pieces."""
    done, pieces = 0, []
    while done < prompt:
        n = min(pacer.next_piece(streams=True), prompt - done)
        seconds = cost(n, done)
        pacer.observe(step_seconds=decode, decode_steps=1, prompt_tokens=0, streams=True)
        pacer.observe(step_seconds=decode + seconds, decode_steps=1, prompt_tokens=n,
                      streams=True)
        pieces.append((n, seconds))
        done += n
    return pieces


@pytest.mark.parametrize("fixed,per_token,per_context", [
    (0.002, 0.0005, 0.0), (0.0, 0.002, 0.0), (0.004, 0.0002, 2e-7), (0.011, 0.001, 0.0)])
def test_pieces_settle_at_about_two_decode_steps_whatever_a_piece_costs(
        fixed, per_token, per_context):
    pacer = PrefillPacer()
    decode = 0.006
    pieces = run_pacer(pacer, lambda n, c: fixed + per_token * n + per_context * n * c,
                       decode, 4096)
    assert pieces[0][0] == FIRST_PIECE
    settled = pieces[8:-1]  # after the first few, the prompt's last (short) piece aside
    assert settled, pieces
    for n, seconds in settled:
        # a piece costs at most about two decode steps, and is not made needlessly small
        assert seconds <= 2.2 * decode, (n, seconds)
        assert seconds >= 0.8 * decode or n == 1, (n, seconds)


def test_alone_a_prompt_goes_whole_and_the_cap_holds_beside_streams():
    pacer = PrefillPacer(most=64)
    assert pacer.next_piece(streams=False) == WHOLE
    pieces = run_pacer(pacer, lambda n, c: 1e-5 * n, 0.01, 2048)  # pieces are cheap here
    assert max(n for n, _ in pieces) == 64
    # a prompt alone says nothing about the piece beside streams
    pacer.observe(step_seconds=5.0, decode_steps=0, prompt_tokens=4096, streams=False)
    assert pacer.next_piece(streams=True) == 64


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    source = tiny_checkpoint("qwen3_moe")
    return load_model(source)[0], load_tokenizer(source)


LONG = [(13 * i + 7) % 290 + 5 for i in range(1500)]


def test_a_long_prompt_beside_running_streams_is_prefilled_in_paced_pieces(model):
    engine = BatchEngine(*model, cache_key="alone", prefill_step_size=256)
    try:
        alone = tokens_of(engine, LONG, 4)
        whole = list(engine.pacer.pieces)
    finally:
        engine.close()
    assert [p.streams for p in whole] == [False] and whole[0].tokens == len(LONG) - 1

    engine = BatchEngine(*model, cache_key="beside", prefill_step_size=256)
    stop = threading.Event()
    counts = [0, 0]

    def stream(i: int) -> None:
        events: queue.Queue[Event] = queue.Queue()
        handle = engine.submit([3 + i, 8, 1, 2], Sampling(max_tokens=100_000, top_logprobs=0),
                               events.put)  # logprobs: an event for every token
        while not stop.is_set():
            event = events.get(timeout=120)
            assert event.error is None
            counts[i] += len(event.logprobs)
        handle.cancel()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        while min(counts) < 20:  # each thread's get() is bounded: a stuck engine fails it
            threads[0].join(0.05)
            assert all(t.is_alive() for t in threads)
        before, seen = list(counts), len(engine.pacer.pieces)
        beside = tokens_of(engine, LONG, 4)
        during = [c - b for c, b in zip(counts, before, strict=True)]
        pieces = list(engine.pacer.pieces)[seen:]
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        engine.close()
    assert beside == alone  # greedy, as alone: the pieces change when, not what
    assert all(p.streams for p in pieces) and sum(p.tokens for p in pieces) == len(LONG) - 1
    assert len(pieces) >= 8, [p.tokens for p in pieces]  # never one long stall
    # every piece came between two decode steps: each stream had a token for each piece
    assert min(during) >= len(pieces) - 1, (during, len(pieces))
    # pieces grow or shrink by at most 2x a step, from a first small one: never a whole prompt
    # (the budget follows the decode step, re-measured as the machine's load changes it)
    sizes = [p.tokens for p in pieces[:-1]]
    assert sizes[0] == FIRST_PIECE and max(sizes) <= len(LONG) // 4, sizes
    jumps = [(a, b) for a, b in zip(sizes, sizes[1:], strict=False)
             if b > 2 * a or 2 * b + 1 < a]
    assert not jumps, (jumps, sizes)
    # and a step with a piece (a gap of the streams) took a few decode steps, not the hundred
    # a fixed 256-token piece takes here: the bound is loose, for a machine whose load changes
    # between the decode steps measured before the prompt and the pieces (the pacer's target,
    # three, is benchmarks/long_prompts.py's figure)
    settled = pieces[6:-1]
    assert statistics.median(p.step_seconds for p in settled) <= 8 * statistics.median(
        p.decode_seconds for p in settled), [(p.tokens, p.step_seconds, p.decode_seconds)
                                             for p in settled]


def test_beside_streams_every_few_pieces_a_step_only_decodes_and_remeasures_the_budget():
    pacer = PrefillPacer()
    pacer.observe(step_seconds=0.006, decode_steps=1, prompt_tokens=0, streams=True)
    planned = []
    for _ in range(2 * REFRESH + 2):
        n = pacer.next_piece(streams=True)
        planned.append(n)
        # the load doubled the decode step since it was measured: only a step without a
        # piece shows it
        pacer.observe(step_seconds=0.012 + 0.0005 * n, decode_steps=1, prompt_tokens=n,
                      streams=True)
    assert planned[REFRESH] == 0 and planned[2 * REFRESH + 1] == 0, planned
    assert all(planned[:REFRESH]) and pacer.decode_step > 0.007
    assert pacer.next_piece(streams=False) == WHOLE
