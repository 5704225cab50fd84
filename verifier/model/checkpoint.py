"""Safetensors checkpoints: file discovery, tensor-name normalisation, and checked access.

Layers pull their tensors by canonical name with `take(name, shape)`; whatever is left at the
end is an unexpected tensor. Every error names the tensor as the checkpoint spells it.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

log = logging.getLogger(__name__)

# Tensors a text engine does not use: multi-token-prediction heads and vision towers.
_SKIPPED = re.compile(r"^(mtp\.|model\.mtp\.|model\.visual\.|visual\.|model\.vision_tower\.|vision_tower\.)")

# Checkpoint spelling -> canonical spelling (the one transformers saves for the text model).
_RENAMES = (
    (re.compile(r"^model\.language_model\."), "model."),  # Qwen3.5 multimodal wrapper
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),  # Kimi: MoE and (as transformers saves it) dense MLP
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),  # Kimi port: forget gate submodule
)

_STORED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CheckpointError(ValueError):
    """A checkpoint we cannot load; the message names the tensor and the problem."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = sorted({model_dir / name for name in weight_map.values()})
        for path in files:
            if not path.is_file():
                raise CheckpointError(f"{index} names shard {path.name}, which is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json")


def canonical_name(name: str) -> str:
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


class TensorSource:
    """Lazy, checked access to a checkpoint's tensors under their canonical names."""

    def __init__(self, model_dir: str | Path, device: torch.device | str, dtype: torch.dtype):
        model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        self._where: dict[str, tuple[object, str]] = {}  # canonical name -> (open file, stored name)
        self._taken: dict[str, str] = {}  # canonical name -> stored name, once taken
        skipped = 0
        self._handles = []
        for path in checkpoint_files(model_dir):
            handle = safe_open(str(path), framework="pt", device="cpu")
            self._handles.append(handle)
            for stored in handle.keys():
                if _SKIPPED.match(stored):
                    skipped += 1
                    continue
                name = canonical_name(stored)
                if name in self._where:
                    raise CheckpointError(f"tensor {stored!r} appears twice (as {self._where[name][1]!r} too)")
                self._where[name] = (handle, stored)
        if skipped:
            log.info("skipped %d tensors a text engine does not use (mtp.*, vision)", skipped)

    def has(self, name: str) -> bool:
        return name in self._where

    def stored_name(self, name: str) -> str:
        if name in self._where:
            return self._where[name][1]
        return self._taken.get(name, name)

    def take(self, name: str, shape: tuple[int, ...], *, fp32: bool = False) -> torch.Tensor:
        """Remove tensor `name`, check its shape, cast to the compute dtype (fp32 if asked), move to device."""
        tensor = self.take_raw(name)
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {self.stored_name(name)!r} has shape {list(tensor.shape)}, expected {list(shape)}"
            )
        return tensor.to(device=self.device, dtype=torch.float32 if fp32 else self.dtype).contiguous()

    def take_flat(self, name: str, numel: int, *, fp32: bool = False) -> torch.Tensor:
        """Remove tensor `name`, stored in any shape holding `numel` values -> [numel]."""
        tensor = self.take_raw(name)
        if tensor.numel() != numel:
            raise CheckpointError(f"tensor {self.stored_name(name)!r} has shape {list(tensor.shape)}, expected {numel} values")
        return tensor.reshape(numel).to(device=self.device, dtype=torch.float32 if fp32 else self.dtype)

    def take_raw(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise CheckpointError(f"missing tensor {name!r}")
        handle, stored = self._where.pop(name)
        tensor = handle.get_tensor(stored)
        if tensor.dtype not in _STORED_DTYPES:
            raise CheckpointError(f"tensor {stored!r} is stored as {tensor.dtype}; expected bf16, fp16 or fp32")
        self._taken[name] = stored
        return tensor

    def leftovers(self) -> list[str]:
        return sorted(stored for _, stored in self._where.values())
