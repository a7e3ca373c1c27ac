"""The MTP module through sharding and sizes: `shoal shard` keeps it (dense parts in dense/, its
experts as layer N like any other layer's), from the published layout or mlx-lm's, quantized
with the rest; `shoal plan`'s sizes count its experts."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from builders.synthetic import build_checkpoint
from engine.moe_layers import load_source
from engine.mtp import attach_from_files, mtp_weights
from engine.sharding import shard
from engine.sizes import estimate_sizes, read_sizes


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_shard_keeps_the_module_and_its_experts(family, tmp_path):
    source = build_checkpoint(tmp_path / "source", family, mtp="random")
    config = json.loads((source / "config.json").read_text())
    last = config["num_hidden_layers"]
    manifest = shard(source, tmp_path / "out", workers=2, progress=False)
    mtp_layer = manifest.layers[-1]
    assert (mtp_layer.layer, mtp_layer.path) == (last, "mtp.block.mlp.switch_mlp")
    files = {f.file for f in manifest.experts if f.layer == last}
    assert len(files) == config["n_routed_experts"]
    index = json.loads((tmp_path / "out" / "dense" / "model.safetensors.index.json").read_text())
    dense = {k for k in index["weight_map"] if k.startswith("mtp.")}
    assert {"mtp.enorm.weight", "mtp.hnorm.weight", "mtp.eh_proj.weight",
            "mtp.shared_head.norm.weight", "mtp.shared_head.head.weight",
            "mtp.block.mlp.gate.weight"} <= dense
    assert not any(".switch_mlp." in k for k in dense)  # the experts are in the stores
    # plan's sizes: from the split, and estimated from the config alone
    sized = read_sizes(tmp_path / "out")
    estimated = estimate_sizes(config)
    assert (last, 0) in sized.experts and (last, 0) in estimated.experts
    # the module's block is a decoder layer like the last: its experts weigh as much
    assert sized.experts[(last, 0)] == sized.experts[(last - 1, 0)]
    assert estimated.experts[(last, 0)] == estimated.experts[(last - 1, 0)]


def test_published_and_mlx_layouts_give_the_same_module(tmp_path):
    modules = []
    for layout in ("hf", "mlx"):
        source = build_checkpoint(tmp_path / layout, "deepseek_v3", layout=layout,
                                  mtp="random")
        model, config = load_source(source)
        modules.append(attach_from_files(model, config, [source / "model.safetensors"]))
    hf, mlx = modules
    ours, theirs = dict(tree_flatten(hf.parameters())), dict(tree_flatten(mlx.parameters()))
    assert ours.keys() == theirs.keys() and "block.self_attn.embed_q.weight" in ours
    for name, value in ours.items():
        assert mx.array_equal(value, theirs[name]), name


def test_shard_quantizes_the_module_with_the_model(tmp_path):
    source = build_checkpoint(tmp_path / "source", "glm4_moe", mtp="random")
    shard(source, tmp_path / "out", quantize_bits=4, progress=False)
    index = json.loads((tmp_path / "out" / "dense" / "model.safetensors.index.json").read_text())
    assert "mtp.eh_proj.scales" in index["weight_map"]
    assert "mtp.block.self_attn.q_proj.scales" in index["weight_map"]


def test_fp8_module_tensors_are_dequantized_as_the_model_s(tmp_path):
    """DeepSeek-V3 publishes the module in FP8 like its layers (a weight_scale_inv per 128x128
    block, its own eh_proj included): the architecture's sanitize reads both alike."""
    source = build_checkpoint(tmp_path / "source", "deepseek_v3", layout="hf", mtp="random")
    model, config = load_source(source)
    raw = mx.load(str(source / "model.safetensors"))
    prefix = f"model.layers.{config['num_hidden_layers']}."
    original = {}
    for name in ("eh_proj", "self_attn.o_proj"):
        original[name] = raw[f"{prefix}{name}.weight"]
        raw[f"{prefix}{name}.weight"] = mx.to_fp8(original[name])
        raw[f"{prefix}{name}.weight_scale_inv"] = mx.ones((1, 1))
    weights = mtp_weights(model, raw)
    assert not any("scale_inv" in k for k in weights)
    for name, module_name in (("eh_proj", "mtp.eh_proj.weight"),
                              ("self_attn.o_proj", "mtp.block.self_attn.o_proj.weight")):
        assert weights[module_name].dtype == mx.bfloat16
        assert mx.allclose(weights[module_name].astype(mx.float32), original[name],
                           rtol=0.13, atol=1e-3)
