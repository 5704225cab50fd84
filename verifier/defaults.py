"""Where the default models live.

The trained default pair ships under `models/` (trained by `python -m training run`):
`models/target` is the verifier's default model and `models/draft` the default draft model. A
checkout without them (a sparse or partial copy of the repository) falls back to a small random Qwen3.5-style checkpoint with a byte-level tokenizer, built
deterministically on first use into the user cache: its text is noise, but every code path is
real. The switch is on `config.json` being present, nothing else.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_TARGET = REPO_ROOT / "models" / "target"
SHIPPED_DRAFT = REPO_ROOT / "models" / "draft"

RANDOM_DEFAULT_NAME = "random-qwen3_5_text-v2"
RANDOM_DEFAULT_CONFIG = {
    "model_type": "qwen3_5_text",
    "vocab_size": 257,  # 256 bytes + <|endoftext|>
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
    "eos_token_id": 256,
}


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hybrid-spec-verifier"


def default_model_dir() -> Path:
    if (SHIPPED_TARGET / "config.json").is_file():
        return SHIPPED_TARGET
    out = _cache_dir() / RANDOM_DEFAULT_NAME
    if not (out / "model.safetensors").is_file():
        from .model.random_checkpoint import write_random_checkpoint
        from .tokenizer import byte_level_tokenizer

        log.warning("%s is missing from this checkout (the trained default model ships there): building a deterministic "
                    "random checkpoint at %s instead, whose text is noise", SHIPPED_TARGET, out)
        write_random_checkpoint(RANDOM_DEFAULT_CONFIG, out, seed=0)
        byte_level_tokenizer().save(str(out / "tokenizer.json"))
        with open(out / "generation_config.json", "w") as f:
            json.dump({"eos_token_id": RANDOM_DEFAULT_CONFIG["eos_token_id"]}, f)
    else:
        log.warning("%s is missing from this checkout (the trained default model ships there): using the deterministic "
                    "random checkpoint at %s instead, whose text is noise", SHIPPED_TARGET, out)
    return out


def default_draft_model_dir() -> Path | None:
    """The shipped draft model, or None where the pair does not ship: a draft only goes with the
    shipped target, whose tokenizer it shares (the random fallback target has none to match)."""
    if (SHIPPED_DRAFT / "config.json").is_file() and (SHIPPED_TARGET / "config.json").is_file():
        return SHIPPED_DRAFT
    return None
