"""The config.json of each synthetic model: three families at every size (`SHAPES`), every other
mlx-lm MoE family tiny, from its entry in builders/families.py."""

from dataclasses import dataclass
from typing import Any

from builders.families import TINY
from builders.synthetic_tokenizer import train_tokenizer
from engine.errors import ShoalError

# The families with every size; the others of TINY are built tiny only.
FAMILIES: tuple[str, ...] = ("qwen3_moe", "mixtral", "deepseek_v3")
SIZES: tuple[str, ...] = ("tiny", "bench", "deep")

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
    # Deep and narrow: 24 MoE layers (deepseek_v3's first is dense), for what depth changes
    # (an MTP guess costs one MoE layer of 24) at a size a CPU decodes.
    "deep": Shape(
        hidden_size=256,
        num_layers=25,
        num_experts=16,
        top_k=4,
        moe_intermediate_size=128,
        dense_intermediate_size=512,
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_rope_head_dim=32,
        n_group=4,
        topk_group=2,
    ),
}


def all_families() -> tuple[str, ...]:
    """Every family build_checkpoint can build (tiny at least)."""
    return tuple(sorted(set(FAMILIES) | set(TINY), key=str.lower))


def model_config(family: str, size: str = "tiny") -> dict[str, Any]:
    """The config.json that mlx-lm reads for a synthetic model (unquantized)."""
    check_choice("family", family, all_families())
    if family not in FAMILIES:
        check_choice("size", size, ("tiny",))
        return _tiny_config(family)
    check_choice("size", size, SIZES)
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


def _tiny_config(family: str) -> dict[str, Any]:
    """A family's entry of builders/families.py with the tokenizer's vocabulary and ids."""
    tokenizer = train_tokenizer()
    ids = {
        "vocab_size": tokenizer.get_vocab_size(),
        "bos_token_id": tokenizer.token_to_id("<|bos|>"),
        "eos_token_id": [tokenizer.token_to_id("<|eos|>"), tokenizer.token_to_id("<|im_end|>")],
    }
    tiny = TINY[family]
    config = tiny.config(family)
    if tiny.nested:
        # Wrappers read the vocabulary at either level (gemma4 copies its own down).
        config["text_config"] = {**ids, **config["text_config"]}
        return {**ids, **config}
    vocab = {"num_vocab": ids["vocab_size"]} if not tiny.common else {}
    return {**ids, **vocab, **config}


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


def check_choice(name: str, value: object, valid: tuple[Any, ...]) -> None:
    if value not in valid:
        choices = ", ".join(str(v) for v in valid)
        raise ShoalError(f"unknown {name} {value!r}; choose one of: {choices}")
