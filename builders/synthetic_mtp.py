"""Tiny random checkpoints that carry an MTP module in the published layout (DeepSeek-V3's and
GLM-4.5's: one more decoder layer, model.layers.N, with enorm, hnorm, eh_proj and a shared
head), random or right by construction, for the tests of `--draft mtp`."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, quantize_model, save_config, save_model

from builders.synthetic import (
    _TOKENIZER_FILES,
    DTYPES,
    _cast,
    _check_options,
    _randomize_router,
    _routers,
    hf_weights,
    random_model,
)
from builders.synthetic_config import model_config
from builders.synthetic_tokenizer import build_tokenizer
from engine.errors import ShoalError
from engine.mtp import LAYER_MODEL_TYPES, MTP, MtpModule, checkpoint_name, model_classes


def build_mtp_checkpoint(
    out_dir: Path,
    family: str,
    *,
    size: str = "tiny",
    seed: int = 0,
    quantize_bits: int | None = None,
    group_size: int = 32,
    layout: str = "mlx",
    dtype: str = "float32",
    bigram: bool = False,
) -> Path:
    """Write a random `family` checkpoint with an MTP module; return out_dir.

    With `bigram`, the model is right by construction: every attention and MLP output is zero,
    so the main model's next token depends on the current token alone, and the MTP module
    passes the embedding of the token it is given to the same head, so its guess of the token
    after next is the main model's own (up to float rounding of one more norm)."""
    if family not in LAYER_MODEL_TYPES:
        raise ShoalError(f"an MTP checkpoint is built for {', '.join(LAYER_MODEL_TYPES)} only")
    out_dir = Path(out_dir)
    _check_options(out_dir, layout, dtype, quantize_bits, group_size)
    config = {**model_config(family, size), "num_nextn_predict_layers": 1, "torch_dtype": dtype}
    model = random_model(config, seed)
    mtp = MtpModule(model, head=True, embed=True)
    for router in _routers(mtp):
        _randomize_router(router)
    # The published module's embedding and head are copies of the main model's.
    mtp.embed_tokens.weight = model.model.embed_tokens.weight
    mtp.shared_head.head.weight = model.lm_head.weight
    model[MTP] = mtp
    if bigram:
        _make_bigram(model, mtp)
    _cast(model, DTYPES[dtype])
    mx.eval(model.parameters())
    if quantize_bits is not None:
        model, config = quantize_model(model, config, group_size, quantize_bits)
    weights = {checkpoint_name(k, model) if k.startswith(f"{MTP}.") else k: v
               for k, v in tree_flatten(model.parameters())}
    if layout == "hf":
        weights = hf_weights(family, config, weights)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights,
                        {"format": "mlx" if layout == "mlx" else "pt"})
    save_config(config, out_dir / "config.json")
    build_tokenizer(out_dir)
    return out_dir


def _zero_outputs(block: nn.Module) -> None:
    """A decoder layer that adds nothing to the residual stream: its attention's and every
    MLP's (routed, shared, dense) output projection at zero."""
    for path, module in block.named_modules():
        if path.endswith(("o_proj", "down_proj")) and "weight" in module:
            module.weight = mx.zeros_like(module.weight)
            if "bias" in module:
                module.bias = mx.zeros_like(module.bias)


def _make_bigram(model: nn.Module, mtp: MtpModule) -> None:
    for layer in model.layers:
        _zero_outputs(layer)
    _zero_outputs(mtp.block)
    hidden = mtp.enorm.weight.shape[0]
    mtp.hnorm.weight = mx.zeros_like(mtp.hnorm.weight)
    mtp.eh_proj.weight = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], axis=1)
    mtp.shared_head.norm.weight = model.model.norm.weight


def build_bigram_draft(out_dir: Path, like: Path) -> Path:
    """A one-layer dense Llama that predicts exactly what a `bigram` checkpoint at `like` does
    (its embedding, final norm and head, a layer that adds nothing): a draft model as right as
    that checkpoint's MTP module, to compare the two draft paths at the same acceptance."""
    out_dir = Path(out_dir)
    _check_options(out_dir, "mlx", "float32", None, 32)
    source, source_config = load_model(Path(like), get_model_classes=model_classes)
    hidden, vocab = source.args.hidden_size, source.args.vocab_size
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "rms_norm_eps": source.args.rms_norm_eps, "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        **{k: source_config[k] for k in ("bos_token_id", "eos_token_id") if k in source_config},
    }
    draft = random_model(config, 0)
    _zero_outputs(draft.model.layers[0])
    draft.model.embed_tokens.weight = source.model.embed_tokens.weight
    draft.model.norm.weight = source.model.norm.weight
    draft.lm_head.weight = source.lm_head.weight
    _cast(draft, source.model.norm.weight.dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(out_dir, draft)
    save_config(config, out_dir / "config.json")
    for name in _TOKENIZER_FILES:
        if (Path(like) / name).exists():
            (out_dir / name).write_bytes((Path(like) / name).read_bytes())
    return out_dir
