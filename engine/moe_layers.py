"""mlx-lm's side of a checkpoint: load a source model lazily and find its routed experts in the
module tree (switch modules, parameters, bytes), whatever the architecture; sharding, size
estimates and the expert runner take the model's structure from here."""

from __future__ import annotations

import contextlib
import io
import json
import re
import struct
from collections.abc import Iterable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import (
    QuantizedSwitchLinear,
    SwitchGLU,
    SwitchLinear,
    SwitchMLP,
)
from mlx_lm.utils import load_model

from engine.errors import CorruptData, NotFound, ShoalError
from engine.manifest import MoeLayer
from engine.mtp import model_classes as mtp_model_classes

# The seam: mlx-lm's routed-expert modules, called as `module(x, inds)` by every MoE block,
# whatever attribute name the block keeps them under (switch_mlp, experts, switch_glu, ...).
SWITCH_CLASSES = (SwitchGLU, SwitchMLP)
SWITCH_LINEARS = (SwitchLinear, QuantizedSwitchLinear)
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def get_module(model: nn.Module, path: str) -> nn.Module:
    """The submodule at a dotted path such as "model.layers.3.mlp.switch_mlp"."""
    node = model
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _expert_counts(config: dict) -> list[int]:
    """Expert counts a config states, top level or nested (text_config of llama4, gemma4)."""
    nested = [v for v in config.values() if isinstance(v, dict)]
    return [c[k] for c in (config, *nested) for k in _EXPERT_COUNT_KEYS
            if isinstance(c.get(k), int) and not isinstance(c.get(k), bool)]


def find_moe_layers(model: nn.Module, config: dict) -> tuple[MoeLayer, ...]:
    """Every routed-expert switch module in the model (found by its mlx-lm class, wherever
    the block keeps it), or a clear refusal."""
    found = []
    for path, module in model.named_modules():
        if not isinstance(module, SWITCH_CLASSES):
            continue
        stacked = switch_parameters(module)
        params = tuple(name for name, _ in stacked)
        counts = {name: arr.shape[0] for name, arr in stacked}
        if not params or len(set(counts.values())) != 1:
            raise ShoalError(
                f"{path} does not hold experts stacked on a leading axis; Shoal cannot split it"
            )
        # The layer is the first list index on the path (model.layers.3..., transformer.h.3...):
        # named_modules() does not walk layers in order (phixtral's came out reversed).
        match = re.search(r"(?:^|\.)(\d+)\.", path)
        layer = int(match.group(1)) if match else len(found)
        if path.startswith("mtp."):  # engine/mtp.py: numbered after the last decoder layer
            layer = model["mtp"].index
        found.append(MoeLayer(layer, path, next(iter(counts.values())), params))
    model_type = config.get("model_type", "?")
    if not found:
        if any(count > 1 for count in _expert_counts(config)):
            raise ShoalError(
                f"model type {model_type!r} has experts, but its MoE block does not keep them "
                "in mlx-lm's SwitchGLU/SwitchMLP module, so Shoal cannot serve them remotely"
            )
        raise ShoalError(f"model type {model_type!r} is a dense model: it has no routed experts")
    found.sort(key=lambda layer: layer.layer)
    if len({layer.layer for layer in found}) != len(found):
        raise ShoalError(f"model type {model_type!r} has two switch modules in one layer")
    return tuple(found)


def expert_keys(layers: Iterable[MoeLayer]) -> set[str]:
    """The model's parameter names that are routed experts (split into per-expert files);
    every other parameter is dense."""
    return {f"{layer.path}.{name}" for layer in layers for name in layer.params}


def switch_parameters(module: nn.Module) -> list[tuple[str, mx.array]]:
    """A switch module's routed experts: its switch linears' parameters (weights, and scales
    and biases once quantized). A block may hang other modules on the switch (muse_spark: a
    norm applied after the combination); those stay dense."""
    linears = {name for name, child in module.named_modules() if isinstance(child, SWITCH_LINEARS)}
    return [(name, arr) for name, arr in tree_flatten(module.parameters())
            if name.rsplit(".", 1)[0] in linears]


def layer_bytes(model: nn.Module, layer: MoeLayer) -> int:
    """Bytes of one layer's routed experts, all of them, as the module holds them now."""
    return sum(arr.nbytes for _, arr in switch_parameters(get_module(model, layer.path)))


# ---------------------------------------------------------------------------------------
# Loading a source checkpoint


def check_safetensors(path: Path) -> None:
    """Refuse a safetensors file whose header is unreadable or whose data is cut short."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise CorruptData(f"{path} is truncated or not a safetensors file")
            header = json.loads(f.read(header_len))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError):
        raise CorruptData(f"{path} is not a readable safetensors file") from None
    except OSError as e:
        raise ShoalError(f"cannot read {path}: {e.strerror}") from None
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    needed = 8 + header_len + max(ends, default=0)
    if needed > size:
        raise CorruptData(f"{path} is truncated: its header needs {needed} bytes, file has {size}")


def weight_files(model_dir: Path) -> list[Path]:
    """The weight files of a model folder, in order."""
    return sorted(model_dir.glob("model*.safetensors"))


def resolve_model_dir(model_dir: Path) -> Path:
    """A model folder, or a Hugging Face cache entry (models--ORG--NAME, as `hf download`
    leaves it) -> the snapshot folder that holds config.json and the weights (symlinks into
    blobs/, read through as ordinary files)."""
    model_dir = Path(model_dir)
    snapshots = model_dir / "snapshots"
    if (model_dir / "config.json").exists() or not snapshots.is_dir():
        return model_dir
    ref = model_dir / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        return snapshots / ref.read_text().strip()
    found = sorted(p for p in snapshots.iterdir() if (p / "config.json").exists())
    if len(found) != 1:
        names = ", ".join(p.name[:12] for p in found) or "none with a config.json"
        raise NotFound(f"{model_dir} is a Hugging Face cache entry with snapshots {names}: "
                       "give the snapshot folder (snapshots/HASH) to use")
    return found[0]


def load_source(model_dir: Path) -> tuple[nn.Module, dict]:
    """Load any mlx-lm checkpoint lazily (weights are read only when evaluated)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise NotFound(f"{model_dir} has no config.json: is it a model folder?")
    files = weight_files(model_dir)
    if not files:
        raise NotFound(f"{model_dir} has no model*.safetensors weight files")
    for path in files:
        check_safetensors(path)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return load_model(model_dir, lazy=True, get_model_classes=mtp_model_classes)
    except ValueError as e:
        raise ShoalError(f"mlx-lm cannot load {model_dir}: {e}") from None
    except json.JSONDecodeError as e:
        raise CorruptData(f"{model_dir}/config.json is not valid JSON ({e})") from None

