"""`--draft mtp` over real workers and with a local store: the model's own MTP module, kept by
`shoal shard` from the published layout, drafts, and greedy ids equal mlx-lm's on the same
checkpoint (float32 and 4-bit, DeepSeek-V3 and GLM-4.5 MoE), its experts reached through the
same dispatch as every other layer's; a module right by construction is accepted."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load, load_model

from builders.synthetic import build_bigram_draft, build_checkpoint
from coordinator.dataplane.dispatch import RemoteSwitch
from coordinator.decoding.draft_policy import DraftPolicy
from coordinator.decoding.generate import RemoteModel, generate, open_remote_model
from coordinator.decoding.mtp_draft import mtp_draft
from coordinator.decoding.speculative import Draft
from coordinator.ops.local_processes import start_workers, stop_workers
from engine.auth import load_secret
from engine.errors import InvalidInput
from engine.mtp import model_classes
from engine.sharding import shard

PROMPT = [5, 17, 42, 99, 7, 250, 33, 64, 128, 12]
NEW_TOKENS = 24
POLICIES = (DraftPolicy(1, adaptive=False), DraftPolicy(3, adaptive=False), DraftPolicy(3))


def mlx_lm_ids(source: Path) -> list[int]:
    """mlx-lm's greedy ids in one process. Its deepseek_v3 sanitize sets aside only
    model.layers.61 (the published model's depth), so the MTP layer of a shallower checkpoint
    is set aside by engine/mtp.py's classes; the model and its computation are mlx-lm's."""
    model, _ = load_model(source, get_model_classes=model_classes)
    steps = generate_step(mx.array(PROMPT), model, max_tokens=NEW_TOKENS)
    return [int(token) for token, _ in steps]


def check_drafting(remote: RemoteModel, expected: list[int], workers: int) -> None:
    mtp_layer = remote.model["mtp"].index
    # The module's experts behind the same seam as every other layer's.
    assert isinstance(remote.model["mtp"].block.mlp.switch_mlp, RemoteSwitch)
    for policy in POLICIES:
        remote.dispatcher.stats.reset()
        drafted = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=NEW_TOKENS,
                           draft=mtp_draft(remote.model, policy))
        assert drafted.token_ids == expected, policy
        spec = drafted.speculative
        assert spec.draft == "mtp" and spec.proposed > 0, spec
        if workers:  # went to the workers, one call per module forward
            layer = remote.dispatcher.stats.layers[mtp_layer]
            assert layer.calls == spec.draft_forwards > 0, (layer, spec)
            assert layer.calls <= layer.requests <= layer.calls * workers


@pytest.mark.parametrize("family,bits,layout", [
    ("deepseek_v3", None, "hf"), ("deepseek_v3", 4, "mlx"),
    ("glm4_moe", None, "hf"), ("glm4_moe", 4, "mlx"),
])
def test_mtp_drafting_gives_mlx_lm_greedy_ids(family, bits, layout, tmp_path, secret_file):
    source = build_checkpoint(tmp_path / "source", family, quantize_bits=bits,
                              layout=layout, mtp="random")
    expected = mlx_lm_ids(source)
    sharded = tmp_path / "sharded"
    manifest = shard(source, sharded, workers=2, progress=False)
    assert manifest.layers[-1].path == "mtp.block.mlp.switch_mlp"
    stores = [sharded / "worker-0", sharded / "worker-1"]
    local = start_workers([[store] for store in stores], secret_file, tmp_path / "logs")
    try:
        remote = open_remote_model(sharded, [w.address for w in local], load_secret(secret_file))
        try:
            plain = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=NEW_TOKENS)
            assert plain.token_ids == expected
            check_drafting(remote, expected, workers=2)
        finally:
            remote.close()
    finally:
        stop_workers(local)
    # This Mac alone: both stores served in this process.
    remote = open_remote_model(sharded, [], b"", local_stores=stores)
    try:
        check_drafting(remote, expected, workers=0)
    finally:
        remote.close()


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_a_module_right_by_construction_is_accepted(family, tmp_path):
    """The main model made a bigram model and the module its copy (builders/synthetic.py):
    every guess is the main model's own next token, so every drafted token stands, as for a
    one-layer draft model made as right."""
    source = build_checkpoint(tmp_path / "source", family, mtp="bigram")
    shard(source, tmp_path / "sharded", progress=False)
    remote = open_remote_model(tmp_path / "sharded", [], b"",
                               local_stores=[tmp_path / "sharded" / "experts"])
    try:
        expected = mlx_lm_ids(source)
        bigram_draft, _ = load(str(build_bigram_draft(tmp_path / "draft", source)))
        for n in (1, 3):
            drafted = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=NEW_TOKENS,
                               draft=mtp_draft(remote.model, DraftPolicy(n, adaptive=False)))
            assert drafted.token_ids == expected
            spec = drafted.speculative
            assert spec.acceptance >= 0.95, spec
            # the first token reads the prompt; then n + 1 tokens a forward
            assert spec.verify_steps <= -(-(NEW_TOKENS - 1) // (n + 1)) + 1, spec
            # A draft model as right (builders/synthetic.py) takes as many forwards.
            other = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=NEW_TOKENS,
                             draft=Draft(bigram_draft, DraftPolicy(n, adaptive=False)))
            assert other.token_ids == expected
            assert other.speculative.acceptance == spec.acceptance, other.speculative
            assert abs(other.speculative.verify_steps - spec.verify_steps) <= 1
    finally:
        remote.close()


def test_a_random_module_is_stopped_and_keeps_the_output(tmp_path):
    source = build_checkpoint(tmp_path / "source", "deepseek_v3", seed=3, mtp="random")
    shard(source, tmp_path / "sharded", progress=False)
    remote = open_remote_model(tmp_path / "sharded", [], b"",
                               local_stores=[tmp_path / "sharded" / "experts"])
    try:
        plain = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=48)
        drafted = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=48,
                           draft=mtp_draft(remote.model, DraftPolicy(3)))
        assert drafted.token_ids == plain.token_ids
        spec = drafted.speculative
        assert spec.acceptance < 0.5 and spec.plain_steps >= 30, spec
    finally:
        remote.close()


def test_a_split_without_mtp_weights_is_refused_clearly(tiny_checkpoint, tmp_path):
    shard(tiny_checkpoint("deepseek_v3"), tmp_path / "sharded", progress=False)
    remote = open_remote_model(tmp_path / "sharded", [], b"",
                               local_stores=[tmp_path / "sharded" / "experts"])
    try:
        with pytest.raises(InvalidInput, match="no MTP weights"):
            mtp_draft(remote.model, DraftPolicy())
    finally:
        remote.close()
    run = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "generate", "--model",
         str(tmp_path / "sharded"), "--local-store", str(tmp_path / "sharded" / "experts"),
         "--draft", "mtp", "--max-tokens", "4", "hello"],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode != 0
    assert "shoal: error: --draft mtp needs the model's multi-token-prediction module" \
        in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("bigram", [False, True])
def test_chat_with_the_module_gives_the_plain_replies_turn_by_turn(bigram, tmp_path):
    """`shoal chat --draft mtp` on a pipe: the KV cache carries over between turns, guesses
    past an end of reply are dropped from it, and every reply is the plain one."""
    source = build_checkpoint(tmp_path / "source", "deepseek_v3",
                              mtp="bigram" if bigram else "random")
    shard(source, tmp_path / "sharded", progress=False)

    def chat(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "chat", "--model",
             str(tmp_path / "sharded"), "--local-store", str(tmp_path / "sharded" / "experts"),
             "--max-tokens", "12", *extra],
            input="Hello there\nAnd then?\n/reset\nHello there\n/quit\n",
            capture_output=True, text=True, timeout=180)

    plain, drafted = chat(), chat("--draft", "mtp", "--num-draft-tokens", "2")
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout and plain.stdout.count("\n") == 3
    turns = [line for line in drafted.stderr.splitlines() if "guesses:" in line]
    accepted = [int(line.split("guesses: ")[1].split()[0]) for line in turns]
    assert len(turns) == 3 and (sum(accepted) > 0) == bigram, drafted.stderr
    assert "from the cache" in turns[1] and " 0 from the cache" not in turns[1]


def test_sampling_with_the_module_is_seeded_like_plain_sampling(tmp_path):
    """mlx-lm's rule: module and main model each sample, and a guess stands when it equals the
    main model's sample; a seed repeats a run with a fixed N."""
    source = build_checkpoint(tmp_path / "source", "glm4_moe", mtp="bigram")
    shard(source, tmp_path / "sharded", progress=False)
    remote = open_remote_model(tmp_path / "sharded", [], b"",
                               local_stores=[tmp_path / "sharded" / "experts"])
    try:
        runs = [generate(remote.model, remote.tokenizer, PROMPT, max_tokens=NEW_TOKENS,
                         temperature=0.8, seed=7,
                         draft=mtp_draft(remote.model, DraftPolicy(2, adaptive=False)))
                for _ in range(2)]
        assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == NEW_TOKENS
        assert runs[0].speculative.accepted > 0, runs[0].speculative
    finally:
        remote.close()


def test_generate_command_drafts_with_the_module_and_reports_it(tmp_path):
    source = build_checkpoint(tmp_path / "source", "deepseek_v3", mtp="bigram")
    shard(source, tmp_path / "sharded", progress=False)

    def shoal_generate(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "generate", "--model",
             str(tmp_path / "sharded"), "--local-store", str(tmp_path / "sharded" / "experts"),
             "--max-tokens", "16", *extra, "hello there"],
            capture_output=True, text=True, timeout=120)

    plain, drafted = shoal_generate("--json"), shoal_generate("--json", "--draft", "mtp")
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr
    report = json.loads(drafted.stdout)
    assert report["token_ids"] == json.loads(plain.stdout)["token_ids"]
    assert report["speculative"]["draft"] == "mtp", report["speculative"]
    assert report["speculative"]["accepted"] > 0 and report["speculative"]["draft_forwards"] > 0
    stats = shoal_generate("--stats", "--draft", "mtp", "--fixed-draft")
    assert stats.returncode == 0, stats.stderr
    assert "MTP draft: proposed" in stats.stderr and "the module's own forwards" in stats.stderr
