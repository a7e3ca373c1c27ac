"""Model sizes for planning: every expert's bytes, the dense bytes and top-k, read from a
sharded model's manifest or estimated from a config alone (a model not downloaded yet), as
workers will hold them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine.errors import CorruptData, InvalidInput, NotFound
from engine.experts import build_skeleton
from engine.manifest import MANIFEST_NAME, ExpertKey, Manifest, read_manifest
from engine.moe_layers import find_moe_layers, layer_bytes, resolve_model_dir, weight_files


@dataclass(frozen=True)
class ModelSizes:
    """What placement planning needs to know about a model, from a manifest or a config."""

    model_type: str
    experts: dict[ExpertKey, int]  # (layer, expert) -> bytes
    dense_bytes: int
    top_k: int
    estimated: bool  # True when computed from a config rather than read from real files
    precision: str = ""  # how the weights are stored, in words, e.g. "4-bit affine, group 64"
    expert_bits: float = 0.0  # bits per routed-expert parameter, scales included
    # The source checkpoint's bytes as downloaded, where it is stored otherwise than the split
    # (FP8 published, bf16 held): from its weight files when there, else estimated; 0 unknown.
    source_bytes: int = 0


def _top_k(config: dict) -> int:
    text = config.get("text_config", {})
    return int(config.get("num_experts_per_tok") or text.get("num_experts_per_tok") or 1)


def _describe_quantization(config: dict) -> str:
    q = config.get("quantization")
    if not q:
        return str(config.get("torch_dtype") or config.get("dtype") or "as stored")
    mixed = any(isinstance(v, dict | bool) for v in q.values())
    text = f"{q.get('bits')}-bit {q.get('mode', 'affine')}, group {q.get('group_size')}"
    return text + (" with per-layer overrides" if mixed else "")


def sizes_from_manifest(manifest: Manifest) -> ModelSizes:
    experts = {(e.layer, e.expert): e.bytes for e in manifest.experts}
    dense = sum(f.bytes for f in manifest.dense_files)
    # A manifest holds bytes, not parameter counts: bits per weight stay unknown (0).
    return ModelSizes(manifest.model_type, experts, dense, _top_k(manifest.config), False,
                      _describe_quantization(manifest.config))


# Floating dtypes a Hugging Face config names in torch_dtype (older) or dtype (newer).
_DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


@dataclass(frozen=True)
class _Storage:
    """How the weights a worker will hold are stored, as decided from a config."""

    dtype: mx.Dtype  # of everything not quantized
    quantization: dict | None  # mlx-lm's {"group_size", "bits", "mode", per-path overrides}
    skip: tuple[str, ...]  # module names or "re:" patterns a Hugging Face config leaves as is
    words: str


def _config_dtype(config: dict) -> tuple[mx.Dtype, str]:
    text = config.get("text_config", {})
    name = (config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype")
            or text.get("dtype"))
    if name is None:
        return mx.bfloat16, "bfloat16 (assumed: the config names no dtype)"
    if name not in _DTYPES:
        raise InvalidInput(f"the config's dtype {name!r} is not one of {', '.join(_DTYPES)}")
    return _DTYPES[name], name


def _hf_quantization(qc: dict, dtype_words: str) -> tuple[dict | None, tuple[str, ...], str]:
    """Map a Hugging Face quantization_config to what mlx-lm's loader turns it into."""
    method = qc.get("quant_method")
    skip = tuple(qc.get("ignore") or qc.get("modules_to_not_convert") or ())
    block = list(qc.get("weight_block_size") or ())
    if method == "fp8" and qc.get("scale_fmt") == "ue8m0" and block == [32, 32]:
        return {"group_size": 32, "bits": 8, "mode": "mxfp8"}, skip, "FP8 kept as mxfp8"
    if method == "fp8":
        # mlx-lm dequantizes block-scaled FP8 in the model's sanitize(), so what `shoal shard`
        # writes (and workers hold) is the config's dtype unless --quantize is given.
        blocks = "x".join(map(str, block)) or "per-tensor"
        return None, skip, (f"FP8 (blocks {blocks}) in the source, which mlx-lm loads as "
                            f"{dtype_words}; plan --bits 8 (or 4) for `shoal shard --quantize`")
    if method in ("mxfp4", "mxfp8"):
        q = {"group_size": 32, "bits": 4 if method == "mxfp4" else 8, "mode": method}
        return q, skip, method
    if method == "compressed-tensors":
        fmt = qc.get("format")
        modes = {"pack-quantized": "affine", "nvfp4-pack-quantized": "nvfp4",
                 "mxfp4-pack-quantized": "mxfp4"}
        if fmt not in modes:
            raise InvalidInput(
                f"mlx-lm cannot load compressed-tensors format {fmt!r}; dequantize the "
                "checkpoint to bf16 first (then plan with --bits)"
            )
        weights = next(iter((qc.get("config_groups") or {"": {}}).values())).get("weights", {})
        defaults = {"affine": (32, 4), "nvfp4": (16, 4), "mxfp4": (32, 4)}[modes[fmt]]
        q = {"group_size": weights.get("group_size") or defaults[0],
             "bits": weights.get("num_bits") or defaults[1], "mode": modes[fmt]}
        return q, skip, f"compressed-tensors {fmt}"
    if method in ("awq", "gptq"):
        q = {"group_size": qc.get("group_size", 128), "bits": qc.get("bits", 4), "mode": "affine"}
        return q, skip, method
    if method == "modelopt":
        settings = qc.get("quantization", qc)
        return {"group_size": settings.get("group_size", 16), "bits": 4, "mode": "nvfp4"}, \
            skip, "ModelOpt NVFP4"
    raise InvalidInput(f"Shoal cannot size a checkpoint quantized with {method!r}")


def _fp8_source(config: dict) -> tuple[tuple[int, int], tuple[str, ...]] | None:
    """(block, skipped modules) of a source published in block-scaled FP8 that mlx-lm loads in
    another dtype (not FP8 kept as mxfp8); None for any other source."""
    qc = config.get("quantization_config") or config.get("text_config", {}).get(
        "quantization_config") or {}
    if qc.get("quant_method") != "fp8" or config.get("quantization"):
        return None
    block = list(qc.get("weight_block_size") or (0, 0))
    if qc.get("scale_fmt") == "ue8m0" and block == [32, 32]:
        return None
    return (block[0], block[1]), tuple(qc.get("ignore") or qc.get("modules_to_not_convert") or ())


def _storage(config: dict, bits: int | None, group_size: int) -> _Storage:
    dtype, dtype_words = _config_dtype(config)
    if bits is not None:
        q = {"group_size": group_size, "bits": bits, "mode": "affine"}
        return _Storage(dtype, q, (), f"{bits}-bit affine, group {group_size} (as "
                        f"`shoal shard --quantize {bits}` would write it)")
    if config.get("quantization"):  # an mlx-lm conversion: mlx-community and mlx_lm.convert
        return _Storage(dtype, config["quantization"], (), _describe_quantization(config))
    qc = config.get("quantization_config") or config.get("text_config", {}).get(
        "quantization_config")
    if qc:
        q, skip, words = _hf_quantization(qc, dtype_words)
        return _Storage(dtype, q, skip, words)
    return _Storage(dtype, None, (), dtype_words)


# mlx-lm modules that its sanitize() derives from a Hugging Face module of another name
# (MLA's kv_b_proj is split into the two absorbed projections).
_HF_SOURCE_NAMES = {"embed_q": "kv_b_proj", "unembed_out": "kv_b_proj"}


def _skipped(path: str, skip: tuple[str, ...], switches: tuple[str, ...]) -> bool:
    """Whether a Hugging Face ignore list names this mlx-lm module. HF names every expert
    (mlp.experts.3.up_proj) where mlx-lm stacks them in a switch module (mlp.switch_mlp.up_proj,
    `switches` being those modules' paths)."""
    parent, _, leaf = path.rpartition(".")
    hf = f"{parent}.{_HF_SOURCE_NAMES.get(leaf, leaf)}".lstrip(".")
    names = [path, hf]
    for switch in switches:
        if path.startswith(switch + "."):
            names.append(f"{switch.rpartition('.')[0]}.experts.0.{path[len(switch) + 1:]}")
    return any(
        any(re.match(entry[3:], n) for n in names) if entry.startswith("re:") else entry in names
        for entry in skip
    )


def _fp8_source_bytes(
    model: nn.Module, block: tuple[int, int], skip: tuple[str, ...], switches: tuple[str, ...]
) -> int:
    """Bytes of a block-scaled FP8 checkpoint as published: each linear weight one byte per
    value and a float32 scale per block (none per tensor, block 0), the rest (embeddings, the
    output head, norms, routers, what the config skips) in the model's dtype, as held."""
    total = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    for path, module in model.named_modules():
        if (isinstance(module, nn.Embedding) or path.split(".")[-1] == "lm_head"
                or not hasattr(module, "to_quantized") or _skipped(path, skip, switches)):
            continue
        weight = module.weight
        rows, cols = weight.shape[-2], weight.shape[-1]
        stacked = weight.size // (rows * cols)  # experts of a switch module
        blocks = stacked * (-(-rows // block[0]) * -(-cols // block[1]) if block[0] else 1)
        total += weight.size + 4 * blocks - weight.nbytes
    return total


def estimate_sizes(config: dict, *, bits: int | None = None, group_size: int = 64) -> ModelSizes:
    """Byte sizes from a config alone (a model not downloaded yet), as workers will hold them.

    mlx-lm builds the module tree with lazy weights, so nothing is allocated: the tree is cast
    to the config's dtype and quantized the way mlx-lm's loader would (an MLX `quantization`
    entry with its per-layer overrides, or a Hugging Face `quantization_config`), or as
    `shoal shard --quantize BITS` would when `bits` asks "what if".
    """
    storage = _storage(config, bits, group_size)
    model = build_skeleton(config)
    params = {name: a.size for name, a in tree_flatten(model.parameters())}
    layers = find_moe_layers(model, config)
    switches = tuple(layer.path for layer in layers)
    model.set_dtype(storage.dtype)
    fp8 = _fp8_source(config)
    source = _fp8_source_bytes(model, *fp8, switches) if fp8 else 0
    q = storage.quantization
    if q:
        quant_predicate = getattr(model, "quant_predicate", None)

        def predicate(path: str, module: nn.Module) -> bool | dict:
            if path in q:  # mlx-lm's per-layer entries (mixed quantization)
                return q[path]
            if not hasattr(module, "to_quantized") or _skipped(path, storage.skip, switches):
                return False
            if module.weight.shape[-1] % q["group_size"]:
                return False
            return quant_predicate(path, module) if quant_predicate else True

        nn.quantize(model, group_size=q["group_size"], bits=q["bits"],
                    mode=q.get("mode", "affine"), class_predicate=predicate)
    experts = {}
    expert_total = expert_params = 0
    for layer in layers:
        module_bytes = layer_bytes(model, layer)
        expert_total += module_bytes
        expert_params += sum(n for name, n in params.items()
                             if name.startswith(layer.path + ".") and name.endswith("weight"))
        per_expert = module_bytes // layer.num_experts
        experts.update({(layer.layer, e): per_expert for e in range(layer.num_experts)})
    total = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    return ModelSizes(config.get("model_type", "?"), experts, total - expert_total,
                      _top_k(config), True, storage.words,
                      8 * expert_total / expert_params if expert_params else 0.0, source)


def read_sizes(path: Path, *, bits: int | None = None, group_size: int = 64) -> ModelSizes:
    """Sizes of a sharded model folder (its manifest), or estimated from a config.json
    (`bits`: as if quantized to that many bits, which only a config can answer)."""
    path = Path(path)
    if (path / MANIFEST_NAME).exists():
        if bits is not None:
            raise InvalidInput(
                f"{path} is already sharded, so its sizes are real; --bits applies to a "
                "config.json (plan the source model's config instead)"
            )
        return sizes_from_manifest(read_manifest(path))
    config_path = resolve_model_dir(path) / "config.json" if path.is_dir() else path
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise NotFound(f"{path} is neither a sharded model folder nor a config.json") from None
    except json.JSONDecodeError as e:
        raise CorruptData(f"{config_path} is not valid JSON ({e})") from None
    sizes = estimate_sizes(config, bits=bits, group_size=group_size)
    on_disk = sum(f.stat().st_size for f in weight_files(config_path.parent))
    return replace(sizes, source_bytes=on_disk) if on_disk else sizes
