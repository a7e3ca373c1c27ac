"""Size estimates from the real published configs of large MoE models: what `shoal plan` says
before a user downloads anything must match parameters x bits."""

import copy

import pytest

from engine.errors import InvalidInput
from engine.mtp import supports
from engine.sizes import estimate_sizes
from tests.engine.published_configs import DEEPSEEK_V3, KIMI_K2, PUBLISHED, QWEN3_30B_A3B


def total(sizes) -> int:
    return sum(sizes.experts.values()) + sizes.dense_bytes


@pytest.mark.parametrize("name", PUBLISHED)
def test_bf16_sizes_are_published_parameters_times_two_bytes(name):
    config, params, moe_layers, experts, width = PUBLISHED[name]
    sizes = estimate_sizes(config)
    assert abs(total(sizes) / (params * 2) - 1) < 0.03
    # Every routed expert is gate, up and down projections of hidden x width, two bytes each.
    # and the MTP module's layer, where the checkpoint has one (engine/mtp.py): shard keeps it
    assert len(sizes.experts) == (moe_layers + supports(config)) * experts
    assert set(sizes.experts.values()) == {3 * config["hidden_size"] * width * 2}
    assert sizes.expert_bits == 16.0


@pytest.mark.parametrize("name", PUBLISHED)
def test_what_if_4_bits_is_four_and_a_half_bits_per_weight(name):
    config, params, *_ = PUBLISHED[name]
    sizes = estimate_sizes(config, bits=4)
    # mlx-lm's affine 4-bit, group 64: a bf16 scale and bias per 64 weights -> 4.5 bits.
    assert sizes.expert_bits == 4.5
    assert abs(total(sizes) / (params * 4.5 / 8) - 1) < 0.03
    assert "4-bit" in sizes.precision and "--quantize 4" in sizes.precision


def test_fp8_source_is_held_as_bf16_because_mlx_lm_dequantizes_it():
    sizes = estimate_sizes(DEEPSEEK_V3)
    # 58 MoE layers and the MTP module's, of 256 experts each
    assert sum(sizes.experts.values()) / 2**30 == pytest.approx(1239.0, abs=0.1)
    assert "FP8" in sizes.precision and "bfloat16" in sizes.precision
    assert "--bits" in sizes.precision  # tells the user how to plan a smaller shard
    # FP8 with power-of-two scales over 32x32 blocks is mxfp8, which mlx-lm keeps packed.
    mx_fp8 = {**DEEPSEEK_V3, "quantization_config": {
        "quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]}}
    assert estimate_sizes(mx_fp8).expert_bits == 8.25


def test_mlx_conversion_with_per_layer_overrides():
    config = copy.deepcopy(QWEN3_30B_A3B)
    config["quantization"] = {
        "group_size": 64, "bits": 4,
        "model.layers.0.mlp.switch_mlp.down_proj": {"group_size": 64, "bits": 8},
        "model.layers.1.mlp.switch_mlp.up_proj": False,
    }
    sizes = estimate_sizes(config)
    proj = 2048 * 768
    assert sizes.experts[(2, 0)] == 3 * proj * 4.5 / 8
    assert sizes.experts[(0, 0)] == 2 * proj * 4.5 / 8 + proj * 8.5 / 8
    assert sizes.experts[(1, 0)] == 2 * proj * 4.5 / 8 + proj * 2
    assert "per-layer overrides" in sizes.precision


def test_compressed_tensors_quantizes_only_what_the_ignore_list_leaves():
    # Kimi K2 Thinking: int4 routed experts (group 32); attention, shared experts, the dense
    # first layer and the head stay bf16, named one by one in `ignore` as its config does.
    ignore = ["lm_head", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
              "model.layers.0.mlp.down_proj"]
    for layer in range(61):
        ignore += [f"model.layers.{layer}.self_attn.{p}" for p in
                   ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")]
        ignore += [f"model.layers.{layer}.mlp.shared_experts.{p}" for p in
                   ("gate_proj", "up_proj", "down_proj")]
    config = {**KIMI_K2, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ignore,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "group_size": 32, "strategy": "group", "symmetric": True}}}}}
    sizes = estimate_sizes(config)
    bf16 = estimate_sizes(KIMI_K2)
    # mlx-lm holds them as affine 4-bit, group 32: bf16 scale and bias per 32 -> 5 bits.
    assert sizes.expert_bits == 5.0
    # Only the embedding (not in `ignore`) is quantized outside the experts.
    embedding = 163840 * 7168
    assert sizes.dense_bytes == bf16.dense_bytes - embedding * 2 + embedding * 5 // 8
    # The same list written as patterns, as other compressed-tensors exports do.
    patterns = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                r"re:model\.layers\.0\.mlp\..*"]
    config["quantization_config"]["ignore"] = patterns
    assert estimate_sizes(config) == sizes


def test_a_format_mlx_lm_cannot_load_is_refused_in_words():
    config = {**KIMI_K2, "quantization_config": {"quant_method": "compressed-tensors",
                                                 "format": "float-quantized"}}
    with pytest.raises(InvalidInput, match="dequantize the checkpoint to bf16"):
        estimate_sizes(config)
