"""Safetensors checkpoints: file discovery, tensor-name normalisation, and checked access.

Layers pull their tensors by canonical name with `take(name, shape)`; whatever is left at the
end is an unexpected tensor. Every error names the tensor as the checkpoint spells it.

Block-FP8 checkpoints (verifier/model/fp8.py): a float8_e4m3fn `<name>.weight` pairs with its
`<name>.weight_scale_inv` (a fused expert tensor `<name>` with `<name>_scale_inv`), checked
against config.json's quantization_config. `take` dequantizes it to the compute dtype, except
where the source keeps FP8 (CUDA by default) and the tensor is a linear layer's weight: then it
returns a BlockFP8Weight, which the layers' GEMMs consume.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from .fp8 import FP8_DTYPE, BlockFP8Weight, read_block_fp8_format
from .hf_config import read_json_object

log = logging.getLogger(__name__)

# Tensors a text engine does not use: multi-token-prediction heads and vision towers.
_SKIPPED = re.compile(r"^(mtp\.|model\.mtp\.|model\.visual\.|visual\.|model\.vision_tower\.|vision_tower\.)")
# The MTP head's tensors (verifier/model/mtp.py), read as `mtp.*` in either spelling.
_MTP = re.compile(r"^(model\.)?mtp\.")

# Checkpoint spelling -> canonical spelling (the one transformers saves for the text model).
_RENAMES = (
    (re.compile(r"^model\.language_model\."), "model."),  # Qwen3.5 multimodal wrapper
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),  # Kimi: MoE and (as transformers saves it) dense MLP
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),  # Kimi port: forget gate submodule
)

_STORED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# FP8 tensors that feed a GEMM (the only ones kept in FP8): 2-D weights but the embedding table
# (its consumer is a row lookup), and transformers' fused 3-D expert stacks
_EMBEDDING = re.compile(r"embed_tokens\.weight$")
_FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def feeds_gemm(name: str, dim: int) -> bool:
    return (dim == 2 and not _EMBEDDING.search(name)) or (dim == 3 and bool(_FUSED_EXPERTS.search(name)))


class CheckpointError(ValueError):
    """A checkpoint we cannot load; the message names the tensor and the problem."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
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


def _scale_name(weight_name: str) -> str:
    """The block scale's name: `x.weight_scale_inv`; of a fused expert tensor, `x.gate_up_proj_scale_inv`."""
    return weight_name + "_scale_inv"


def canonical_name(name: str) -> str:
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


class TensorSource:
    """Lazy, checked access to a checkpoint's tensors under their canonical names."""

    def __init__(self, model_dir: str | Path, device: torch.device | str, dtype: torch.dtype, *, keep_fp8: bool | None = None,
                 mtp: bool = False):
        """keep_fp8: hand linear weights stored in block FP8 to the layers as BlockFP8Weight (None:
        on CUDA, where the FP8 kernels read them; on the CPU it serves tests of that plumbing, which
        then dequantizes per GEMM) rather than dequantized once here.
        mtp: hold the multi-token-prediction head's tensors (`mtp.*`; `model.mtp.*` read as `mtp.*`)
        and nothing else, for verifier/model/mtp.py; without it they are skipped with the vision tower."""
        model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        self.keep_fp8 = self.device.type == "cuda" if keep_fp8 is None else keep_fp8
        self.fp8_format = read_block_fp8_format(model_dir)
        self._where: dict[str, tuple[object, str]] = {}  # canonical name -> (open file, stored name)
        self._taken: dict[str, str] = {}  # canonical name -> stored name, once taken
        skipped = 0
        self._handles = []
        for path in checkpoint_files(model_dir):
            handle = safe_open(str(path), framework="pt", device="cpu")
            self._handles.append(handle)
            for stored in handle.keys():
                if mtp:
                    if not _MTP.match(stored):
                        continue
                    name = canonical_name(_MTP.sub("mtp.", stored))
                elif _SKIPPED.match(stored):
                    skipped += 1
                    continue
                else:
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

    def take(self, name: str, shape: tuple[int, ...], *, fp32: bool = False) -> torch.Tensor | BlockFP8Weight:
        """Remove tensor `name`, check its shape, cast to the compute dtype (fp32 if asked), move to device.

        A block-FP8 weight comes back dequantized to that dtype, or, where FP8 is kept and the
        tensor feeds a GEMM in the compute dtype, as a BlockFP8Weight on the device."""
        tensor = self.take_raw(name)
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {self.stored_name(name)!r} has shape {list(tensor.shape)}, expected {list(shape)}"
            )
        dtype = torch.float32 if fp32 else self.dtype
        if tensor.dtype == FP8_DTYPE:
            weight = self._block_fp8(name, tensor, dtype)
            if self.keep_fp8 and not fp32 and feeds_gemm(name, tensor.dim()):
                return weight.to(self.device)
            return weight.dequantize().to(self.device)
        # copy=True: a fresh (64-byte aligned) allocation even when no cast is needed. The CPU's
        # one-row GEMV picks its code path, and so its bits, by the weight's address; a tensor
        # read from a file lies wherever the file put it, so without the copy the same weights
        # loaded from two files (an FP8 checkpoint and its dequantized form) could decode differently.
        return tensor.to(device=self.device, dtype=dtype, copy=True).contiguous()

    def take_flat(self, name: str, numel: int, *, fp32: bool = False) -> torch.Tensor:
        """Remove tensor `name`, stored in any shape holding `numel` values -> [numel]."""
        tensor = self.take_raw(name)
        if tensor.numel() != numel:
            raise CheckpointError(f"tensor {self.stored_name(name)!r} has shape {list(tensor.shape)}, expected {numel} values")
        dtype = torch.float32 if fp32 else self.dtype
        if tensor.dtype == FP8_DTYPE:
            tensor = self._block_fp8(name, tensor, dtype).dequantize()
        return tensor.reshape(numel).to(device=self.device, dtype=dtype)

    def take_raw(self, name: str) -> torch.Tensor:
        """Remove tensor `name` as stored (bf16, fp16, fp32, or float8_e4m3fn in an FP8 checkpoint)."""
        if name not in self._where:
            raise CheckpointError(f"missing tensor {name!r}")
        handle, stored = self._where.pop(name)
        tensor = handle.get_tensor(stored)
        self._taken[name] = stored
        if tensor.dtype == FP8_DTYPE and self.fp8_format is None:
            raise CheckpointError(f"tensor {stored!r} is stored as {tensor.dtype}, but config.json has no quantization_config "
                                  "(a block-FP8 checkpoint declares quant_method 'fp8' there)")
        if tensor.dtype not in _STORED_DTYPES and tensor.dtype != FP8_DTYPE:
            raise CheckpointError(f"tensor {stored!r} is stored as {tensor.dtype}; expected bf16, fp16, fp32 "
                                  "or (block FP8) float8_e4m3fn")
        if tensor.dtype != FP8_DTYPE and _scale_name(name) in self._where:
            raise CheckpointError(f"tensor {stored!r} is stored as {tensor.dtype} but has a block scale "
                                  f"{self._where[_scale_name(name)][1]!r}; a scaled weight must be float8_e4m3fn")
        return tensor

    def _block_fp8(self, name: str, data: torch.Tensor, dtype: torch.dtype) -> BlockFP8Weight:
        """An fp8 tensor just taken, with its scale (removed too and checked) -> BlockFP8Weight on the CPU."""
        fmt, stored = self.fp8_format, self.stored_name(name)
        module = stored.removesuffix(".weight")
        if fmt.keeps(module) or fmt.keeps(name.removesuffix(".weight")):
            raise CheckpointError(f"tensor {stored!r} is stored as float8_e4m3fn, but quantization_config.modules_to_not_convert "
                                  f"lists its module {module!r}")
        if data.dim() < 2:
            raise CheckpointError(f"tensor {stored!r} is stored as float8_e4m3fn with shape {list(data.shape)}; block FP8 "
                                  "quantizes weights of two or more dims")
        scale_name = _scale_name(name)
        if scale_name not in self._where:
            raise CheckpointError(f"tensor {stored!r} is stored as float8_e4m3fn but its scale {_scale_name(stored)!r} is missing")
        scale = self.take_raw(scale_name)
        want = fmt.scale_shape(tuple(data.shape))
        if tuple(scale.shape) != want:
            raise CheckpointError(f"tensor {self.stored_name(scale_name)!r} has shape {list(scale.shape)}, expected {list(want)}: "
                                  f"[ceil(N / {fmt.block_n}), ceil(K / {fmt.block_k})] blocks of weight_block_size "
                                  f"[{fmt.block_n}, {fmt.block_k}] over {stored!r} {list(data.shape)}")
        if scale.dtype == FP8_DTYPE:
            raise CheckpointError(f"tensor {self.stored_name(scale_name)!r} is stored as float8_e4m3fn; block scales are fp32")
        return BlockFP8Weight(data, fmt.scales(scale.float().contiguous(), data.shape[-2]), dtype)

    def leftovers(self) -> list[str]:
        return sorted(stored for _, stored in self._where.values())
