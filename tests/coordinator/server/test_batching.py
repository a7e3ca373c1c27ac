"""The batching engine over a local mlx-lm model (no workers): the prompt cache stays within
its bytes, a cancelled request leaves at once, and a stop string ends a request early."""

import queue
import time

import pytest
from mlx_lm.utils import load_model, load_tokenizer

from coordinator.server.batching import BatchEngine, Event, Sampling

PROMPTS = [[5, 17, 42, 99, 7, 250, 33], [3, 8, 1, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    source = tiny_checkpoint("qwen3_moe")
    return load_model(source)[0], load_tokenizer(source)


def answer(engine: BatchEngine, prompt: list[int], sampling: Sampling) -> list[Event]:
    events: queue.Queue[Event] = queue.Queue()
    engine.submit(prompt, sampling, events.put)
    out = [events.get(timeout=60)]
    while out[-1].finish_reason is None and out[-1].error is None:
        out.append(events.get(timeout=60))
    return out


def test_the_prompt_cache_stays_within_its_bytes(model):
    engine = BatchEngine(*model, cache_key="m")
    try:
        answer(engine, PROMPTS[0], Sampling(max_tokens=8))
        one = engine.prompt_cache["bytes"]
    finally:
        engine.close()
    assert one > 0
    engine = BatchEngine(*model, cache_key="m", prompt_cache_bytes=int(1.5 * one))
    try:
        for prompt in PROMPTS:
            answer(engine, prompt, Sampling(max_tokens=8))
            assert engine.prompt_cache["bytes"] <= 1.5 * one
        assert engine.prompt_cache["entries"] == 1
        again = answer(engine, PROMPTS[2], Sampling(max_tokens=8))  # the one still cached
        assert again[-1].usage.cached_tokens == len(PROMPTS[2]) - 1
    finally:
        engine.close()


def test_a_cancelled_request_leaves_the_batch_at_once(model):
    engine = BatchEngine(*model, cache_key="m")
    try:
        events: queue.Queue[Event] = queue.Queue()
        handle = engine.submit(PROMPTS[0], Sampling(max_tokens=100_000), events.put)
        events.get(timeout=60)
        handle.cancel()
        deadline = time.monotonic() + 10
        while engine.in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        short = answer(engine, PROMPTS[1], Sampling(max_tokens=3))  # it goes on serving
        assert short[-1].finish_reason == "length" and short[-1].usage.completion_tokens == 3
        assert engine.stats.decode_steps < 1000
    finally:
        engine.close()


def test_a_stop_string_ends_the_request_and_is_not_emitted(model):
    engine = BatchEngine(*model, cache_key="m")
    try:
        full = "".join(e.text for e in answer(engine, PROMPTS[0], Sampling(max_tokens=16)))
        stop = full[5:7]
        assert len(stop) == 2, full
        events = answer(engine, PROMPTS[0], Sampling(max_tokens=16, stop=(stop,)))
        assert "".join(e.text for e in events) == full[: full.find(stop)]
        assert events[-1].finish_reason == "stop"
        assert events[-1].usage.completion_tokens < 16
        assert engine.in_flight == 0
    finally:
        engine.close()


def _scores(events: list[Event]) -> list:
    return [(s.token, s.logprob, s.top) for e in events for s in e.logprobs]


@pytest.mark.parametrize("family,bits", [("qwen3_moe", None), ("deepseek_v3", 4)])
def test_rows_joining_a_running_batch_equal_themselves_alone(family, bits, tiny_checkpoint):
    """Three prompts of different lengths submitted while a long request decodes (so they
    join a batch left-padded to its length), leaving at different steps: every token and
    every top-5 log-probability equals the same request on an engine of its own."""
    source = tiny_checkpoint(family, quantize_bits=bits)
    model, tokenizer = load_model(source)[0], load_tokenizer(source)
    lengths = [40, 12, 25, 6]
    prompts = [[9, 4, 7, 1, 30, 22, 8, 61, 5, 5, 3], *PROMPTS]
    alone = []
    for prompt, n in zip(prompts, lengths, strict=True):
        engine = BatchEngine(model, tokenizer, cache_key="alone")
        try:
            alone.append(_scores(answer(engine, prompt, Sampling(max_tokens=n,
                                                                 top_logprobs=5))))
        finally:
            engine.close()
    engine = BatchEngine(model, tokenizer, cache_key="together")
    try:
        queues: list[queue.Queue[Event]] = [queue.Queue() for _ in prompts]
        engine.submit(prompts[0], Sampling(max_tokens=lengths[0], top_logprobs=5),
                      queues[0].put)
        first = [queues[0].get(timeout=60)]
        for i in range(1, len(prompts)):
            engine.submit(prompts[i], Sampling(max_tokens=lengths[i], top_logprobs=5),
                          queues[i].put)
        together = []
        for i, q in enumerate(queues):
            events = first if i == 0 else [q.get(timeout=60)]
            while events[-1].finish_reason is None and events[-1].error is None:
                events.append(q.get(timeout=60))
            together.append(_scores(events))
        assert engine.stats.widest_step == len(prompts)
    finally:
        engine.close()
    for i in range(len(prompts)):
        assert together[i] == alone[i], i
        assert len(together[i]) == lengths[i]


def test_rows_with_their_own_processors_leave_the_others_bits_alone(model):
    """A row held to a JSON grammar and a row with a repetition penalty share the batch with
    two plain rows: the plain rows' tokens and log-probabilities equal themselves alone, the
    constrained row's answer is JSON, and each special row equals itself alone."""
    from coordinator.server.grammars import response_format_grammar

    grammar = response_format_grammar({"type": "json_object"})
    [close] = model[1].encode("}")
    settings = [Sampling(max_tokens=12, top_logprobs=3),
                Sampling(max_tokens=12, top_logprobs=3, grammar=grammar,
                         logit_bias=((close, 30.0),)),  # "}" first: the object closes
                Sampling(max_tokens=12, top_logprobs=3, repetition_penalty=1.5),
                Sampling(max_tokens=9, top_logprobs=3)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    alone = []
    for prompt, sampling in zip(prompts, settings, strict=True):
        engine = BatchEngine(*model, cache_key="alone")
        try:
            alone.append(answer(engine, prompt, sampling))
        finally:
            engine.close()
    engine = BatchEngine(*model, cache_key="together")
    try:
        queues: list[queue.Queue[Event]] = [queue.Queue() for _ in prompts]
        for prompt, sampling, q in zip(prompts, settings, queues, strict=True):
            engine.submit(prompt, sampling, q.put)
        together = []
        for q in queues:
            events = [q.get(timeout=60)]
            while events[-1].finish_reason is None and events[-1].error is None:
                events.append(q.get(timeout=60))
            together.append(events)
        assert engine.stats.widest_step == len(prompts)
    finally:
        engine.close()
    for i in range(len(prompts)):
        assert _scores(together[i]) == _scores(alone[i]), i
    assert "".join(e.text for e in together[1]) == "{}"
    assert "".join(e.text for e in alone[0]) != "".join(e.text for e in alone[2])
