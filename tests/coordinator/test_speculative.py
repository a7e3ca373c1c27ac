"""Adaptive drafting as pure functions of what the steps showed, and the draft options of
`shoal generate` as a user meets them."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.decoding.draft_policy import (
    Acceptance,
    DraftPolicy,
    draft_count,
    next_draft,
    observe,
)
from engine.errors import InvalidInput
from engine.sharding import shard

REPO = Path(__file__).resolve().parents[2]


def run_steps(policy: DraftPolicy, accept: float, tokens: int, *, step_cost: float = 0.1):
    """Simulate a draft whose tokens are each accepted with chance `accept` (seeded), with a
    drafting step costing 1 + step_cost * n plain steps. Returns the N chosen at each step."""
    rng = random.Random(0)
    state, made, chosen = Acceptance(), 0, []
    while made < tokens:
        n = next_draft(policy, state)
        chosen.append(n)
        accepted = 0
        while accepted < n and rng.random() < accept:
            accepted += 1
        seconds = None if made == 0 else 1.0 + step_cost * n  # the first also read the prompt
        state = observe(policy, state, n, accepted, seconds)
        made += accepted + 1
    return chosen


def test_a_good_draft_grows_to_the_most_tokens_allowed():
    chosen = run_steps(DraftPolicy(max_draft=6), accept=1.0, tokens=120)
    assert chosen[0] == 1  # starts small
    assert chosen[1] == 0  # then times one plain step
    assert chosen[-5:] == [6] * 5
    assert chosen.count(0) <= 1 + len(chosen) // 32  # a plain step to time now and then


def test_a_useless_draft_is_stopped_within_a_few_steps_and_probed_ever_less():
    policy = DraftPolicy(max_draft=6)
    chosen = run_steps(policy, accept=0.0, tokens=600)
    first_stop = chosen.index(0)
    assert first_stop <= 3
    probes = [i for i in range(first_stop, len(chosen)) if chosen[i] > 0]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] >= 2 * gaps[0]  # the wait doubles
    assert sum(chosen) <= 12  # drafted tokens over 600 generated


def test_a_draft_that_costs_more_than_it_saves_is_stopped():
    # 80% accepted, but each drafted token costs as much as a plain step (a slow draft).
    slow = run_steps(DraftPolicy(max_draft=3), accept=0.8, tokens=200, step_cost=1.0)
    assert sum(slow[10:]) <= 4, slow  # probes only
    cheap = run_steps(DraftPolicy(max_draft=3), accept=0.8, tokens=200, step_cost=0.1)
    assert sum(cheap[10:]) >= 2 * (len(cheap) - 10), cheap


def test_n_follows_acceptance():
    policy = DraftPolicy(max_draft=8)
    # alpha is (accepted + 1) / (accepted + rejected + 2)
    assert draft_count(policy, Acceptance(accepted=8, rejected=0)) == 8  # 0.9**8 = 0.43
    assert draft_count(policy, Acceptance(accepted=3, rejected=1)) == 3  # 0.67**3 = 0.30
    assert draft_count(policy, Acceptance(accepted=1, rejected=1)) == 1  # 0.5
    assert draft_count(policy, Acceptance(accepted=0, rejected=3)) == 0  # 0.2 <= 0.25


def test_a_fixed_draft_never_changes():
    policy = DraftPolicy(max_draft=4, adaptive=False)
    assert run_steps(policy, accept=0.0, tokens=40) == [4] * 40


def test_the_number_of_draft_tokens_is_checked():
    with pytest.raises(InvalidInput, match="between 1 and 64"):
        DraftPolicy(max_draft=0)


def shoal(*args: str):
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def test_draft_options_are_checked_before_anything_loads(tmp_path):
    common = ("generate", "hi", "--model", str(tmp_path / "none"), "--workers", "127.0.0.1:1")
    run = shoal(*common, "--num-draft-tokens", "3")
    assert run.returncode == 2 and "need --draft or --draft-model" in run.stderr
    run = shoal(*common, "--draft", "mtp", "--draft-model", str(tmp_path))
    assert run.returncode == 2 and "not allowed with argument" in run.stderr
    run = shoal(*common, "--draft", "mtp", "--kv-bits", "4")
    assert run.returncode == 2 and "--kv-bits and a draft" in run.stderr
    run = shoal(*common, "--draft-model", str(tmp_path / "missing"))
    assert run.returncode == 2 and "not a model folder" in run.stderr
    run = shoal(*common, "--draft-model", str(tmp_path), "--num-draft-tokens", "0")
    assert run.returncode == 2 and "between 1 and 64" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.slow
def test_generate_with_a_draft_reports_what_it_proposed(
    tiny_checkpoint, start_worker, secret_file, tmp_path
):
    source = tiny_checkpoint("mixtral")
    sharded = tmp_path / "out"
    shard(source, sharded, workers=2, progress=False)
    workers = ",".join(start_worker([sharded / f"worker-{k}"]).address for k in range(2))
    common = ("generate", "hello world", "--model", str(sharded), "--workers", workers,
              "--secret-file", str(secret_file), "--max-tokens", "12")
    plain = json.loads(shoal(*common, "--json").stdout)
    run = shoal(*common, "--json", "--draft-model", str(source), "--num-draft-tokens", "4",
                "--fixed-draft")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["token_ids"] == plain["token_ids"]
    spec = report["speculative"]
    assert spec["proposed"] > 0 and spec["accepted"] == spec["proposed"]  # its own weights
    assert spec["acceptance_rate"] == 1.0 and spec["tokens_per_step"] == pytest.approx(
        len(report["token_ids"]) / spec["verify_steps"], rel=0.2)
    for key in ("verify_steps", "plain_steps", "decode_tps", "draft_changes"):
        assert key in spec

    run = shoal(*common, "--stats", "--draft-model", str(source))
    assert run.returncode == 0, run.stderr
    assert "draft: proposed" in run.stderr and "adaptive drafting: from token 0" in run.stderr


def test_catching_up_gives_the_draft_the_context_it_missed(tiny_checkpoint):
    """After drafting was stopped, the draft reads what it missed and then predicts as if it
    had read everything; when it missed more than the window, it starts on the window."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from coordinator.decoding.speculative import catch_up

    model, _ = load(str(tiny_checkpoint("qwen3_moe")))
    history = [(7 * i + 11) % 290 + 5 for i in range(40)]

    def next_logits(cache: list, token: int) -> mx.array:
        return model(mx.array([[token]]), cache=cache)[0, -1]

    reference = make_prompt_cache(model)
    model(mx.array([history[:30]]), cache=reference)
    expected = next_logits(reference, history[30])

    behind = make_prompt_cache(model)
    model(mx.array([history[:22]]), cache=behind)  # drafting stopped after 22 tokens
    cache, start = catch_up(model, behind, 0, history, 30, window=16)
    assert (start, cache[0].offset) == (0, 30) and cache is behind
    assert mx.allclose(next_logits(cache, history[30]), expected, atol=1e-5)

    far = make_prompt_cache(model)
    model(mx.array([history[:5]]), cache=far)
    cache, start = catch_up(model, far, 0, history, 30, window=16)
    assert (start, cache[0].offset) == (14, 16) and cache is not far
    fresh = make_prompt_cache(model)
    model(mx.array([history[14:30]]), cache=fresh)
    assert mx.allclose(next_logits(cache, history[30]), next_logits(fresh, history[30]))
