"""The model's own multi-token-prediction (MTP) module, which mlx-lm's loaders drop: read from
the published checkpoint's layout and attached to the model as `model.mtp`, so that sharding,
sizes, workers and the coordinator's dispatch treat its experts as those of any other layer."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.utils import _get_classes, infer_quant_config

from engine.errors import CorruptData
from engine.manifest import Manifest

MTP = "mtp"  # the attribute, and the parameter prefix, of the module on the model
# Architectures whose published checkpoints keep the MTP module as one more decoder layer,
# numbered after the last (model.layers.N), and whose mlx-lm model file drops it.
LAYER_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "glm4_moe")
# Tensors of that layer that are the MTP module's own rather than its decoder block's.
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


class SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float, *, head: bool) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=eps)
        if head:  # else the main model's lm_head, which the published module shares
            self.head = nn.Linear(hidden, vocab, bias=False)


class MtpModule(nn.Module):
    """DeepSeek-V3's MTP depth: h' = block(eh_proj([enorm(embed(t+1)), hnorm(h)])), logits =
    head(shared_head.norm(h')). `index` is its layer number in the checkpoint (after the last
    decoder layer), under which its experts are stored and dispatched."""

    def __init__(self, model: nn.Module, *, head: bool = False, embed: bool = False) -> None:
        super().__init__()
        args = model.args
        hidden, eps, vocab = args.hidden_size, args.rms_norm_eps, args.vocab_size
        self.index = int(args.num_hidden_layers)
        self.enorm = nn.RMSNorm(hidden, eps=eps)
        self.hnorm = nn.RMSNorm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = type(model.layers[-1])(args, self.index)  # the architecture's own layer
        self.shared_head = SharedHead(hidden, vocab, eps, head=head)
        if embed:
            self.embed_tokens = nn.Embedding(vocab, hidden)

    def __call__(self, model: nn.Module, hidden: mx.array, tokens: mx.array,
                 cache) -> tuple[mx.array, mx.array]:
        """(h', logits) for rows (hidden state of position i, token i + 1): each row's guess
        for token i + 2."""
        embed = self.embed_tokens if "embed_tokens" in self else model.model.embed_tokens
        x = mx.concatenate([self.enorm(embed(tokens)), self.hnorm(hidden)], axis=-1)
        x = self.eh_proj(x)
        h = self.block(x, create_attention_mask(x, cache, return_array=True), cache)
        out = self.shared_head.norm(h)
        head = self.shared_head.head if "head" in self.shared_head else model.lm_head
        return h, head(out)


def supports(config: dict) -> bool:
    """Whether the config states an MTP module of an architecture Shoal can run it for."""
    return config.get("model_type") in LAYER_MODEL_TYPES and \
        int(config.get("num_nextn_predict_layers") or 0) > 0


def without_mtp(manifest: Manifest) -> Manifest:
    """The manifest with the main model's MoE layers only."""
    return replace(manifest, layers=tuple(layer for layer in manifest.layers
                                          if not layer.path.startswith(f"{MTP}.")))


def trunk(model: nn.Module, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
    """The main model's forward split where the MTP module reads it: (last hidden states, after
    the final norm, as the module was trained on; logits)."""
    hidden = model.model(tokens, cache)
    return hidden, model.lm_head(hidden)


def model_classes(config: dict) -> tuple[type, type]:
    """mlx-lm's classes for `config` (load_model's get_model_classes), whose sanitize also sets
    the MTP layer's tensors aside where mlx-lm's would keep them (deepseek_v3 drops
    model.layers.61 only, whatever the model's depth), so that a strict load accepts them."""
    model_class, args_class = _get_classes(config)
    if config.get("model_type") not in LAYER_MODEL_TYPES:
        return model_class, args_class

    class WithoutMtp(model_class):
        def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            mtp = (_checkpoint_prefix(self), f"{MTP}.")
            return super().sanitize({k: v for k, v in weights.items() if not k.startswith(mtp)})

    return WithoutMtp, args_class


def _checkpoint_prefix(model: nn.Module) -> str:
    return f"model.layers.{model.args.num_hidden_layers}."


def module_name(key: str, prefix: str) -> str:
    """A checkpoint key of the MTP layer -> the parameter's name under model.mtp."""
    rest = key[len(prefix):]
    return f"{MTP}.{rest}" if rest.startswith(_OWN) else f"{MTP}.block.{rest}"


def checkpoint_name(name: str, model: nn.Module) -> str:
    """model.mtp's parameter name -> its key in the published layout (the inverse)."""
    rest = name[len(MTP) + 1:]
    return _checkpoint_prefix(model) + rest.removeprefix("block.")


def attach_skeleton(model: nn.Module, config: dict) -> None:
    """Give a skeleton (lazy weights, never evaluated) the MTP module the config states, so
    that its experts' layer has a switch module there, as every other layer has."""
    if supports(config) and MTP not in model:
        model[MTP] = MtpModule(model)


def mtp_weights(model: nn.Module, raw: dict[str, mx.array]) -> dict[str, mx.array]:
    """The MTP layer's tensors among a checkpoint's raw ones (the published keys or those Shoal
    wrote), named as model.mtp's parameters, through the architecture's own sanitize (expert
    stacking, FP8 and latent-attention rewriting) as if they were layer 0's."""
    prefix = _checkpoint_prefix(model)
    found = {module_name(k, prefix): v for k, v in raw.items() if k.startswith(prefix)}
    found.update({k: v for k, v in raw.items() if k.startswith(f"{MTP}.")})
    if not found:
        return {}
    layer = "model.layers.0."
    as_layer = {layer + k[len(MTP) + 1:].removeprefix("block."): v for k, v in found.items()}
    if hasattr(model, "sanitize"):
        as_layer = model.sanitize(as_layer)
    return {module_name(k, layer): v for k, v in as_layer.items()}


def attach(model: nn.Module, config: dict, weights: dict[str, mx.array], *,
           routed: frozenset[str] = frozenset()) -> MtpModule | None:
    """Build model.mtp from its tensors (mtp_weights), quantized as they were, and load them;
    None when there are none. The `routed` parameters (full names) may be absent: their
    experts are served elsewhere."""
    if not weights:
        return None
    module = MtpModule(model, head=f"{MTP}.shared_head.head.weight" in weights,
                       embed=f"{MTP}.embed_tokens.weight" in weights)
    quantization = config.get("quantization")
    if quantization:
        def predicate(path: str, child: nn.Module) -> bool | dict:
            full = f"{MTP}.{path}"
            if full in quantization:
                return quantization[full]
            if not hasattr(child, "to_quantized") or f"{full}.scales" not in weights:
                return False
            return infer_quant_config(full, child, weights)

        nn.quantize(module, group_size=quantization["group_size"], bits=quantization["bits"],
                    mode=quantization.get("mode", "affine"), class_predicate=predicate)
    names = {k for k, _ in tree_flatten(module.parameters())}
    given = {k[len(MTP) + 1:]: v for k, v in weights.items()}
    absent = sorted(names - set(given) - {k[len(MTP) + 1:] for k in routed})
    if absent or set(given) - names:
        what = absent[0] if absent else sorted(set(given) - names)[0]
        raise CorruptData(f"the MTP module's weights do not fit its architecture ({what})")
    module.load_weights(list(given.items()), strict=False)
    model[MTP] = module
    return module


def attach_from_files(model: nn.Module, config: dict, files: list[Path], *,
                      routed: frozenset[str] = frozenset()) -> MtpModule | None:
    """model.mtp from the MTP tensors in safetensors files (a source checkpoint in the published
    or mlx-lm's layout, or Shoal's dense part, where the `routed` experts are absent); None
    when the files hold none or the architecture has no MTP layer Shoal knows."""
    if config.get("model_type") not in LAYER_MODEL_TYPES:
        return None
    keep = re.compile(rf"^(?:{MTP}\.|{re.escape(_checkpoint_prefix(model))})")
    raw = {}
    for path in files:
        raw.update({k: v for k, v in mx.load(str(path)).items() if keep.match(k)})
    return attach(model, config, mtp_weights(model, raw), routed=routed)
