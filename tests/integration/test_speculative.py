"""Speculative decoding over real workers: greedy ids with a draft model equal those without,
whether the draft always agrees (the target's own checkpoint, loaded whole) or never (a random
model with the same tokenizer), for N = 1, 3 and 6, on three MoE families and 1 to 3 workers;
and every verification step's N+1 rows travel as one request per worker per MoE layer.

Workers are started once per (family, worker count) and reused by every case of this module.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest
from mlx_lm.utils import load

from builders.synthetic import build_random_draft
from coordinator.decoding.draft_policy import DraftPolicy
from coordinator.decoding.generate import RemoteModel, generate, open_remote_model
from coordinator.decoding.speculative import Draft
from coordinator.ops.local_processes import start_workers, stop_workers
from engine.auth import load_secret
from engine.sharding import shard

PROMPT = [5, 17, 42, 99, 7, 250, 33, 64, 128, 12]
NEW_TOKENS = 24

# Worker counts and families crossed once each, not as a product.
CLUSTERS = [("qwen3_moe", 1), ("deepseek_v3", 2), ("mixtral", 3)]


@pytest.fixture(scope="module")
def clusters(tiny_checkpoint, tmp_path_factory, secret_file) -> Iterator[dict]:
    """family -> (remote model, its checkpoint, a random draft folder), workers running."""
    running, opened = [], {}
    try:
        for family, workers in CLUSTERS:
            source = tiny_checkpoint(family)
            root = tmp_path_factory.mktemp(f"spec-{family}")
            shard(source, root / "sharded", workers=workers, progress=False)
            local = start_workers([[root / "sharded" / f"worker-{k}"] for k in range(workers)],
                                  secret_file, root / "logs", forked=True)
            running += local
            remote = open_remote_model(root / "sharded", [w.address for w in local],
                                       load_secret(secret_file))
            opened[family] = (remote, source, build_random_draft(root / "random", source))
        yield opened
    finally:
        for remote, _, _ in opened.values():
            remote.close()
        stop_workers(running)


def forwards_per_layer(remote: RemoteModel) -> dict[int, tuple[int, int]]:
    return {layer: (s.calls, s.requests) for layer, s in remote.dispatcher.stats.layers.items()}


@pytest.mark.parametrize("family,workers", CLUSTERS)
def test_greedy_ids_with_a_draft_equal_those_without(family, workers, clusters):
    remote, source, random_dir = clusters[family]
    plain = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=NEW_TOKENS)
    assert len(plain.token_ids) == NEW_TOKENS
    itself, _ = load(str(source))
    stranger, _ = load(str(random_dir))
    for n in (1, 3, 6):
        # Always agrees: every verification accepts its N drafted tokens.
        remote.dispatcher.stats.reset()
        agreeing = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=NEW_TOKENS,
                            draft=Draft(itself, DraftPolicy(n, adaptive=False)))
        assert agreeing.token_ids == plain.token_ids, f"{family}, N={n}, own checkpoint"
        spec = agreeing.speculative
        assert spec.acceptance == 1.0 and spec.plain_steps == 0, spec
        assert spec.verify_steps == -(-NEW_TOKENS // (n + 1)), spec
        # One prefill forward, then one forward per verification step, each a single request
        # to each worker that holds a routed expert: the N+1 rows travel together.
        for layer, (calls, requests) in forwards_per_layer(remote).items():
            assert calls == 1 + spec.verify_steps, (layer, calls, spec)
            assert calls <= requests <= calls * workers, (layer, requests)

        # Never agrees: every drafted token is rejected, the caches rewound every step.
        disagreeing = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=NEW_TOKENS,
                               draft=Draft(stranger, DraftPolicy(n, adaptive=False)))
        assert disagreeing.token_ids == plain.token_ids, f"{family}, N={n}, random draft"
        spec = disagreeing.speculative
        assert spec.verify_steps == NEW_TOKENS and spec.accepted <= 2, spec


def test_adaptive_drafting_stops_a_useless_draft_and_keeps_the_output(clusters):
    remote, _, random_dir = clusters["mixtral"]
    plain = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=48)
    stranger, _ = load(str(random_dir))
    drafted = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=48,
                       draft=Draft(stranger, DraftPolicy(6)))
    assert drafted.token_ids == plain.token_ids
    spec = drafted.speculative
    # A few steps to learn that it is useless, one probe after 32 plain tokens, no more.
    assert spec.verify_steps <= 5 and spec.plain_steps >= 40, spec
    assert spec.changes[0] == (0, 1) and spec.changes[-1][1] == 0, spec.changes


def test_sampling_with_a_draft_is_seeded_like_plain_sampling(clusters):
    """mlx-lm's rule: draft and target each sample, and a drafted token stands when it equals
    the target's sample, so every token is the target's. A seed repeats a run with a fixed N
    (adaptive drafting decides on measured times, which change how the samples are drawn)."""
    remote, source, _ = clusters["qwen3_moe"]
    itself, _ = load(str(source))
    runs = [generate(remote.model, remote.tokenizer, PROMPT, max_tokens=NEW_TOKENS,
                     temperature=0.8, seed=7, draft=Draft(itself, DraftPolicy(3, adaptive=False)))
            for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids
    assert len(runs[0].token_ids) == NEW_TOKENS
    assert runs[0].speculative.proposed > 0


@pytest.mark.long
@pytest.mark.slow
def test_demo_model_with_its_dense_and_a_random_draft(tmp_path, secret_file, monkeypatch,
                                                      demo_cache):
    """The demo's 16-expert MoE (top-4: each token runs one copy of every slice, so it
    computes the dense model) on 2 workers; its dense float32 source agrees always."""
    from builders.demo_models import prepare, prepare_dense

    monkeypatch.setenv("SHOAL_CACHE", str(demo_cache))  # the demo's models, built already
    sharded = prepare(16, 4, 2, progress=False)
    dense = prepare_dense(progress=False)
    local = start_workers([[sharded / f"worker-{k}"] for k in range(2)], secret_file,
                          tmp_path / "logs", forked=True)
    try:
        remote = open_remote_model(sharded, [w.address for w in local], load_secret(secret_file))
        try:
            ids = remote.tokenizer.apply_chat_template(
                [{"role": "user", "content": "What is the capital of France?"}],
                add_generation_prompt=True)
            plain = generate(remote.model, remote.tokenizer, ids, max_tokens=8)
            assert "Paris" in plain.text
            itself, _ = load(str(dense))
            agreeing = generate(remote.model, remote.tokenizer, ids, max_tokens=8,
                                draft=Draft(itself, DraftPolicy(3, adaptive=False)))
            assert agreeing.token_ids == plain.token_ids
            assert agreeing.speculative.acceptance == 1.0, agreeing.speculative
            stranger, _ = load(str(build_random_draft(tmp_path / "random", Path(dense))))
            disagreeing = generate(remote.model, remote.tokenizer, ids, max_tokens=8,
                                   draft=Draft(stranger, DraftPolicy(6, adaptive=False)))
            assert disagreeing.token_ids == plain.token_ids
        finally:
            remote.close()
    finally:
        stop_workers(local)


def test_probes_that_restart_the_draft_on_recent_tokens_keep_the_output(clusters):
    """Probes every few tokens, each after the draft missed more than its window: the draft
    starts afresh on the recent tokens, and the output stays the target's."""
    remote, source, random_dir = clusters["deepseek_v3"]
    plain = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=40)
    itself, _ = load(str(source))
    stranger, _ = load(str(random_dir))
    eager = DraftPolicy(3, probe_every=4, probe_budget=100.0)
    useless = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=40,
                       draft=Draft(stranger, eager))
    assert useless.token_ids == plain.token_ids
    assert useless.speculative.verify_steps >= 5, useless.speculative  # 3, then probes
    useful = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=40,
                      draft=Draft(itself, eager))
    assert useful.token_ids == plain.token_ids
    assert useful.speculative.accepted > 0
