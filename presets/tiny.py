"""The tiny checkpoints of the test suite: SPECS, name -> (family, transformers config fields, how
the checkpoint is saved).

Each varies the shapes the engine must get right: several value heads per key head, odd head sizes,
conv width 3 and 4, MoE with shared experts, attention first and last in the layer schedule, tied and
untied embeddings, sharded files and bf16 storage, experts stored per expert (as transformers saves
them) and fused (as the published Qwen3.5-MoE files store them), multimodal wrappers with vision and
`mtp.*` tensors. presets/hf_reference.py `save_spec` writes them; the benches that need a checkpoint
but not a real size (bench/rpc_floor.py, bench/server_overhead.py) take one of them too.
"""

import torch

QWEN_NEXT_MOE = dict(
    vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=12,
    linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
    shared_expert_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False,
)
QWEN_NEXT_ODD = dict(
    vocab_size=83, hidden_size=36, intermediate_size=52, num_hidden_layers=5,
    layer_types=["full_attention", "linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=6, num_key_value_heads=3, head_dim=10,
    linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=6, linear_value_head_dim=10,
    linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=14,
    shared_expert_intermediate_size=18, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3],
    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
)
QWEN35_TEXT = dict(
    vocab_size=90, hidden_size=40, intermediate_size=72, num_hidden_layers=4,
    layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=1, head_dim=12,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=10,
    linear_conv_kernel_dim=3, tie_word_embeddings=True,
)
QWEN35_COMPOSITE_TEXT = dict(
    vocab_size=70, hidden_size=32, intermediate_size=48, num_hidden_layers=4, full_attention_interval=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, tie_word_embeddings=False,
)
# Qwen3.5-MoE: every layer sparse. The bare text model: odd rotary width (int(14 * 0.5) = 7),
# three value heads per key head, conv width 3, top-3 of 5 experts, tied embeddings.
QWEN35_MOE_TEXT = dict(
    vocab_size=76, hidden_size=36, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    num_attention_heads=3, num_key_value_heads=1, head_dim=14,
    rope_parameters={"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.5},
    linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=8, linear_value_head_dim=6,
    linear_conv_kernel_dim=3, num_experts=5, num_experts_per_tok=3, moe_intermediate_size=10,
    shared_expert_intermediate_size=14, tie_word_embeddings=True,
)
# The multimodal wrapper as published: interleaved M-RoPE fields, untied head, top-2 of 8 experts.
QWEN35_MOE_COMPOSITE_TEXT = dict(
    vocab_size=80, hidden_size=32, num_hidden_layers=4, full_attention_interval=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
    shared_expert_intermediate_size=16, tie_word_embeddings=False,
)
# The vision tower of every Qwen3.5 wrapper hf_reference builds (the engine skips its tensors).
QWEN35_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4, num_position_embeddings=16)
KIMI = dict(
    vocab_size=88, hidden_size=40, intermediate_size=64, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
    linear_num_heads=3, linear_head_dim=10, linear_conv_kernel_dim=4,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=2, routed_scaling_factor=2.5,
    num_expert_group=2, topk_group=1, first_k_dense_replace=1, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
KIMI_QLORA = dict(
    vocab_size=77, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
    layer_types=["full_attention", "linear_attention", "linear_attention"],
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=10, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=6,
    linear_num_heads=2, linear_head_dim=6, linear_conv_kernel_dim=3,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, num_shared_experts=1, routed_scaling_factor=1.0,
    moe_renormalize=False, first_k_dense_replace=2, tie_word_embeddings=True,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
# Tensor parallelism (tests/test_tensor_parallel.py): every head count and every split size divisible by
# 2 and by 3 (6 KV heads, 6 key heads, intermediate sizes multiples of 6), so one checkpoint runs on 2
# and on 3 ranks; Qwen3.5-MoE's vocabulary (91) divides by neither, so its ranks pad their vocabulary rows. Qwen3-Next's interleaved projections and per-expert MoE with a
# dense layer; Qwen3.5-MoE's separate projections, fused experts and a tied head; Kimi's MLA, KDA and
# grouped sigmoid router.
QWEN_NEXT_TP = dict(
    vocab_size=96, hidden_size=36, intermediate_size=48, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=12, num_key_value_heads=6, head_dim=4,
    linear_num_key_heads=6, linear_num_value_heads=12, linear_key_head_dim=4, linear_value_head_dim=4,
    linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
    shared_expert_intermediate_size=18, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False,
)
QWEN35_MOE_TP = dict(
    vocab_size=91, hidden_size=24, num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=6, num_key_value_heads=6, head_dim=6,
    linear_num_key_heads=6, linear_num_value_heads=6, linear_key_head_dim=6, linear_value_head_dim=4,
    linear_conv_kernel_dim=3, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=6,
    shared_expert_intermediate_size=12, tie_word_embeddings=True,
)
KIMI_TP = dict(
    vocab_size=96, hidden_size=24, intermediate_size=24, num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=6, num_key_value_heads=6, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4,
    linear_num_heads=6, linear_head_dim=4, linear_conv_kernel_dim=3,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6, num_shared_experts=1, routed_scaling_factor=2.0,
    num_expert_group=2, topk_group=1, first_k_dense_replace=1, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)

SPECS = {
    "qwen3_next_moe": ("qwen3_next", QWEN_NEXT_MOE, {}),
    "qwen3_next_odd": ("qwen3_next", QWEN_NEXT_ODD, {}),
    "qwen3_5_text": ("qwen3_5_text", QWEN35_TEXT, {}),
    "qwen3_5_composite": ("qwen3_5", QWEN35_COMPOSITE_TEXT, {}),
    "kimi_linear": ("kimi_linear", KIMI, {}),
    "kimi_linear_qlora": ("kimi_linear", KIMI_QLORA, {}),
    "qwen3_next_sharded": ("qwen3_next", QWEN_NEXT_MOE, {"max_shard_size": "40KB"}),
    "qwen3_5_text_bf16": ("qwen3_5_text", QWEN35_TEXT, {"storage": torch.bfloat16}),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", QWEN35_MOE_TEXT, {}),
    "qwen3_5_moe": ("qwen3_5_moe", QWEN35_MOE_COMPOSITE_TEXT, {"fused_experts": True, "mtp_tensors": True}),
    "qwen3_next_tp": ("qwen3_next", QWEN_NEXT_TP, {}),
    "qwen3_5_moe_tp": ("qwen3_5_moe_text", QWEN35_MOE_TP, {"fused_experts": True}),
    "kimi_linear_tp": ("kimi_linear", KIMI_TP, {}),
}
