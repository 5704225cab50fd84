"""Published config.json files at their real sizes, as users bring them: PUBLISHED (the Qwen3.5-MoE
35B-A3B pair; tests parse them, bench/fp8_real_size.py writes full-size checkpoints from them) and
PUBLISHED_SIZES (the other checkpoints the README names; bench/row_invariance.py sweeps their shapes).

QWEN35_35B_A3B reconstructs the config.json of Qwen/Qwen3.5-35B-A3B from transformers'
Qwen3_5MoeConfig defaults and docstring (which mirror that checkpoint) with every field and
structure of the published file: the multimodal wrapper, the text model's fields that
transformers does not read (attn_output_gate, mamba_ssm_dtype, mlp_only_layers, mtp_*), both
layer_types and full_attention_interval, M-RoPE fields inside rope_parameters, and a vision
config whose model_type still reads "qwen3_5_moe" (transformers corrects it on load).
Qwen3.6-35B-A3B differs only in its bos_token_id and transformers_version.
"""

import copy

_LAYERS_35B = ["linear_attention"] * 3 + ["full_attention"]  # x 10: 40 layers

QWEN35_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "image_token_id": 248056,
    "model_type": "qwen3_5_moe",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "layer_types": _LAYERS_35B * 10,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "use_cache": True,
        "vocab_size": 248320,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
    },
    "tie_word_embeddings": False,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 248057,
    "vision_config": {
        "deepstack_visual_indexes": [],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        "model_type": "qwen3_5_moe",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 248054,
    "vision_start_token_id": 248053,
}

QWEN36_35B_A3B = copy.deepcopy(QWEN35_35B_A3B)
QWEN36_35B_A3B["text_config"]["bos_token_id"] = 248044
QWEN36_35B_A3B["transformers_version"] = "4.57.1"

PUBLISHED = {"Qwen3.5-35B-A3B": QWEN35_35B_A3B, "Qwen3.6-35B-A3B": QWEN36_35B_A3B}


# The other published checkpoints the README names, at their published sizes: what the device
# sweep (bench/row_invariance.py) and the real-width GPU tests (tests/test_real_width.py) build.
# Qwen3-Next-80B-A3B is its config.json as published. Kimi-Linear-48B-A3B takes the original
# field names of its config.json (linear_attn_config, 1-indexed layers); its sizes are the
# published file's. Qwen3.5-122B-A10B and -397B-A17B are the 35B-A3B wrapper with the sizes their
# model cards state (hidden size, layers, heads, experts, expert and shared-expert widths); every
# field that does not set a tensor's shape is the 35B-A3B file's.
QWEN3_NEXT_80B_A3B = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
    "mlp_only_layers": [], "model_type": "qwen3_next", "moe_intermediate_size": 512, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
    "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000000, "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}

_KIMI_FULL_ATTENTION = [4, 8, 12, 16, 20, 24, 27]  # 1-indexed, as the original config counts layers
KIMI_LINEAR_48B_A3B = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304,
    "intermediate_size": 9216, "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True,
    "linear_attn_config": {"full_attn_layers": _KIMI_FULL_ATTENTION, "kda_layers": [i for i in range(1, 28) if i not in _KIMI_FULL_ATTENTION],
                           "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
    "num_experts": 256, "num_experts_per_token": 8, "moe_intermediate_size": 1024, "num_shared_experts": 1,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_expert_group": 1, "topk_group": 1, "use_grouped_topk": True,
    "routed_scaling_factor": 2.446, "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
    "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
}


def _qwen35_moe_sized(hidden: int, layers: int, heads: int, value_heads: int, experts: int, top_k: int, expert_width: int) -> dict:
    config = copy.deepcopy(QWEN35_35B_A3B)
    config["text_config"].update(hidden_size=hidden, num_hidden_layers=layers, layer_types=_LAYERS_35B * (layers // 4),
                                 num_attention_heads=heads, linear_num_value_heads=value_heads, num_experts=experts,
                                 num_experts_per_tok=top_k, moe_intermediate_size=expert_width,
                                 shared_expert_intermediate_size=expert_width)
    config["vision_config"]["out_hidden_size"] = hidden
    return config


QWEN35_122B_A10B = _qwen35_moe_sized(hidden=3072, layers=48, heads=32, value_heads=64, experts=256, top_k=8, expert_width=1024)
QWEN35_397B_A17B = _qwen35_moe_sized(hidden=4096, layers=60, heads=32, value_heads=64, experts=512, top_k=10, expert_width=1024)

PUBLISHED_SIZES = {"Qwen3-Next-80B-A3B": QWEN3_NEXT_80B_A3B, "Qwen3.5-122B-A10B": QWEN35_122B_A10B,
                   "Qwen3.5-397B-A17B": QWEN35_397B_A17B, "Kimi-Linear-48B-A3B": KIMI_LINEAR_48B_A3B}
