"""transformers as the parity oracle: its models of the families we serve, built with random
weights and saved by `save_pretrained`, and its own reading of a checkpoint (`load_hf`).

The parity tests, `python -m bench.parity_unseen` and the training pipeline's evaluation share
it, so it lives here rather than under tests/. transformers is a test extra: it is imported
inside the functions that need it, never by importing this module.

SPECS are the tiny checkpoints of the test suite. Each varies the shapes the engine must get
right: several value heads per key head, odd head sizes, conv width 3 and 4, MoE with shared
experts, attention first and last in the layer schedule, tied and untied embeddings, sharded
files and bf16 storage, experts stored per expert (as transformers saves them) and fused (as
the published Qwen3.5-MoE files store them), multimodal wrappers with vision and `mtp.*` tensors.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

_QWEN_NEXT_MOE = dict(
    vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=12,
    linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
    shared_expert_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False,
)
_QWEN_NEXT_ODD = dict(
    vocab_size=83, hidden_size=36, intermediate_size=52, num_hidden_layers=5,
    layer_types=["full_attention", "linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=6, num_key_value_heads=3, head_dim=10,
    linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=6, linear_value_head_dim=10,
    linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=14,
    shared_expert_intermediate_size=18, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3],
    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
)
_QWEN35_TEXT = dict(
    vocab_size=90, hidden_size=40, intermediate_size=72, num_hidden_layers=4,
    layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=1, head_dim=12,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=10,
    linear_conv_kernel_dim=3, tie_word_embeddings=True,
)
_QWEN35_COMPOSITE_TEXT = dict(
    vocab_size=70, hidden_size=32, intermediate_size=48, num_hidden_layers=4, full_attention_interval=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, tie_word_embeddings=False,
)
# Qwen3.5-MoE: every layer sparse. The bare text model: odd rotary width (int(14 * 0.5) = 7),
# three value heads per key head, conv width 3, top-3 of 5 experts, tied embeddings.
_QWEN35_MOE_TEXT = dict(
    vocab_size=76, hidden_size=36, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    num_attention_heads=3, num_key_value_heads=1, head_dim=14,
    rope_parameters={"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.5},
    linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=8, linear_value_head_dim=6,
    linear_conv_kernel_dim=3, num_experts=5, num_experts_per_tok=3, moe_intermediate_size=10,
    shared_expert_intermediate_size=14, tie_word_embeddings=True,
)
# The multimodal wrapper as published: interleaved M-RoPE fields, untied head, top-2 of 8 experts.
_QWEN35_MOE_COMPOSITE_TEXT = dict(
    vocab_size=80, hidden_size=32, num_hidden_layers=4, full_attention_interval=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
    shared_expert_intermediate_size=16, tie_word_embeddings=False,
)
_QWEN35_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4, num_position_embeddings=16)
_KIMI = dict(
    vocab_size=88, hidden_size=40, intermediate_size=64, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10,
    linear_num_heads=3, linear_head_dim=10, linear_conv_kernel_dim=4,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=2, routed_scaling_factor=2.5,
    num_expert_group=2, topk_group=1, first_k_dense_replace=1, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
_KIMI_QLORA = dict(
    vocab_size=77, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
    layer_types=["full_attention", "linear_attention", "linear_attention"],
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=10, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=6,
    linear_num_heads=2, linear_head_dim=6, linear_conv_kernel_dim=3,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, num_shared_experts=1, routed_scaling_factor=1.0,
    moe_renormalize=False, first_k_dense_replace=2, tie_word_embeddings=True,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)

SPECS = {
    "qwen3_next_moe": ("qwen3_next", _QWEN_NEXT_MOE, {}),
    "qwen3_next_odd": ("qwen3_next", _QWEN_NEXT_ODD, {}),
    "qwen3_5_text": ("qwen3_5_text", _QWEN35_TEXT, {}),
    "qwen3_5_composite": ("qwen3_5", _QWEN35_COMPOSITE_TEXT, {}),
    "kimi_linear": ("kimi_linear", _KIMI, {}),
    "kimi_linear_qlora": ("kimi_linear", _KIMI_QLORA, {}),
    "qwen3_next_sharded": ("qwen3_next", _QWEN_NEXT_MOE, {"max_shard_size": "40KB"}),
    "qwen3_5_text_bf16": ("qwen3_5_text", _QWEN35_TEXT, {"storage": torch.bfloat16}),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", _QWEN35_MOE_TEXT, {}),
    "qwen3_5_moe": ("qwen3_5_moe", _QWEN35_MOE_COMPOSITE_TEXT, {"fused_experts": True, "mtp_tensors": True}),
}
# Multimodal wrappers: transformers' class for the whole checkpoint (the oracle reads the
# `model.language_model.` prefix through it).
_WRAPPER_CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def build_hf_model(family: str, fields: dict, seed: int = 0):
    """A transformers model of `family` with random weights (fixed seed), in eval mode."""
    import transformers as tf

    torch.manual_seed(seed)
    if family == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**fields))
    elif family == "qwen3_5_text":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**fields))
    elif family == "qwen3_5":
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=fields, vision_config=_QWEN35_VISION))
    elif family == "qwen3_5_moe_text":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**fields))
    elif family == "qwen3_5_moe":
        vision = {**_QWEN35_VISION, "out_hidden_size": fields["hidden_size"]}  # the merger feeds the text model
        model = tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(text_config=fields, vision_config=vision))
    elif family == "kimi_linear":
        model = tf.KimiLinearForCausalLM(tf.KimiLinearConfig(**fields))
    else:
        raise ValueError(family)
    _spread_weights(model, seed)
    return model.eval()


def _spread_weights(model, seed: int) -> None:
    """Random init leaves norms at their identity and routers near zero; perturb every tensor so
    each one matters to the output (a wrong cast or a skipped weight then shows)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                continue
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.05 * torch.randn(b.shape, generator=gen))


def save_spec(name: str, out_dir: Path) -> Path:
    family, fields, opts = SPECS[name]
    model = build_hf_model(family, fields)
    if "storage" in opts:
        model = model.to(opts["storage"])
    kwargs = {"max_shard_size": opts["max_shard_size"]} if "max_shard_size" in opts else {}
    model.save_pretrained(out_dir, **kwargs)
    if opts.get("fused_experts") or opts.get("mtp_tensors"):
        rewrite_as_published(out_dir, fuse=opts.get("fused_experts", False), mtp=opts.get("mtp_tensors", False))
    return out_dir


def save_random_hf_checkpoint(config: dict, out_dir: Path, seed: int = 0) -> Path:
    """A checkpoint of `config` (a config.json dict, any form transformers reads: published files
    included) with transformers' random weights; config.json is written back verbatim afterwards,
    so the directory holds the given file, not transformers' re-serialisation of it."""
    import json

    import transformers as tf

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    hf_config = tf.AutoConfig.from_pretrained(out_dir)
    torch.manual_seed(seed)
    if config["model_type"] in _WRAPPER_CLASSES:
        model = getattr(tf, _WRAPPER_CLASSES[config["model_type"]])(hf_config)
    else:
        model = tf.AutoModelForCausalLM.from_config(hf_config)
    _spread_weights(model, seed)
    model.save_pretrained(out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def rewrite_as_published(out_dir: Path, *, fuse: bool, mtp: bool) -> None:
    """Bring a transformers-saved single-file checkpoint to the published Qwen3.5 layout: fused
    experts, and `mtp.*` tensors (which transformers and our engine both skip) beside the text model."""
    from safetensors.torch import load_file, save_file

    path = Path(out_dir) / "model.safetensors"
    tensors = load_file(path)
    if fuse:
        fuse_experts(tensors)
    if mtp:
        final_norm = "model.language_model.norm.weight" if "model.language_model.norm.weight" in tensors else "model.norm.weight"
        hidden = tensors[final_norm].shape[0]
        gen = torch.Generator().manual_seed(3)
        tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen)
        tensors["mtp.norm.weight"] = torch.randn(hidden, generator=gen)
    save_file(tensors, str(path), metadata={"format": "pt"})


_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(tensors: dict[str, torch.Tensor]) -> None:
    """In place: per-expert tensors `{p}.experts.{e}.{gate,up,down}_proj.weight` -> the fused form
    `{p}.experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and
    `{p}.experts.down_proj` [E, H, I]."""
    per_layer: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name in [n for n in tensors if _PER_EXPERT.match(n)]:
        prefix, expert, proj = _PER_EXPERT.match(name).groups()
        per_layer.setdefault(prefix, {})[int(expert), proj] = tensors.pop(name)
    for prefix, weights in per_layer.items():
        n_experts = 1 + max(e for e, _ in weights)
        tensors[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat((weights[e, "gate_proj"], weights[e, "up_proj"])) for e in range(n_experts)])
        tensors[prefix + ".down_proj"] = torch.stack([weights[e, "down_proj"] for e in range(n_experts)])


def load_hf(model_dir: Path):
    """The oracle: transformers' own reading of the checkpoint, fp32, eager attention."""
    import json

    import transformers as tf

    with open(Path(model_dir) / "config.json") as f:
        model_type = json.load(f)["model_type"]
    cls = getattr(tf, _WRAPPER_CLASSES[model_type]) if model_type in _WRAPPER_CLASSES else tf.AutoModelForCausalLM
    return cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()
