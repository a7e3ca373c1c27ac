"""Build small random mlx-lm MoE checkpoints for tests and benchmarks, with an MTP module if asked:
the same arguments give byte-identical files, in mlx-lm's or HF's layout. The config comes from
builders/synthetic_config.py, the tokenizer from builders/synthetic_tokenizer.py."""

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import _get_classes, load_model, quantize_model, save_config, save_model

from builders.families import TINY
from builders.synthetic_config import FAMILIES, check_choice, model_config
from builders.synthetic_tokenizer import build_tokenizer
from engine.errors import ShoalError
from engine.mtp import LAYER_MODEL_TYPES, MTP, MtpModule, checkpoint_name, model_classes

LAYOUTS: tuple[str, ...] = ("mlx", "hf")
# An MTP module: random, or right by construction (`_make_bigram`).
MTP_MODULES: tuple[str, ...] = ("random", "bigram")
DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "bfloat16": mx.bfloat16,
    "float16": mx.float16,
}

# Router logits get about this standard deviation, so that the top-k choice is
# decisive and differs between tokens (mlx-lm's default init gives ~0.6, and
# DeepSeek's gate starts at zero, which routes every token the same way).
_ROUTER_LOGIT_STD = 2.0
_SCORE_BIAS_STD = 0.05
# Spreading the logits (std ~2.5 instead of ~0.6) keeps the top two apart by
# more than 1e-3 at almost every position, so greedy decoding does not flip
# under float rounding differences between local and distributed runs.
_LM_HEAD_SCALE = 4.0
# Where the head is the embedding (hunyuan, lfm2_moe), scaling it up would make every model
# repeat its last input token (the residual stream is mostly that token's embedding); scaled
# down, the blocks' outputs decide the next token instead.
_TIED_EMBEDDING_SCALE = 0.25

# A switch module's decoder layer ("model.layers.3" of "model.layers.3.mlp.switch_mlp").
_LAYER = re.compile(r"^(.*\b(?:layers|h)\.\d+)\.")

# Mixtral names its expert projections w1/w2/w3 in Hugging Face checkpoints.
_HF_EXPERT_PROJ = {
    "mixtral": {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
    "qwen3_moe": {"gate_proj": "gate_proj", "down_proj": "down_proj", "up_proj": "up_proj"},
    "deepseek_v3": {"gate_proj": "gate_proj", "down_proj": "down_proj", "up_proj": "up_proj"},
    # written with an MTP module only
    "glm4_moe": {"gate_proj": "gate_proj", "down_proj": "down_proj", "up_proj": "up_proj"},
}


def build_checkpoint(
    out_dir: Path,
    family: str,
    *,
    size: str = "tiny",
    seed: int = 0,
    quantize_bits: int | None = None,
    group_size: int = 32,
    layout: str = "mlx",
    dtype: str = "float32",
    mtp: str | None = None,
) -> Path:
    """Write a random checkpoint that mlx_lm.load(out_dir) loads; return out_dir.

    Seeds MLX's global random state with ``seed``. ``mtp`` adds an MTP module in the published
    layout (DeepSeek-V3's and GLM-4.5's: one more decoder layer, model.layers.N, with enorm,
    hnorm, eh_proj and a shared head): "random", or "bigram", right by construction: every
    attention and MLP output is zero, so the next token depends on the current one alone, and
    the module passes the embedding of the token it is given to the same head, so its guess of
    the token after next is the main model's own (up to float rounding of one more norm).
    """
    out_dir = Path(out_dir)
    _check_options(out_dir, layout, dtype, quantize_bits, group_size)
    if mtp is not None:
        check_choice("mtp", mtp, MTP_MODULES)
        if family not in LAYER_MODEL_TYPES:
            raise ShoalError(f"an MTP module is built for {', '.join(LAYER_MODEL_TYPES)} only")
    hf_families = FAMILIES if mtp is None else tuple(_HF_EXPERT_PROJ)
    if layout == "hf" and family not in hf_families:
        raise ShoalError(f"the hf layout is written for {', '.join(hf_families)} only, "
                         f"not {family}")
    config = model_config(family, size)
    if mtp is not None:
        config["num_nextn_predict_layers"] = 1
    config["torch_dtype"] = dtype
    model = random_model(config, seed)
    if mtp is not None:
        _add_mtp(model, bigram=mtp == "bigram")
    _cast(model, DTYPES[dtype])
    packed = TINY[family].packed if family in TINY else None
    if packed is not None:
        model, config = _quantize_packed(model, config, packed, quantize_bits)
    elif quantize_bits is not None:
        model, config = quantize_model(model, config, group_size, quantize_bits)
    out_dir.mkdir(parents=True, exist_ok=True)
    if layout == "mlx" and mtp is None:
        save_model(out_dir, model)
    else:
        # the module's tensors under the published names (model.layers.N...)
        weights = {checkpoint_name(k, model) if k.startswith(f"{MTP}.") else k: v
                   for k, v in tree_flatten(model.parameters())}
        if layout == "hf":
            weights = hf_weights(family, config, weights)
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights,
                            {"format": "mlx" if layout == "mlx" else "pt"})
    save_config(config, out_dir / "config.json")
    build_tokenizer(out_dir)
    return out_dir


def _add_mtp(model: nn.Module, *, bigram: bool) -> None:
    mtp = MtpModule(model, head=True, embed=True)
    for router in _routers(mtp):
        _randomize_router(router)
    # The published module's embedding and head are copies of the main model's.
    mtp.embed_tokens.weight = model.model.embed_tokens.weight
    mtp.shared_head.head.weight = model.lm_head.weight
    model[MTP] = mtp
    if bigram:
        for layer in model.layers:
            _zero_outputs(layer)
        _zero_outputs(mtp.block)
        hidden = mtp.enorm.weight.shape[0]
        mtp.hnorm.weight = mx.zeros_like(mtp.hnorm.weight)
        mtp.eh_proj.weight = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))],
                                            axis=1)
        mtp.shared_head.norm.weight = model.model.norm.weight
    mx.eval(model.parameters())


def _zero_outputs(block: nn.Module) -> None:
    """A decoder layer that adds nothing to the residual stream: its attention's and every
    MLP's (routed, shared, dense) output projection at zero."""
    for path, module in block.named_modules():
        if path.endswith(("o_proj", "down_proj")) and "weight" in module:
            module.weight = mx.zeros_like(module.weight)
            if "bias" in module:
                module.bias = mx.zeros_like(module.bias)


def _quantize_packed(
    model: nn.Module, config: dict[str, Any], packed: tuple[int, int], bits: int | None
) -> tuple[nn.Module, dict[str, Any]]:
    """Quantize every quantizable module one way, as a family that exists only so requires
    (its config already names that quantization and must name nothing else)."""
    packed_bits, packed_group = packed
    if bits not in (None, packed_bits):
        raise ShoalError(f"{config['model_type']} is built {packed_bits}-bit only")
    plain = {k: v for k, v in config.items() if k != "quantization"}
    model, plain = quantize_model(model, plain, packed_group, packed_bits,
                                  quant_predicate=lambda path, module: True)
    return model, {**plain, "quantization": config["quantization"]}


def _check_options(
    out_dir: Path, layout: str, dtype: str, quantize_bits: int | None, group_size: int
) -> None:
    check_choice("layout", layout, LAYOUTS)
    check_choice("dtype", dtype, tuple(DTYPES))
    if quantize_bits is not None:
        check_choice("quantize_bits", quantize_bits, (2, 3, 4, 5, 6, 8))
        check_choice("group_size", group_size, (32, 64, 128))
        if layout == "hf":
            raise ShoalError("the hf layout is only written unquantized; use layout='mlx'")
    # Stale weight files would be loaded alongside the new ones (mlx-lm globs model*.safetensors).
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ShoalError(f"{out_dir} is not empty; build a checkpoint into a new folder")



def random_model(config: dict[str, Any], seed: int) -> nn.Module:
    """Instantiate mlx-lm's model for config with its default init and decisive routers."""
    # mlx-lm's own choice of model class (it remaps some model types and architectures).
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    for router in _routers(model):
        _randomize_router(router)
    packed = _packed_modules(model)
    for module in packed:
        _randomize_packed(module)
    head = _output_head(model, config["vocab_size"])
    if not any(module is head for module in packed):  # a packed head keeps its codes
        tied = isinstance(head, nn.Embedding)
        head.weight = head.weight * (_TIED_EMBEDDING_SCALE if tied else _LM_HEAD_SCALE)
    mx.eval(model.parameters())
    return model


def _routers(model: nn.Module) -> list[nn.Module]:
    """The modules that score each switch module's experts: a 2-D weight with one row per
    expert, next to the switch module in its block, or else elsewhere in its decoder layer
    (Gemma 4 keeps the router beside the block)."""
    modules = dict(model.named_modules())
    found: set[str] = set()
    for path, module in modules.items():
        if not isinstance(module, (SwitchGLU, SwitchMLP)):
            continue
        num_experts = next(iter(tree_flatten(module.parameters())))[1].shape[0]
        layer = _LAYER.match(path)
        for scope in (path.rpartition(".")[0], layer.group(1) if layer else ""):
            scores = {other for other, candidate in modules.items()
                      if other.startswith(f"{scope}.") and not other.startswith(path)
                      and _scores_experts(candidate, num_experts)}
            if scores:
                found |= scores
                break
    # In model order, so that the random draws (and so the files) do not depend on the search.
    return [module for path, module in modules.items() if path in found]


def _scores_experts(module: nn.Module, num_experts: int) -> bool:
    weight = module.get("weight")
    return isinstance(weight, mx.array) and weight.ndim == 2 and weight.shape[0] == num_experts


def _randomize_router(gate: nn.Module) -> None:
    num_experts, hidden = gate.weight.shape
    # Inputs to the router are RMS-normed, so this std gives logits of std _ROUTER_LOGIT_STD.
    std = _ROUTER_LOGIT_STD / hidden**0.5
    gate.weight = mx.random.normal((num_experts, hidden)) * std
    if "e_score_correction_bias" in gate:
        gate.e_score_correction_bias = mx.random.normal((num_experts,)) * _SCORE_BIAS_STD


def _packed_modules(model: nn.Module) -> list[nn.Module]:
    """Modules that mlx-lm builds already quantized and frozen, at zero (prism's Hadamard
    packs): their codes come from the checkpoint, so a random one must supply them."""
    return [m for _, m in model.named_modules()
            if isinstance(m.get("weight"), mx.array) and m.weight.dtype == mx.uint32
            and "scales" in m and not isinstance(m, nn.QuantizedLinear)]


def _rows(module: nn.Module) -> int:
    return module.scales.shape[0] if "scales" in module else module.weight.shape[0]


def _randomize_packed(module: nn.Module) -> None:
    weight = module.weight
    width = weight.shape[1] * 32 // module.bits
    codes = mx.random.randint(0, 2**32 - 1, weight.shape, dtype=mx.uint32)
    # Codes 0..2^bits-1 times scale plus bias: weights spread evenly over +-1/sqrt(width).
    scale = (2.0 / width**0.5) / (2**module.bits - 1)
    module.weight = codes
    module.scales = mx.full(module.scales.shape, scale, dtype=module.scales.dtype)
    module.biases = mx.full(module.biases.shape, -scale * (2**module.bits - 1) / 2,
                            dtype=module.biases.dtype)
    if "signs" in module:
        module.signs = mx.where(mx.random.uniform(shape=module.signs.shape) < 0.5, -1.0, 1.0)


def _output_head(model: nn.Module, rows: int) -> nn.Module:
    """The projection to the vocabulary: a linear layer with one row per token, or the
    embedding where the two are tied."""
    packed = {id(m) for m in _packed_modules(model)}
    linear = [m for _, m in model.named_modules()
              if (isinstance(m, nn.Linear) or id(m) in packed) and _rows(m) == rows]
    if linear:
        return linear[0]
    embeddings = [m for _, m in model.named_modules()
                  if isinstance(m, nn.Embedding) and m.weight.shape[0] == rows]
    if not embeddings:
        raise ShoalError("the model has neither an output head nor an embedding to scale")
    return embeddings[0]


def _cast(model: nn.Module, dtype: mx.Dtype) -> None:
    # Same rule as mlx_lm.convert: the model may keep some parameters in float32.
    keep = getattr(model, "cast_predicate", lambda _: True)

    def cast(path: str, value: mx.array) -> mx.array:
        if keep(path) and mx.issubdtype(value.dtype, mx.floating):
            return value.astype(dtype)
        return value

    model.update(tree_map_with_path(cast, model.parameters()))


def hf_weights(
    family: str, config: dict[str, Any], weights: dict[str, mx.array]
) -> dict[str, mx.array]:
    """Rename mlx-lm's weights to the Hugging Face layout that the model's sanitize() reads."""
    out: dict[str, mx.array] = {}
    for key, value in weights.items():
        if ".switch_mlp." in key:
            out.update(_split_experts(family, key, value))
        elif key.endswith(".self_attn.embed_q.weight"):
            out.update(_join_kv_b_proj(config, key, value, weights))
        elif not key.endswith(".self_attn.unembed_out.weight"):
            out[key] = value
    return dict(sorted(out.items()))


def _split_experts(family: str, key: str, stacked: mx.array) -> dict[str, mx.array]:
    # "...switch_mlp.gate_proj.weight" of shape (E, out, in) -> one (out, in) key per expert.
    prefix, rest = key.split(".switch_mlp.")
    proj, param = rest.split(".")
    hf_proj = _HF_EXPERT_PROJ[family][proj]
    return {f"{prefix}.experts.{e}.{hf_proj}.{param}": stacked[e] for e in range(stacked.shape[0])}


def _join_kv_b_proj(
    config: dict[str, Any], key: str, embed_q: mx.array, weights: dict[str, mx.array]
) -> dict[str, mx.array]:
    # Inverse of deepseek_v3 sanitize(): kv_b_proj is, per head, the rows of the
    # key's no-rope part (embed_q transposed) followed by the value rows.
    prefix = key.removesuffix(".embed_q.weight")
    unembed_out = weights[f"{prefix}.unembed_out.weight"]
    per_head = mx.concatenate([embed_q.swapaxes(-1, -2), unembed_out], axis=1)
    return {f"{prefix}.kv_b_proj.weight": per_head.reshape(-1, config["kv_lora_rank"])}


# Files a model folder's tokenizer may consist of; a draft built beside a model copies them.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "vocab.json", "merges.txt")


def build_random_draft(out_dir: Path, like: Path, *, seed: int = 1) -> Path:
    """Write a small random dense Llama with the tokenizer and vocabulary of the checkpoint at
    `like`: a draft model for speculative decoding that (almost) never agrees with it."""
    out_dir = Path(out_dir)
    _check_options(out_dir, "mlx", "float32", None, 32)
    source = json.loads((Path(like) / "config.json").read_text())
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": source["vocab_size"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        **{key: source[key] for key in ("bos_token_id", "eos_token_id") if key in source},
    }
    return _save_draft(out_dir, random_model(config, seed), config, like)


def build_bigram_draft(out_dir: Path, like: Path) -> Path:
    """A one-layer dense Llama that predicts exactly what a `mtp="bigram"` checkpoint at `like`
    does (its embedding, final norm and head, a layer that adds nothing): a draft model as right
    as that checkpoint's MTP module, to compare the two draft paths at the same acceptance."""
    out_dir = Path(out_dir)
    _check_options(out_dir, "mlx", "float32", None, 32)
    source, source_config = load_model(Path(like), get_model_classes=model_classes)
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": source.args.vocab_size, "hidden_size": source.args.hidden_size,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 4, "rms_norm_eps": source.args.rms_norm_eps,
        "rope_theta": 10000.0, "tie_word_embeddings": False,
        **{k: source_config[k] for k in ("bos_token_id", "eos_token_id") if k in source_config},
    }
    draft = random_model(config, 0)
    _zero_outputs(draft.model.layers[0])
    draft.model.embed_tokens.weight = source.model.embed_tokens.weight
    draft.model.norm.weight = source.model.norm.weight
    draft.lm_head.weight = source.lm_head.weight
    _cast(draft, source.model.norm.weight.dtype)
    return _save_draft(out_dir, draft, config, like)


def _save_draft(out_dir: Path, model: nn.Module, config: dict[str, Any], like: Path) -> Path:
    """A draft model's folder: its weights and config, the tokenizer of the model at `like`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    for name in _TOKENIZER_FILES:
        if (Path(like) / name).exists():
            (out_dir / name).write_bytes((Path(like) / name).read_bytes())
    return out_dir
