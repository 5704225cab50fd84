"""Give a saved tiny checkpoint an MTP head in the published layout (verifier/model/mtp.py says
what each tensor is): transformers builds no MTP, so the tests' heads are random tensors added
beside the text model.

The MTP layer copies the names, shapes and storage dtype of a main layer: its attention and norms
those of the first full-attention layer, its MLP those of the first sparse layer where the config
has experts (the published Qwen3-Next and Qwen3.5-MoE MTP layers are sparse), else of the first
dense layer; so experts come per expert or fused as the main layers store them. config.json gains
`mtp_num_hidden_layers` for Qwen3.5 (as the published files carry it); the published Qwen3-Next
file has no count field, so none is added there and the loader counts the layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from verifier.model.config import ATTENTION, DENSE, MOE
from verifier.model.hf_config import load_config

_MLP_PARTS = (".mlp.",)
_ATTENTION_PARTS = (".self_attn.", ".input_layernorm.", ".post_attention_layernorm.")


def add_mtp_tensors(model_dir: Path, n_layers: int = 1, seed: int = 0) -> Path:
    """In place: replace any `mtp.*` tensors of a single-file checkpoint with a random head of
    n_layers layers, and record the count in config.json (Qwen3.5 families)."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    path = model_dir / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if not k.startswith("mtp.")}
    text = "model.language_model." if any(k.startswith("model.language_model.") for k in tensors) else "model."
    attention_layer = config.mixers.index(ATTENTION)
    mlp_layer = config.mlps.index(MOE) if MOE in config.mlps else config.mlps.index(DENSE)
    hidden = config.hidden_size
    dtype = tensors[text + "norm.weight"].dtype
    gen = torch.Generator().manual_seed(seed)

    def like(template: torch.Tensor) -> torch.Tensor:
        # a 1-D weight is a zero-centred norm's (or a bias): small around 0; a matrix at its template's spread
        scale = 0.1 if template.dim() == 1 else float(template.float().std())
        return (scale * torch.randn(template.shape, generator=gen)).to(template.dtype)

    for j in range(n_layers):
        for source_layer, parts in ((attention_layer, _ATTENTION_PARTS), (mlp_layer, _MLP_PARTS)):
            prefix = f"{text}layers.{source_layer}"
            for name in sorted(tensors):
                if name.startswith(prefix + ".") and any(name.startswith(prefix + part) for part in parts):
                    tensors[f"mtp.layers.{j}" + name[len(prefix):]] = like(tensors[name])
    tensors["mtp.pre_fc_norm_embedding.weight"] = (0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    tensors["mtp.pre_fc_norm_hidden.weight"] = (0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    tensors["mtp.fc.weight"] = ((2 * hidden) ** -0.5 * torch.randn(hidden, 2 * hidden, generator=gen)).to(dtype)
    tensors["mtp.norm.weight"] = (0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    if config.model_type != "qwen3_next":
        config_path = model_dir / "config.json"
        raw = json.loads(config_path.read_text())
        (raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw)["mtp_num_hidden_layers"] = n_layers
        config_path.write_text(json.dumps(raw, indent=2))
    return model_dir
