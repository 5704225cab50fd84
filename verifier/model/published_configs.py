"""Published config.json files of the Qwen3.5-MoE family, as users bring them (tests parse them,
bench/fp8_real_size.py writes full-size checkpoints from them).

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
