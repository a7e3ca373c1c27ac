"""Every mlx-lm model family that builds a routed-expert switch module, and a tiny config for
each (`TINY`, on top of `COMMON`); `discover()` reads mlx-lm's models folder, so a family a new
release adds fails the family sweep by name until it has one."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm.models

# A model file that builds mlx-lm's routed-expert module names one of its classes.
_SWITCH_CLASSES = re.compile(r"\b(SwitchGLU|SwitchMLP)\b")
_IMPORTS = re.compile(r"^from \.(\w+) import|^from \. import ([\w, ]+)$", re.MULTILINE)

# Fields every family reads under these names (those that name them otherwise drop them).
COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
# Tiny models have 8 experts of width 32, top 2, unless the family needs otherwise.
E, K, W = 8, 2, 32


@dataclass(frozen=True)
class TinyFamily:
    """How to write a tiny config.json for one family."""

    fields: dict[str, Any]
    # The text model's fields go under text_config (multimodal and wrapper configs);
    # `top` holds what goes beside it.
    nested: bool = False
    top: dict[str, Any] = field(default_factory=dict)
    # False where the family spells even the common sizes its own way (phixtral): COMMON's
    # spellings must not be in its config, or a reader of the wrong key would pass.
    common: bool = True
    # Also swept in 4-bit (the families most used at scale).
    quantized: bool = False
    # (bits, group size) for a family that exists only quantized, all in one way (prism's
    # Hadamard packs): its checkpoint is always built so, and `fields` must fit the group.
    packed: tuple[int, int] | None = None
    # Why mlx-lm's own code for this family needs Apple's GPU, if it does: without Metal it
    # cannot run, so there are no reference ids to compare with.
    needs_metal: str | None = None

    def config(self, family: str) -> dict[str, Any]:
        """The config without tokenizer ids; model_type is the family unless fields say."""
        text = {**(COMMON if self.common else {}), "model_type": family, **self.fields}
        if not self.nested:
            return text
        return {"model_type": family, **self.top, "text_config": text}

    def runs_here(self) -> bool:
        """Whether mlx-lm's own code for the family runs on this machine."""
        return self.needs_metal is None or mx.metal.is_available()


def _dsv3(**extra: Any) -> dict[str, Any]:
    """DeepSeek-V3's fields (multi-head latent attention, grouped sigmoid routing), which many
    families reuse."""
    return {
        "n_routed_experts": E, "num_experts_per_tok": K, "n_shared_experts": 1,
        "moe_intermediate_size": W, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "n_group": 2, "topk_group": 1, "q_lora_rank": 32,
        "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "attention_bias": False, **extra,
    }


_QWEN3_MOE = {
    "num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": W,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
}
_QWEN3_NEXT = {
    **_QWEN3_MOE, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "shared_expert_intermediate_size": W, "partial_rotary_factor": 0.5,
    "full_attention_interval": 2,
}
_KIMI_LINEAR_ATTN = {
    "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4, "kda_layers": [1],
    "full_attn_layers": [2],
}
_KIMI_K3 = {
    "linear_attn_config": _KIMI_LINEAR_ATTN, "q_lora_rank": 32, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "num_experts": E,
    "num_experts_per_token": K, "num_shared_experts": 1, "moe_intermediate_size": W,
    # The routed experts run in a 32-wide latent space inside the 64-wide model.
    "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
}
_GEMMA4_TEXT = {
    "enable_moe_block": True, "num_experts": E, "top_k_experts": K, "moe_intermediate_size": W,
    "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "global_head_dim": 16,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
    "vocab_size_per_layer_input": 0,
}
_MISTRAL4 = _dsv3(
    model_type="mistral4",
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                     "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 4096},
)
# Llama 4 attends globally every fourth layer, so it needs four; experts in every second.
_LLAMA4_TEXT = {
    "num_hidden_layers": 4, "attention_chunk_size": 8, "interleave_moe_layer_step": 2,
    "attention_bias": False,
    "intermediate_size": W, "intermediate_size_mlp": 64, "num_local_experts": E,
    "num_experts_per_tok": 1, "rope_scaling": None, "use_qk_norm": True,
    "no_rope_layers": [1, 1, 1, 0],
}

TINY: dict[str, TinyFamily] = {
    "Klear": TinyFamily({
        "attention_bias": False, "mlp_only_layers": [], "num_experts": E,
        "num_experts_per_tok": K, "decoder_sparse_step": 1, "n_shared_experts": 1,
        "moe_intermediate_size": W, "norm_topk_prob": True,
    }),
    "afmoe": TinyFamily({
        "layer_types": ["sliding_attention", "full_attention"], "num_experts": E,
        "num_experts_per_tok": K, "moe_intermediate_size": W, "num_dense_layers": 1,
        "sliding_window": 8,
    }),
    "bailing_hybrid": TinyFamily({
        "moe_intermediate_size": W, "num_experts": E, "num_experts_per_tok": K,
        "num_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
        "layer_group_size": 2, "group_norm_size": 1, "routed_scaling_factor": 2.5,
        "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "q_lora_rank": 32,
    }),
    "bailing_moe": TinyFamily({
        "moe_intermediate_size": W, "num_experts": E, "num_shared_experts": 1,
        "norm_topk_prob": True, "num_experts_per_tok": K, "first_k_dense_replace": 1,
    }),
    "bailing_moe_linear": TinyFamily({
        "moe_intermediate_size": W, "num_experts": E, "num_shared_experts": 1,
        "norm_topk_prob": True, "num_experts_per_tok": K, "first_k_dense_replace": 0,
        "layer_group_size": 2, "group_norm_size": 1,
    }),
    # mlx-lm reaches bailing_moe_v3 through model_type bailing_hybrid and this architecture.
    "bailing_moe_v3": TinyFamily({
        "model_type": "bailing_hybrid", "architectures": ["BailingMoeV3ForCausalLM"],
        "moe_intermediate_size": W, "moe_shared_expert_intermediate_size": W,
        "num_experts": E, "num_experts_per_tok": K, "num_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "layer_group_size": 2,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16,
    }),
    "deepseek": TinyFamily({
        "n_routed_experts": E, "num_experts_per_tok": K, "n_shared_experts": 1,
        "moe_intermediate_size": W, "first_k_dense_replace": 1,
    }),
    "deepseek_v2": TinyFamily(_dsv3(
        topk_method="group_limited_greedy", scoring_func="softmax",
        rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
                      "mscale": 1.0, "mscale_all_dim": 0},
    )),
    "deepseek_v3": TinyFamily(_dsv3(), quantized=True),
    "deepseek_v32": TinyFamily(_dsv3(index_head_dim=16, index_n_heads=2, index_topk=4)),
    "deepseek_v41": TinyFamily({
        "head_dim": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "o_groups": 2,
        "o_lora_rank": 16, "moe_intermediate_size": W, "n_routed_experts": E,
        "num_experts_per_tok": K, "sliding_window": 8, "compress_ratios": [0, 0],
        "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4, "hc_mult": 2,
        "hc_sinkhorn_iters": 3, "num_key_value_heads": 1,
    }),
    "dots1": TinyFamily({
        "first_k_dense_replace": 1, "moe_intermediate_size": W, "n_routed_experts": E,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_experts_per_tok": K,
        "routed_scaling_factor": 2.5, "n_group": 2, "topk_group": 1,
    }),
    "ernie4_5_moe": TinyFamily({
        "use_bias": False, "moe_num_experts": E, "moe_intermediate_size": W, "moe_k": K,
        "moe_num_shared_experts": 1, "moe_layer_start_index": 1,
    }),
    "exaone_moe": TinyFamily({
        "moe_intermediate_size": W, "num_experts": E, "num_experts_per_tok": K,
        "num_shared_experts": 1, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"], "is_moe_layer": [False, True],
        "n_group": 2, "topk_group": 1,
    }),
    "gemma4_text": TinyFamily(_GEMMA4_TEXT),
    "gemma4": TinyFamily(_GEMMA4_TEXT, nested=True),
    "glm4_moe": TinyFamily({
        "moe_intermediate_size": W, "norm_topk_prob": True, "n_group": 2, "topk_group": 1,
        "n_shared_experts": 1, "n_routed_experts": E, "routed_scaling_factor": 2.5,
        "num_experts_per_tok": K, "first_k_dense_replace": 1, "rope_scaling": None,
        "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5,
    }, quantized=True),
    "glm4_moe_lite": TinyFamily(_dsv3()),
    "glm_moe_dsa": TinyFamily(_dsv3(
        index_head_dim=16, index_n_heads=2, index_topk=4,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )),
    "gpt_oss": TinyFamily({
        "num_local_experts": E, "num_experts_per_tok": K, "intermediate_size": W,
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
    }, quantized=True),
    "granitemoe": TinyFamily({
        "logits_scaling": 1.0, "attention_multiplier": 0.25, "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0, "attention_bias": False, "num_local_experts": E,
        "num_experts_per_tok": K, "intermediate_size": W,
    }),
    "granitemoehybrid": TinyFamily({
        "attention_bias": False, "embedding_multiplier": 1.0, "attention_multiplier": 0.25,
        "logits_scaling": 1.0, "residual_multiplier": 1.0,
        "layer_types": ["mamba", "attention"], "num_local_experts": E,
        "num_experts_per_tok": K, "intermediate_size": W, "shared_intermediate_size": W,
        "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_proj_bias": False,
        "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True,
        # Not read by mlx-lm, but transformers' config (loaded with the tokenizer) checks
        # that heads times head width is mamba_expand times the hidden size.
        "mamba_expand": 1,
    }),
    "hunyuan": TinyFamily({
        "attention_bias": False, "moe_topk": K, "num_experts": E, "num_shared_expert": 1,
        "use_mixed_mlp_moe": True, "use_qk_norm": True, "use_cla": False,
        "cla_share_factor": 1, "moe_intermediate_size": W,
        "rope_scaling": {"alpha": 1.0, "type": "dynamic", "factor": 1.0},
    }),
    "jamba": TinyFamily({
        "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
        "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 8, "mamba_expand": 1,
        "num_experts": E, "num_experts_per_tok": K, "intermediate_size": W,
    }),
    "kimi_k3": TinyFamily(_KIMI_K3, nested=True, quantized=True),
    "kimi_k25": TinyFamily(_dsv3(model_type="deepseek_v3"), nested=True),
    "kimi_linear": TinyFamily({
        "linear_attn_config": _KIMI_LINEAR_ATTN, "model_max_length": 4096, "num_experts": E,
        "num_experts_per_token": K, "moe_intermediate_size": W, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "num_shared_experts": 1,
    }),
    "kimi_vl": TinyFamily(_dsv3(model_type="deepseek_v3"), nested=True),
    "laguna": TinyFamily({
        "num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": W,
        "shared_expert_intermediate_size": W,
    }),
    "lfm2_moe": TinyFamily({
        "moe_intermediate_size": W, "num_experts": E, "num_experts_per_tok": K,
        "norm_topk_prob": True, "use_expert_bias": True, "num_dense_layers": 1,
        "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
        "layer_types": ["conv", "full_attention"],
    }),
    "llama4": TinyFamily(_LLAMA4_TEXT, nested=True, quantized=True),
    "longcat_flash": TinyFamily({
        "attention_method": "MLA", "zero_expert_type": "identity", "ffn_hidden_size": 64,
        "moe_topk": K, "expert_ffn_hidden_size": W, "n_routed_experts": E,
        "zero_expert_num": 2, "num_layers": 1, "kv_lora_rank": 32, "q_lora_rank": 32,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "routed_scaling_factor": 1.0, "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
        "attention_bias": False,
    }),
    "longcat_flash_ngram": TinyFamily({
        "ffn_hidden_size": 64, "moe_topk": K, "expert_ffn_hidden_size": W,
        "n_routed_experts": E, "zero_expert_num": 2, "num_layers": 1, "kv_lora_rank": 32,
        "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "routed_scaling_factor": 1.0, "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
        "ngram_vocab_size_ratio": 2, "emb_neighbor_num": 2, "emb_split_num": 2,
    }),
    "mellum": TinyFamily({
        "num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": W,
        "norm_topk_prob": True, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_theta": 10000.0},
                            "full_attention": {"rope_theta": 10000.0}},
    }),
    "mimo_v2_flash": TinyFamily({
        "num_experts_per_tok": K, "hybrid_layer_pattern": [1, 0], "moe_layer_freq": [0, 1],
        "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
        "sliding_window_size": 8, "moe_intermediate_size": W, "n_shared_experts": None,
        "n_routed_experts": E, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
        "layernorm_epsilon": 1e-6, "swa_rope_theta": 10000.0, "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2, "v_head_dim": 16, "swa_head_dim": 16,
        "swa_v_head_dim": 16, "partial_rotary_factor": 0.5,
    }),
    "minimax": TinyFamily({
        "intermediate_size": W, "num_local_experts": E, "num_experts_per_tok": K,
        "shared_intermediate_size": 0, "rotary_dim": 8,
    }, quantized=True),
    "minimax_m3_vl": TinyFamily({
        "intermediate_size": W, "dense_intermediate_size": 64, "shared_intermediate_size": W,
        "num_local_experts": E, "num_experts_per_tok": K, "moe_layer_freq": [0, 1],
    }, nested=True),
    "mistral3": TinyFamily(_MISTRAL4, nested=True),
    "mistral4": TinyFamily(_MISTRAL4),
    "mixtral": TinyFamily({
        "num_local_experts": E, "num_experts_per_tok": K, "intermediate_size": W,
    }, quantized=True),
    # Experts run at moe_hidden_size, between a projection down and one back up.
    "muse_spark": TinyFamily({
        "post_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0},
        "layer_rope_theta": [10000.0, 0], "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8, "final_logit_softcapping": 30.0, "output_multiplier": 1.0,
        "num_local_experts": E, "num_experts_per_tok": K, "moe_hidden_size": 32,
        "moe_intermediate_size": W,
    }, nested=True, top={
        # Not read by mlx-lm; transformers' config (loaded with the tokenizer) checks that the
        # audio encoder's output is as wide as the text model.
        "audio_config": {"out_hidden_size": 64},
    }, needs_metal=(
        "mlx-lm's muse_spark attention calls its fused qk_norm_rope kernel "
        "(mx.fast.metal_kernel), which has no CPU version"
    )),
    "nemotron_h": TinyFamily({
        "attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 16,
        "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1,
        "mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False,
        "use_conv_bias": True, "hybrid_override_pattern": ["M", "E", "*", "E"],
        "moe_intermediate_size": W, "moe_shared_expert_intermediate_size": W,
        # Nemotron 3 runs its routed experts in a latent space, as Kimi K3 does.
        "moe_latent_size": 32, "n_group": 1, "n_routed_experts": E, "n_shared_experts": 1,
        "topk_group": 1, "num_experts_per_tok": K, "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
    }),
    "olmoe": TinyFamily({"num_experts": E, "num_experts_per_tok": K, "intermediate_size": W}),
    "phimoe": TinyFamily({
        "num_local_experts": E, "num_experts_per_tok": K, "intermediate_size": W,
    }),
    # phixtral names its sizes model_dim, num_vocab, num_heads, num_layers.
    "phixtral": TinyFamily({
        "model_dim": 64, "num_heads": 4, "num_layers": 2, "rotary_dim": 8,
        "num_experts_per_tok": K, "num_local_experts": E,
    }, common=False),
    # A Qwen 3.5 MoE whose listed linears are 2-bit with a Hadamard rotation folded in; the
    # rest, experts included, is 2-bit with groups of 128, so every width here is 128.
    "prism_hadamard_qwen35": TinyFamily(
        {**_QWEN3_NEXT, "hidden_size": 128, "moe_intermediate_size": 128,
         "shared_expert_intermediate_size": 128, "intermediate_size": 128, "head_dim": 32,
         "linear_key_head_dim": 32, "linear_value_head_dim": 32},
        nested=True, packed=(2, 128),
        top={"schema_version": 1, "tensor_namespace": "mlx-lm-text",
             "quantization": {"group_size": 128, "bits": 2, "mode": "affine"},
             # Rotation blocks start at 512 wide; block 0 packs the head without one.
             "modules": [{"path": "lm_head", "embedding": False, "dtype": "float16",
                          "block": 0}]},
    ),
    "qwen2_moe": TinyFamily({
        "num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": W,
        "shared_expert_intermediate_size": W,
    }),
    "qwen3_5": TinyFamily(_QWEN3_NEXT, nested=True),
    "qwen3_5_moe": TinyFamily(_QWEN3_NEXT, nested=True, quantized=True),
    "qwen3_moe": TinyFamily(_QWEN3_MOE, quantized=True),
    "qwen3_next": TinyFamily(_QWEN3_NEXT, quantized=True),
    "qwen3_vl_moe": TinyFamily(_QWEN3_MOE, nested=True),
    "solar_open": TinyFamily({
        "moe_intermediate_size": W, "n_shared_experts": 1, "n_routed_experts": E,
        "routed_scaling_factor": 1.0, "num_experts_per_tok": K, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "partial_rotary_factor": 0.5, "n_group": 2, "topk_group": 1,
    }),
    "step3p5": TinyFamily({
        "num_attention_groups": 2, "moe_num_experts": E, "moe_top_k": K,
        "moe_intermediate_size": W, "share_expert_dim": W, "moe_layers_enum": "1",
        "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8,
    }),
}


def discover(models_dir: Path | None = None) -> tuple[str, ...]:
    """The model files in mlx-lm's models folder that build a switch module, directly or by
    importing another family's model (wrappers such as kimi_k25 or qwen3_vl_moe)."""
    folder = Path(models_dir or Path(mlx_lm.models.__file__).parent)
    sources = {path.stem: path.read_text() for path in sorted(folder.glob("*.py"))}
    imports = {name: _imported(text) for name, text in sources.items()}
    found = {name for name, text in sources.items()
             if name != "switch_layers" and _SWITCH_CLASSES.search(text)}
    grown = True
    while grown:
        more = {name for name, deps in imports.items() if deps & found} - found
        found |= more
        grown = bool(more)
    return tuple(sorted(found, key=str.lower))


def _imported(source: str) -> set[str]:
    names: set[str] = set()
    for module, listed in _IMPORTS.findall(source):
        names |= {module} if module else {n.strip() for n in listed.split(",")}
    return names
