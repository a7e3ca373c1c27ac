"""Build mlx-lm's own switch module over a subset of one layer's experts, and run it.

The module class, activation and quantization all come from the model's mlx-lm
architecture, so a worker computes exactly what the single-process model would.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes, infer_quant_config

from engine.checkpoint import MoeLayer, get_module
from engine.errors import CorruptData, InvalidInput, ShoalError


def build_skeleton(config: dict) -> nn.Module:
    """The model's mlx-lm module tree with lazy random weights that are never evaluated."""
    try:
        model_class, args_class = _get_classes(config)
    except ValueError as e:
        kind = config.get("model_type")
        raise ShoalError(f"this mlx-lm cannot build model type {kind}: {e}") from None
    with contextlib.redirect_stdout(io.StringIO()):
        return model_class(args_class.from_dict(config))


def _quantize_like_checkpoint(
    module: nn.Module, path: str, config: dict, weights: dict[str, mx.array]
) -> None:
    """Quantize the switch module's linears the way mlx-lm's loader would for these weights."""
    quantization = config.get("quantization")
    if not quantization:
        return

    def predicate(relative: str, child: nn.Module) -> bool | dict:
        full = f"{path}.{relative}"
        if full in quantization:
            return quantization[full]
        if not hasattr(child, "to_quantized") or f"{relative}.scales" not in weights:
            return False
        params = infer_quant_config(relative, child, weights)
        if f"{relative}.global_scale" in weights:
            params["global_scale"] = True
        return params

    nn.quantize(
        module,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


@dataclass(frozen=True)
class LayerExperts:
    """The experts of one MoE layer that this process holds, ready to run."""

    layer: MoeLayer
    expert_ids: tuple[int, ...]  # global ids, ascending; local index = position here
    local_index: np.ndarray  # (num_experts,) int32: global id -> local index, -1 if not held
    module: nn.Module

    def __call__(self, hidden: mx.array, rows: np.ndarray, experts: np.ndarray) -> mx.array:
        """output[i] = expert experts[i] applied to hidden[rows[i]]; shape (m, hidden_size)."""
        local = mx.array(self.local_index[experts])[:, None]
        out = self.module(hidden[mx.array(rows)], local)
        return out[:, 0, :]


def build_layer_experts(
    skeleton: nn.Module,
    config: dict,
    layer: MoeLayer,
    tensors: dict[int, dict[str, mx.array]],
) -> LayerExperts:
    """Stack the given experts' tensors (expert id -> name -> array) into the layer's module."""
    if not tensors:
        raise InvalidInput(f"layer {layer.layer}: no experts given")
    ids = tuple(sorted(tensors))
    for expert in ids:
        if not 0 <= expert < layer.num_experts:
            raise InvalidInput(f"layer {layer.layer} has no expert {expert}")
        if set(tensors[expert]) != set(layer.params):
            raise CorruptData(
                f"expert {layer.layer}/{expert} holds tensors {sorted(tensors[expert])}, "
                f"expected {sorted(layer.params)}"
            )
    stacked = {name: mx.stack([tensors[e][name] for e in ids]) for name in layer.params}
    module = get_module(skeleton, layer.path)
    _quantize_like_checkpoint(module, layer.path, config, stacked)
    expected = dict(tree_flatten(module.parameters()))
    for name, array in stacked.items():
        if name not in expected or tuple(expected[name].shape[1:]) != tuple(array.shape[1:]):
            shape = None if name not in expected else tuple(expected[name].shape[1:])
            raise CorruptData(
                f"expert tensor {layer.path}.{name} has shape {tuple(array.shape[1:])}, "
                f"the model expects {shape}"
            )
    module.update(tree_unflatten(list(stacked.items())))
    mx.eval(module.parameters())
    local_index = np.full(layer.num_experts, -1, dtype=np.int32)
    local_index[list(ids)] = np.arange(len(ids), dtype=np.int32)
    return LayerExperts(layer, ids, local_index, module)
