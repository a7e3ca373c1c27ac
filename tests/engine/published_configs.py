"""config.json of real published MoE checkpoints (public values, as on their model pages),
with the parameter counts their authors publish; for testing size estimates."""

from __future__ import annotations

_FP8_BLOCKS = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
               "weight_block_size": [128, 128]}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "attention_bias": False, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "quantization_config": _FP8_BLOCKS,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}

KIMI_K2 = {
    **DEEPSEEK_V3, "model_type": "kimi_k2", "first_k_dense_replace": 1, "n_group": 1,
    "topk_group": 1, "n_routed_experts": 384, "num_attention_heads": 64,
    "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "routed_scaling_factor": 2.827,
    "vocab_size": 163840, "rope_theta": 50000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
}

QWEN3_235B_A22B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 94, "mlp_only_layers": [], "moe_intermediate_size": 1536,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 94, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 151936,
}

QWEN3_30B_A3B = {
    **QWEN3_235B_A22B, "hidden_size": 2048, "intermediate_size": 6144,
    "max_window_layers": 48, "moe_intermediate_size": 768, "num_attention_heads": 32,
    "num_hidden_layers": 48,
}

GLM_4_5 = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
    "first_k_dense_replace": 3, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "intermediate_size": 12288, "max_position_embeddings": 131072,
    "moe_intermediate_size": 1536, "n_group": 1, "n_routed_experts": 160,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96,
    "num_experts_per_tok": 8, "num_hidden_layers": 92, "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 1000000, "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16",
    "use_qk_norm": True, "vocab_size": 151552,
}

MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000,
}

# name: (config, published total parameters, MoE layers, experts per layer, expert FFN width)
PUBLISHED = {
    "DeepSeek-V3": (DEEPSEEK_V3, 671e9, 58, 256, 2048),
    "Kimi-K2-Instruct": (KIMI_K2, 1.04e12, 60, 384, 2048),
    "Qwen3-235B-A22B": (QWEN3_235B_A22B, 235e9, 94, 128, 1536),
    "Qwen3-30B-A3B": (QWEN3_30B_A3B, 30.5e9, 48, 128, 768),
    "GLM-4.5": (GLM_4_5, 355e9, 89, 160, 1536),
    "Mixtral-8x7B": (MIXTRAL_8X7B, 46.7e9, 32, 8, 14336),
}
