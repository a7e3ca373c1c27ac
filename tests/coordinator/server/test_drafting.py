"""The batching engine with a draft, over a local mlx-lm model (no workers): a stream decoding
alone goes through the draft and back into the batch when another comes, and every text
equals the engine's without a draft (leaving, rejoining, rejoining and alone again at once,
a stop string, a draft always right and one never)."""

import queue
import time

import pytest
from mlx_lm.utils import load, load_model, load_tokenizer

from builders.synthetic import build_random_draft
from coordinator.decoding.draft_policy import DraftPolicy
from coordinator.decoding.speculative import Draft
from coordinator.server.batching import BatchEngine, Event, Handle, Sampling
from coordinator.server.drafting import Drafting, may_draft

PROMPTS = [[5, 17, 42, 99, 7, 250, 33], [3, 8, 1, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
LONG = 40
LONGER = 150  # a stream still decoding when the others come


def until_alone_with_the_draft(drafting: Drafting) -> None:
    deadline = time.monotonic() + 30
    while drafting.solo_uid is None:
        assert time.monotonic() < deadline, "no stream left the batch for the draft"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    source = tiny_checkpoint("qwen3_moe")
    return load_model(source)[0], load_tokenizer(source)


@pytest.fixture(scope="module")
def drafts(tiny_checkpoint, tmp_path_factory):
    """name -> draft model: the target's own weights (always right) and a random one."""
    source = tiny_checkpoint("qwen3_moe")
    random_dir = build_random_draft(tmp_path_factory.mktemp("random-draft"), source)
    return {"right": load(str(source))[0], "random": load(str(random_dir))[0]}


class Answer:
    def __init__(self, engine: BatchEngine, prompt: list[int], sampling: Sampling) -> None:
        self.events: queue.Queue[Event] = queue.Queue()
        self.handle: Handle = engine.submit(prompt, sampling, self.events.put)
        self.got: list[Event] = []

    def first(self) -> None:
        self.got.append(self.events.get(timeout=60))

    def text(self) -> str:
        while not self.got or (self.got[-1].finish_reason is None and self.got[-1].error is None):
            self.got.append(self.events.get(timeout=60))
        assert self.got[-1].error is None, self.got[-1].error
        return "".join(e.text for e in self.got)


def plain_texts(model, sampling: Sampling) -> list[str]:
    engine = BatchEngine(*model, cache_key="plain")
    try:
        return [Answer(engine, p, sampling).text() for p in PROMPTS]
    finally:
        engine.close()


def drafted(model, draft_model) -> tuple[BatchEngine, Drafting]:
    drafting = Drafting(model[0], Draft(draft_model, DraftPolicy(3, adaptive=False)),
                        model[1].eos_token_ids)
    return BatchEngine(*model, cache_key="drafted", drafting=drafting), drafting


@pytest.mark.parametrize("name", ["right", "random"])
def test_streams_leaving_and_rejoining_the_batch_keep_their_text(model, drafts, name):
    sampling, longer = Sampling(max_tokens=LONG), Sampling(max_tokens=LONGER)
    plain = plain_texts(model, sampling)
    plain_longer = plain_texts(model, longer)[0]
    engine, drafting = drafted(model, drafts[name])
    try:
        assert [Answer(engine, p, sampling).text() for p in PROMPTS] == plain  # each alone
        first = Answer(engine, PROMPTS[0], longer)
        until_alone_with_the_draft(drafting)
        others = [Answer(engine, p, sampling) for p in PROMPTS[1:]]
        assert [first.text(), *(a.text() for a in others)] == [plain_longer, *plain[1:]]
    finally:
        engine.close()
    stats = drafting.stats
    assert stats.solo_runs >= len(PROMPTS) + 1 and stats.proposed > 0
    if name == "right":
        assert stats.accepted == stats.proposed and stats.tokens_per_step > 1


def test_a_stream_rejoining_and_alone_again_at_once_keeps_its_text(model, drafts):
    sampling = Sampling(max_tokens=LONGER)
    plain = plain_texts(model, sampling)
    engine, drafting = drafted(model, drafts["right"])
    try:
        first = Answer(engine, PROMPTS[0], sampling)
        until_alone_with_the_draft(drafting)
        # it rejoins for the newcomer, which leaves before the batch has read its last token
        Answer(engine, PROMPTS[1], sampling).handle.cancel()
        assert first.text() == plain[0]
    finally:
        engine.close()


def test_a_stop_string_ends_a_stream_decoding_with_the_draft(model, drafts):
    whole = plain_texts(model, Sampling(max_tokens=LONG))[0]
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    sampling = Sampling(max_tokens=LONG, stop=(stop,))
    engine, drafting = drafted(model, drafts["right"])
    try:
        answer = Answer(engine, PROMPTS[0], sampling)
        assert answer.text() == plain_texts(model, sampling)[0]
        assert answer.got[-1].stop == stop
    finally:
        engine.close()
    assert drafting.stats.tokens > 0


def test_a_request_that_turns_drafts_off_decodes_in_the_batch(model, drafts):
    sampling = Sampling(max_tokens=LONG, speculative=False)
    engine, drafting = drafted(model, drafts["right"])
    try:
        assert Answer(engine, PROMPTS[0], sampling).text() == plain_texts(model, sampling)[0]
    finally:
        engine.close()
    assert drafting.stats.tokens == 0 and drafting.stats.solo_runs == 0


def test_only_requests_without_processors_or_seed_may_draft():
    assert may_draft(Sampling(max_tokens=1))
    assert may_draft(Sampling(max_tokens=1, temperature=0.7))
    for refused in (dict(speculative=False), dict(seed=3), dict(logit_bias=((1, 2.0),)),
                    dict(repetition_penalty=1.1), dict(grammar="start: 'a'")):
        assert not may_draft(Sampling(max_tokens=1, **refused)), refused
