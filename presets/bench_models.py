"""The benches' models.

MODELS, name -> (family, transformers config fields): the GPU benches' Qwen3.5-style ~2B dense model
and two MoE siblings of similar active size, random bf16 weights built with transformers
(bench/gpu.py `build_checkpoint`). bench/gpu.py times them, bench/serve.py serves the 2B one,
bench/row_invariance.py sweeps their GEMM shapes; the GEMM benches time weight_shapes(DENSE_2B).
TINY_CONFIG: the service benches' tiny model (bench.load, bench.serve --model tiny).
"""

DENSE_2B = dict(  # Qwen3.5-style ~2B: Gated DeltaNet and gated attention 3 : 1, tied embeddings
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, tie_word_embeddings=True,
)
NEXT_MOE = dict(  # Qwen3-Next-style: the same mixers, MoE of similar active size (2 of 8 experts + a shared one)
    DENSE_2B, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=2048, shared_expert_intermediate_size=2048,
)
KIMI_MOE = dict(  # Kimi-style: KDA + MLA (3:1), MoE (2 of 8 + 1 shared), first layer dense
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
    num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    linear_num_heads=16, linear_head_dim=128, linear_conv_kernel_dim=4,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=2048, num_shared_experts=1, routed_scaling_factor=2.5,
    first_k_dense_replace=1, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
MODELS = {"qwen35_2b": ("qwen3_5_text", DENSE_2B), "qwen3next_moe": ("qwen3_next", NEXT_MOE), "kimi_moe": ("kimi_linear", KIMI_MOE)}

# A tiny hybrid model (3 Gated DeltaNet layers, 1 attention layer, byte-sized vocabulary) so the
# CPU run measures the service, not the matmuls. Written deterministically by the engine's own
# random-checkpoint writer (verifier/model/random_checkpoint.py), no transformers needed. Tied
# embeddings at TINY_EMBED_STD make its greedy text repeat in runs (n-gram drafts accepted 1 to 4
# at a time, not never nor always), so accepted-prefix rollbacks of every length are exercised.
TINY_CONFIG = {
    "model_type": "qwen3_5_text", "vocab_size": 257, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": True, "max_position_embeddings": 4096, "eos_token_id": 256,
}
TINY_EMBED_STD = 0.5
TINY_NAME = "tiny-qwen3_5_text-h64-l4-tied"


def weight_shapes(fields: dict) -> dict[str, tuple[int, int]]:
    """name: [N, K] of each weight a Qwen3.5 text model of these config fields multiplies, fused as
    verifier/model/layers builds them: the GDN mixer's in (q, k, v, z, then b and a: one of each per
    value head) and out, gated attention's q (with its gate), k, v and its out, the MLP's gate + up
    and down, the LM head. The GEMM benches (bench/gemm.py, bench/linear_configs.py) time these."""
    hidden = fields["hidden_size"]
    key = fields["linear_num_key_heads"] * fields["linear_key_head_dim"]
    value = fields["linear_num_value_heads"] * fields["linear_value_head_dim"]
    attention = fields["num_attention_heads"] * fields["head_dim"]
    kv = fields["num_key_value_heads"] * fields["head_dim"]
    return {
        "gdn_in": (2 * key + 2 * value + 2 * fields["linear_num_value_heads"], hidden),
        "gdn_out": (hidden, value),
        "attn_qkv": (2 * attention + 2 * kv, hidden),
        "attn_o": (hidden, attention),
        "mlp_gate_up": (2 * fields["intermediate_size"], hidden),
        "mlp_down": (hidden, fields["intermediate_size"]),
        "lm_head": (fields["vocab_size"], hidden),
    }
