"""Tests for builders.synthetic: random checkpoints that mlx-lm loads, in both layouts."""

import importlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

from builders.synthetic import build_checkpoint
from builders.synthetic_config import FAMILIES, model_config
from engine.errors import ShoalError

PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "A router sends every token to a few experts on many machines.",
    "Hello world! 1234 zebras, quartz & jam.",
)

# The stacked expert weights as each family's model holds them.
SWITCH_PREFIX = {
    "qwen3_moe": "mlp.switch_mlp",
    "mixtral": "block_sparse_moe.switch_mlp",
    "deepseek_v3": "mlp.switch_mlp",
}


def logits_for(model: nn.Module, tokenizer, text: str) -> mx.array:
    return model(mx.array([tokenizer.encode(text)]))[0]


def files_by_name(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("quantize_bits", [None, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_loads_and_generates(tiny_checkpoint, family, quantize_bits):
    model, tokenizer = mlx_lm.load(str(tiny_checkpoint(family, quantize_bits)))
    switch_type = SwitchLinear if quantize_bits is None else QuantizedSwitchLinear
    switches = [m for _, m in model.named_modules() if isinstance(m, switch_type)]
    assert switches, f"no {switch_type.__name__} in the loaded model"

    responses = list(mlx_lm.stream_generate(model, tokenizer, "hello", max_tokens=8))
    tokens = [r.token for r in responses]
    assert 1 <= len(tokens) <= 8
    assert all(0 <= t < tokenizer.vocab_size for t in tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_layout_gives_the_same_logits_as_mlx_layout(tiny_checkpoint, family):
    hf_dir = tiny_checkpoint(family, layout="hf")
    hf_keys = mx.load(str(hf_dir / "model.safetensors")).keys()
    assert not any(".switch_mlp." in k for k in hf_keys)
    assert any(".experts.7." in k for k in hf_keys)

    mlx_model, tokenizer = mlx_lm.load(str(tiny_checkpoint(family)))
    hf_model, _ = mlx_lm.load(str(hf_dir))
    for text in PROMPTS:
        expected = logits_for(mlx_model, tokenizer, text)
        actual = logits_for(hf_model, tokenizer, text)
        assert mx.allclose(actual, expected, rtol=0, atol=1e-6).item()


def test_hf_layout_uses_hugging_face_names(tiny_checkpoint):
    mixtral = mx.load(str(tiny_checkpoint("mixtral", layout="hf") / "model.safetensors"))
    assert mixtral["model.layers.0.block_sparse_moe.experts.3.w1.weight"].shape == (32, 64)
    assert mixtral["model.layers.0.block_sparse_moe.experts.3.w2.weight"].shape == (64, 32)
    deepseek = mx.load(str(tiny_checkpoint("deepseek_v3", layout="hf") / "model.safetensors"))
    assert deepseek["model.layers.1.mlp.experts.0.up_proj.weight"].shape == (32, 64)
    # 4 heads x (16 no-rope key + 16 value) rows over the 32-wide latent.
    assert deepseek["model.layers.0.self_attn.kv_b_proj.weight"].shape == (128, 32)
    assert not any(".embed_q." in k for k in deepseek)


@pytest.mark.parametrize(
    ("family", "quantize_bits"), [(f, None) for f in FAMILIES] + [("qwen3_moe", 4)]
)
def test_same_arguments_give_identical_files(tmp_path, family, quantize_bits):
    first = build_checkpoint(tmp_path / "a", family, quantize_bits=quantize_bits)
    second = build_checkpoint(tmp_path / "b", family, quantize_bits=quantize_bits)
    assert files_by_name(first) == files_by_name(second)


def test_another_seed_gives_other_weights(tmp_path):
    first = build_checkpoint(tmp_path / "a", "mixtral", seed=0)
    second = build_checkpoint(tmp_path / "b", "mixtral", seed=1)
    assert (first / "model.safetensors").read_bytes() != (second / "model.safetensors").read_bytes()


def test_unknown_family_names_the_valid_ones(tmp_path):
    with pytest.raises(ShoalError, match="unknown family 'llama'") as raised:
        build_checkpoint(tmp_path, "llama")
    assert all(family in str(raised.value) for family in FAMILIES)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"size": "huge"}, "unknown size"),
        ({"layout": "gguf"}, "unknown layout"),
        ({"dtype": "int8"}, "unknown dtype"),
        ({"quantize_bits": 7}, "unknown quantize_bits"),
        ({"quantize_bits": 4, "group_size": 48}, "unknown group_size"),
        ({"quantize_bits": 4, "layout": "hf"}, "only written unquantized"),
    ],
)
def test_bad_options_raise_shoal_error(tmp_path, options, message):
    with pytest.raises(ShoalError, match=message):
        build_checkpoint(tmp_path / "out", "qwen3_moe", **options)


@pytest.mark.parametrize(
    ("options", "message"),
    [({"size": "bench"}, "unknown size 'bench'; choose one of: tiny"),
     ({"layout": "hf"}, "hf layout is written for qwen3_moe, mixtral, deepseek_v3 only")],
)
def test_the_other_families_are_built_tiny_in_mlx_layout_only(tmp_path, options, message):
    with pytest.raises(ShoalError, match=message):
        build_checkpoint(tmp_path / "out", "gpt_oss", **options)


def test_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "model-old.safetensors").write_bytes(b"")
    with pytest.raises(ShoalError, match="not empty"):
        build_checkpoint(tmp_path, "qwen3_moe")


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_spreads_tokens_over_experts(tiny_checkpoint, family, monkeypatch):
    chosen: list[set[int]] = []
    original = SwitchGLU.__call__

    def recording(self, x, indices):
        chosen.append(set(indices.flatten().tolist()))
        return original(self, x, indices)

    monkeypatch.setattr(SwitchGLU, "__call__", recording)
    model, tokenizer = mlx_lm.load(str(tiny_checkpoint(family)))
    tokens = tokenizer.encode(" ".join(PROMPTS))[:16]
    assert len(tokens) == 16
    model(mx.array([tokens]))

    moe_layers = 2 if family == "deepseek_v3" else 3
    assert len(chosen) == moe_layers
    assert all(len(experts) > 2 for experts in chosen), chosen


@pytest.mark.parametrize("family", FAMILIES)
def test_top_two_logits_are_rarely_tied(tiny_checkpoint, family):
    model, tokenizer = mlx_lm.load(str(tiny_checkpoint(family)))
    gaps = []
    for text in PROMPTS:
        top2 = mx.sort(logits_for(model, tokenizer, text), axis=-1)[:, -2:]
        gaps.extend((top2[:, 1] - top2[:, 0]).tolist())
    assert sum(gap > 1e-3 for gap in gaps) >= 0.9 * len(gaps)


def test_tokenizer_round_trips_and_applies_the_chat_template(tiny_checkpoint):
    checkpoint = tiny_checkpoint("qwen3_moe")
    _, tokenizer = mlx_lm.load(str(checkpoint))
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer.get_vocab()) == 300

    ids = tokenizer.encode("hello world")
    assert tokenizer.decode(ids) == "hello world"

    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in tokenizer.eos_token_ids


def test_deepseek_has_one_dense_layer_then_moe_with_a_shared_expert(tiny_checkpoint):
    model, _ = mlx_lm.load(str(tiny_checkpoint("deepseek_v3")))
    first, *rest = model.model.layers
    assert "switch_mlp" not in first.mlp
    assert all("switch_mlp" in layer.mlp and "shared_experts" in layer.mlp for layer in rest)


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_weights_are_stacked_per_layer(tiny_checkpoint, family):
    model, _ = mlx_lm.load(str(tiny_checkpoint(family)))
    weights = dict(tree_flatten(model.parameters()))
    layer = 2  # a MoE layer in every family
    gate = weights[f"model.layers.{layer}.{SWITCH_PREFIX[family]}.gate_proj.weight"]
    down = weights[f"model.layers.{layer}.{SWITCH_PREFIX[family]}.down_proj.weight"]
    assert gate.shape == (8, 32, 64)
    assert down.shape == (8, 64, 32)


def test_bfloat16_keeps_the_routing_bias_in_float32(tmp_path):
    # MLX's CPU gather_mm only runs float32, so this checks the weights, not a forward pass.
    checkpoint = build_checkpoint(tmp_path, "deepseek_v3", dtype="bfloat16")
    model, _ = mlx_lm.load(str(checkpoint))
    for name, value in tree_flatten(model.parameters()):
        expected = mx.float32 if "e_score_correction_bias" in name else mx.bfloat16
        assert value.dtype == expected, name


def test_bench_config_has_the_deepseek_v3_shape():
    config = model_config("deepseek_v3", "bench")
    assert config["hidden_size"] == 1024
    assert config["num_hidden_layers"] == 12
    assert config["n_routed_experts"] == 64
    assert config["n_shared_experts"] == 1
    assert config["num_experts_per_tok"] == 8

    # Building the module graph is lazy in MLX, so this allocates no weights.
    arch = importlib.import_module("mlx_lm.models.deepseek_v3")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    experts = model.model.layers[1].mlp.switch_mlp.gate_proj.weight
    assert experts.shape == (64, config["moe_intermediate_size"], 1024)
    assert "switch_mlp" not in model.model.layers[0].mlp
