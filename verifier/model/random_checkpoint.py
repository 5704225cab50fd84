"""Write a deterministic random HF-format checkpoint for any config our engine reads.

The tensor list comes from the engine itself: the model is built from a source that invents
each tensor the layers ask for, with the shape they ask for, so the file holds exactly what the
loader expects. Values follow the usual initialisation of each tensor kind, drawn from a
generator seeded by (seed, tensor name): the same seed always writes the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from .hf_config import config_from_dict


class _InventingSource:
    """Stands in for TensorSource: every `take` invents the tensor and records it."""

    def __init__(self, seed: int, zero_centred_norm: bool, std: float, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.seed, self.zero_centred, self.std = seed, zero_centred_norm, std
        self.tensors: dict[str, torch.Tensor] = {}

    def has(self, name: str) -> bool:
        return False  # choose the first-named layout everywhere

    def stored_name(self, name: str) -> str:
        return name

    def leftovers(self) -> list[str]:
        return []

    def take(self, name: str, shape, *, fp32: bool = False) -> torch.Tensor:
        tensor = self._invent(name, tuple(shape)).to(torch.float32 if fp32 else self.dtype)
        self.tensors[name] = tensor
        return tensor

    def take_flat(self, name: str, numel: int, *, fp32: bool = False) -> torch.Tensor:
        return self.take(name, (numel,), fp32=fp32)

    def _invent(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        gen = torch.Generator(self.device).manual_seed(int.from_bytes(digest[:8], "little"))
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        empty = dict(device=self.device)
        if leaf == "A_log":
            return torch.empty(shape, **empty).uniform_(1.0, 16.0, generator=gen).log()
        if leaf == "dt_bias":
            return torch.empty(shape, **empty).uniform_(0.5, 1.5, generator=gen)
        if leaf == "e_score_correction_bias":
            return torch.zeros(shape, **empty)
        if leaf.endswith("norm"):
            gated = leaf in ("norm", "o_norm")  # gated output norms are never zero-centred
            base = 0.0 if self.zero_centred and not gated else 1.0
            return base + 0.1 * torch.randn(shape, generator=gen, **empty)
        fan_in = shape[-1] if len(shape) > 1 else 1
        std = self.std if leaf == "embed_tokens" else 1.0 / math.sqrt(fan_in)
        return std * torch.randn(shape, generator=gen, **empty)


def write_random_checkpoint(config: dict, out_dir: str | Path, seed: int = 0, std: float = 1.0, *,
                            device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """config: an HF config.json dict (any supported model_type) -> out_dir with config.json and model.safetensors.

    device: where the values are drawn (a GPU draws a checkpoint of published widths in seconds;
    the same seed gives other values on another kind of device); dtype: how they are stored (a
    tensor the layers ask for in fp32, such as Kimi's router, stays fp32)."""
    from .hybrid import HybridModel  # late: hybrid imports this package's loader

    parsed = config_from_dict(config)
    source = _InventingSource(seed, parsed.zero_centred_norm, std, torch.device(device), dtype)
    HybridModel(parsed, source)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to("cpu").contiguous() for k, v in source.tensors.items()}
    if parsed.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    return out
