"""Build small random mlx-lm MoE checkpoints and their byte-level BPE tokenizer.

For tests and benchmarks: the same arguments give byte-identical files, in mlx-lm's or HF's layout.
"""

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import quantize_model, save_config, save_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.errors import ShoalError

FAMILIES: tuple[str, ...] = ("qwen3_moe", "mixtral", "deepseek_v3")
SIZES: tuple[str, ...] = ("tiny", "bench")
LAYOUTS: tuple[str, ...] = ("mlx", "hf")
DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "bfloat16": mx.bfloat16,
    "float16": mx.float16,
}

SPECIAL_TOKENS: tuple[str, ...] = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB_SIZE = 300  # 5 special + 256 byte tokens + 39 merges

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog, and the dog does not mind.
A shoal of fish moves as one, yet every fish swims on its own.
Hello world! Hello there, how are you today? I am well, thank you.
In a mixture of experts, a router sends every token to a few of the experts.
The experts live on many machines, and the answer comes back in the same order.
She sells sea shells by the sea shore; the shells she sells are sea shells.
"""

# Router logits get about this standard deviation, so that the top-k choice is
# decisive and differs between tokens (mlx-lm's default init gives ~0.6, and
# DeepSeek's gate starts at zero, which routes every token the same way).
_ROUTER_LOGIT_STD = 2.0
_SCORE_BIAS_STD = 0.05
# Spreading the logits (std ~2.5 instead of ~0.6) keeps the top two apart by
# more than 1e-3 at almost every position, so greedy decoding does not flip
# under float rounding differences between local and distributed runs.
_LM_HEAD_SCALE = 4.0

# Mixtral names its expert projections w1/w2/w3 in Hugging Face checkpoints.
_HF_EXPERT_PROJ = {
    "mixtral": {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
    "qwen3_moe": {"gate_proj": "gate_proj", "down_proj": "down_proj", "up_proj": "up_proj"},
    "deepseek_v3": {"gate_proj": "gate_proj", "down_proj": "down_proj", "up_proj": "up_proj"},
}
_HF_ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


@dataclass(frozen=True)
class Shape:
    """The sizes of one synthetic model, shared by all families."""

    hidden_size: int
    num_layers: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    dense_intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Multi-head latent attention and grouped routing (deepseek_v3 only).
    q_lora_rank: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    n_group: int
    topk_group: int


SHAPES: dict[str, Shape] = {
    "tiny": Shape(
        hidden_size=64,
        num_layers=3,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=32,
        dense_intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        n_group=1,
        topk_group=1,
    ),
    # DeepSeek-V3 in miniature: 64 routed experts + 1 shared, top-8 from 4 of 8 groups.
    "bench": Shape(
        hidden_size=1024,
        num_layers=12,
        num_experts=64,
        top_k=8,
        moe_intermediate_size=512,
        dense_intermediate_size=2816,
        num_heads=8,
        num_kv_heads=8,
        head_dim=128,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_rope_head_dim=64,
        n_group=8,
        topk_group=4,
    ),
}


def build_tokenizer(out_dir: Path) -> None:
    """Write tokenizer.json + tokenizer_config.json (with a chat_template) + special tokens."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer().save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": "<|bos|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special)


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE: special tokens first, then the 256 bytes, then merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT.splitlines(), trainer=trainer)
    return tokenizer


def model_config(family: str, size: str = "tiny") -> dict[str, Any]:
    """The config.json that mlx-lm reads for a synthetic model (unquantized)."""
    _check_choice("family", family, FAMILIES)
    _check_choice("size", size, SIZES)
    shape = SHAPES[size]
    tokenizer = train_tokenizer()
    common = {
        "model_type": family,
        "architectures": [_HF_ARCHITECTURES[family]],
        "vocab_size": tokenizer.get_vocab_size(),
        "bos_token_id": tokenizer.token_to_id("<|bos|>"),
        "eos_token_id": [tokenizer.token_to_id("<|eos|>"), tokenizer.token_to_id("<|im_end|>")],
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "num_experts_per_tok": shape.top_k,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    family_fields = {
        "qwen3_moe": _qwen3_moe_fields,
        "mixtral": _mixtral_fields,
        "deepseek_v3": _deepseek_v3_fields,
    }[family](shape)
    return {**common, **family_fields}


def _qwen3_moe_fields(shape: Shape) -> dict[str, Any]:
    return {
        "head_dim": shape.head_dim,
        "num_experts": shape.num_experts,
        "moe_intermediate_size": shape.moe_intermediate_size,
        # Only read for layers in mlp_only_layers; every layer here is sparse.
        "intermediate_size": shape.dense_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rope_theta": 1000000.0,
    }


def _mixtral_fields(shape: Shape) -> dict[str, Any]:
    # mlx-lm's mixtral derives head_dim as hidden_size // num_attention_heads
    # (every shape keeps them consistent) and reads intermediate_size as the
    # width of each expert.
    return {
        "num_local_experts": shape.num_experts,
        "intermediate_size": shape.moe_intermediate_size,
        "rope_theta": 1000000.0,
    }


def _deepseek_v3_fields(shape: Shape) -> dict[str, Any]:
    return {
        "n_routed_experts": shape.num_experts,
        "n_shared_experts": 1,
        "moe_intermediate_size": shape.moe_intermediate_size,
        "intermediate_size": shape.dense_intermediate_size,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": shape.n_group,
        "topk_group": shape.topk_group,
        "q_lora_rank": shape.q_lora_rank,
        "kv_lora_rank": shape.kv_lora_rank,
        "qk_rope_head_dim": shape.qk_rope_head_dim,
        "qk_nope_head_dim": shape.head_dim,
        "v_head_dim": shape.head_dim,
        "rope_theta": 10000.0,
        "attention_bias": False,
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
) -> Path:
    """Write a random checkpoint that mlx_lm.load(out_dir) loads; return out_dir.

    Seeds MLX's global random state with ``seed``.
    """
    out_dir = Path(out_dir)
    _check_options(out_dir, layout, dtype, quantize_bits, group_size)
    config = model_config(family, size)
    config["torch_dtype"] = dtype
    model = random_model(config, seed)
    _cast(model, DTYPES[dtype])
    if quantize_bits is not None:
        model, config = quantize_model(model, config, group_size, quantize_bits)
    out_dir.mkdir(parents=True, exist_ok=True)
    if layout == "mlx":
        save_model(out_dir, model)
    else:
        weights = hf_weights(family, config, dict(tree_flatten(model.parameters())))
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, {"format": "pt"})
    save_config(config, out_dir / "config.json")
    build_tokenizer(out_dir)
    return out_dir


def _check_options(
    out_dir: Path, layout: str, dtype: str, quantize_bits: int | None, group_size: int
) -> None:
    _check_choice("layout", layout, LAYOUTS)
    _check_choice("dtype", dtype, tuple(DTYPES))
    if quantize_bits is not None:
        _check_choice("quantize_bits", quantize_bits, (2, 3, 4, 5, 6, 8))
        _check_choice("group_size", group_size, (32, 64, 128))
        if layout == "hf":
            raise ShoalError("the hf layout is only written unquantized; use layout='mlx'")
    # Stale weight files would be loaded alongside the new ones (mlx-lm globs model*.safetensors).
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ShoalError(f"{out_dir} is not empty; build a checkpoint into a new folder")


def _check_choice(name: str, value: object, valid: tuple[Any, ...]) -> None:
    if value not in valid:
        choices = ", ".join(str(v) for v in valid)
        raise ShoalError(f"unknown {name} {value!r}; choose one of: {choices}")


def random_model(config: dict[str, Any], seed: int) -> nn.Module:
    """Instantiate mlx-lm's model for config with its default init and decisive routers."""
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    for path, module in model.named_modules():
        if path.endswith(".gate"):
            _randomize_router(module)
    model.lm_head.weight = model.lm_head.weight * _LM_HEAD_SCALE
    mx.eval(model.parameters())
    return model


def _randomize_router(gate: nn.Module) -> None:
    num_experts, hidden = gate.weight.shape
    # Inputs to the router are RMS-normed, so this std gives logits of std _ROUTER_LOGIT_STD.
    std = _ROUTER_LOGIT_STD / hidden**0.5
    gate.weight = mx.random.normal((num_experts, hidden)) * std
    if "e_score_correction_bias" in gate:
        gate.e_score_correction_bias = mx.random.normal((num_experts,)) * _SCORE_BIAS_STD


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


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


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
    model = random_model(config, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    for name in _TOKENIZER_FILES:
        if (Path(like) / name).exists():
            (out_dir / name).write_bytes((Path(like) / name).read_bytes())
    return out_dir
