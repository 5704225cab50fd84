"""transformers as the parity oracle: its models of the families we serve, built with random
weights and saved by `save_pretrained`, and its own reading of a checkpoint (`load_hf`).

The parity tests, `python -m bench.parity_unseen`, the benches that serve a tiny checkpoint
(bench/rpc_floor.py, bench/server_overhead.py) and the training pipeline's evaluation share it, so
it lives beside the presets it builds (presets/__init__.py says why there) rather than under tests/,
and outside the installed product, which never builds a reference model. transformers is a test
extra: it is imported inside the functions that need it, never by importing this module.

`save_spec` writes one of the tiny checkpoints of presets/tiny.py (SPECS); `save_random_hf_checkpoint`
writes any config.json, the published ones of presets/published.py included.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from presets.tiny import QWEN35_VISION, SPECS

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
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=fields, vision_config=QWEN35_VISION))
    elif family == "qwen3_5_moe_text":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**fields))
    elif family == "qwen3_5_moe":
        vision = {**QWEN35_VISION, "out_hidden_size": fields["hidden_size"]}  # the merger feeds the text model
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
