"""Block-FP8 checkpoints (MODEL_REFERENCE.md A''): config.json's `quantization_config`, and the
weight types that carry FP8 weights from the loader to the GEMMs.
The design in full: DESIGN.md section 6, "Block-FP8 checkpoints".
"""

from __future__ import annotations

import functools
import re
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch

from hybrid_kernels.linear_fp8 import (BlockScales, dequantize, dequantize_ref, fp8_config, raw_weight, scale_after_dense,
                                       standard_scale_row)

from .hf_config import ConfigError, read_json_object

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclass(frozen=True)
class BlockFP8Format:
    """A validated `quantization_config` of quant_method "fp8": block sizes and unconverted modules."""

    block_n: int
    block_k: int
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self):
        if self.block_n < 1 or self.block_k < 1:
            raise ConfigError(f"config.json: quantization_config.weight_block_size must be two positive ints, got [{self.block_n}, {self.block_k}]")

    @classmethod
    def from_config(cls, qc: dict) -> "BlockFP8Format":
        """config.json's quantization_config -> the format; ConfigError naming the field otherwise."""
        field = "config.json: quantization_config"
        if not isinstance(qc, dict):
            raise ConfigError(f"{field} must be an object, got {type(qc).__name__}")
        if qc.get("quant_method") != "fp8":
            raise ConfigError(f"{field}.quant_method is {qc.get('quant_method')!r}; only block FP8 ('fp8') is supported")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ConfigError(f"{field}.fmt is {fmt!r}; only 'e4m3' (float8_e4m3fn weights) is supported")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ConfigError(f"{field}.activation_scheme is {scheme!r}; only 'dynamic' is supported (no stored activation scales)")
        block = qc.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool) for b in block)):
            raise ConfigError(f"{field}.weight_block_size must be [block_n, block_k] (two ints), got {block!r}; "
                              "per-tensor FP8 (no block size) is not supported")
        skip = qc.get("modules_to_not_convert") or []
        if not (isinstance(skip, list) and all(isinstance(m, str) for m in skip)):
            raise ConfigError(f"{field}.modules_to_not_convert must be a list of module names, got {skip!r}")
        return cls(block[0], block[1], tuple(skip))

    def to_config(self) -> dict:
        """The quantization_config as published FP8 checkpoints write it."""
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [self.block_n, self.block_k], "modules_to_not_convert": list(self.modules_to_not_convert)}

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
        """[..., N, K] -> [..., ceil(N / block_n), ceil(K / block_k)]."""
        *lead, n, k = weight_shape
        return (*lead, -(-n // self.block_n), -(-k // self.block_k))

    def scales(self, scale_inv: torch.Tensor, n: int) -> BlockScales:
        """The BlockScales of a weight with N = n rows as stored (row r uses scale row r // block_n)."""
        return BlockScales(scale_inv, standard_scale_row(n, self.block_n, scale_inv.device), self.block_k)

    def keeps(self, module: str) -> bool:
        """Whether modules_to_not_convert names `module` (transformers' rule: a prefix or a regex
        from the start up to a module boundary, or a suffix)."""
        return bool(_kept_prefix_pattern(self.modules_to_not_convert).match(module)) or module.endswith(self.modules_to_not_convert)


@functools.cache
def _kept_prefix_pattern(modules: tuple[str, ...]) -> re.Pattern:
    """modules_to_not_convert as one compiled pattern: a published list names every layer's modules
    (~140 entries), and BlockFP8Format.keeps is asked twice per FP8 tensor at load."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    alternatives = "|".join(f"(?:{key})" for key in modules) or "(?!)"
    return re.compile(f"(?:{alternatives}){boundary}")


def read_block_fp8_format(model_dir: str | Path) -> BlockFP8Format | None:
    """The checkpoint's block-FP8 format, from config.json's quantization_config; None without one."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    qc = read_json_object(path).get("quantization_config")
    return None if qc is None else BlockFP8Format.from_config(qc)


@dataclass(frozen=True)
class BlockFP8Weight:
    """A linear weight kept in block FP8: data float8_e4m3fn [..., N, K] (experts: [E, N, K]) with
    its BlockScales; dtype is the compute dtype its real values are cast to."""

    data: torch.Tensor
    scales: BlockScales
    dtype: torch.dtype
    # the real values [N, K] in dtype, kept beside a dense weight for GEMMs of many rows (kept_real):
    # they multiply it as it is instead of dequantizing it every call, with the same bits
    real: torch.Tensor | None = None
    # or, where the dense GEMM walks it scale-after (kernels/linear_fp8.py, `scale_after_dense`), its
    # raw values [N, K] bf16 (`raw_weight`), which that walk's many-rows kernel multiplies
    raw: torch.Tensor | None = None

    @property
    def kept_bytes(self) -> int:
        """Bytes kept beside the fp8 values for GEMMs of many rows (real or raw values)."""
        return sum(t.numel() * t.element_size() for t in (self.real, self.raw) if t is not None)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        """Bytes a GEMM reads: fp8 values, fp32 scales, int32 scale rows."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales.scale_inv, self.scales.scale_row))

    def to(self, device: torch.device | str) -> "BlockFP8Weight":
        s = self.scales
        return BlockFP8Weight(self.data.to(device), BlockScales(s.scale_inv.to(device), s.scale_row.to(device), s.block_k), self.dtype,
                              None if self.real is None else self.real.to(device), None if self.raw is None else self.raw.to(device))

    def dequantize(self) -> torch.Tensor:
        """The real weight in the compute dtype (what the CPU backend loads)."""
        return dequantize_ref(self.data, self.scales, self.dtype)


@dataclass(frozen=True)
class OutFeatureGroups:
    """A linear weight whose output features are consecutive groups of different kinds (block FP8
    beside a module kept in bf16): one GEMM per group, outputs side by side."""

    groups: tuple[Union[torch.Tensor, BlockFP8Weight], ...]

    @property
    def sizes(self) -> list[int]:
        return [g.shape[0] for g in self.groups]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(self.sizes), self.groups[0].shape[1]))


LinearWeight = Union[torch.Tensor, BlockFP8Weight, OutFeatureGroups]


def kept_real(weight):
    """A dense block-FP8 weight (or the FP8 groups of OutFeatureGroups) with what its GEMMs of many
    rows multiply kept beside it, made once on its device: its real values (dequantize's), or its
    raw values where the GEMM walks it scale-after (kernels/linear_fp8.py); any other value as it is."""
    if isinstance(weight, BlockFP8Weight) and weight.data.dim() == 2 and weight.real is None and weight.raw is None:
        n, k = weight.data.shape
        if weight.dtype == torch.bfloat16 and scale_after_dense(n, k, fp8_config(n, k, weight.dtype), weight.scales.block_k):
            return dataclasses.replace(weight, raw=raw_weight(weight.data))
        return dataclasses.replace(weight, real=dequantize(weight.data, weight.scales, weight.dtype))
    if isinstance(weight, OutFeatureGroups):
        groups = tuple(kept_real(g) for g in weight.groups)
        return weight if all(a is b for a, b in zip(groups, weight.groups)) else OutFeatureGroups(groups)
    return weight


def cat_out_features(*weights: torch.Tensor | BlockFP8Weight) -> LinearWeight:
    """Weights [N_i, K] of one input -> one weight [sum N_i, K] (one GEMM reads them all).

    Tensors: torch.cat. FP8 weights: data and scale rows concatenated, each row keeping its own
    scale row. Mixed: consecutive weights of one kind are joined, and the groups form an
    OutFeatureGroups (a GEMM per group)."""
    runs: list[list] = []
    for w in weights:
        if runs and isinstance(w, BlockFP8Weight) == isinstance(runs[-1][0], BlockFP8Weight):
            runs[-1].append(w)
        else:
            runs.append([w])
    groups = tuple(_cat_fp8(run) if isinstance(run[0], BlockFP8Weight) else torch.cat(run).contiguous() for run in runs)
    return groups[0] if len(groups) == 1 else OutFeatureGroups(groups)


def _cat_fp8(weights: list[BlockFP8Weight]) -> BlockFP8Weight:
    first = weights[0]
    if any(w.scales.block_k != first.scales.block_k or w.dtype != first.dtype or w.data.dim() != 2 for w in weights):
        raise ValueError("cat_out_features: FP8 weights to join must be 2-D and share block_k and compute dtype")
    rows, offset = [], 0
    for w in weights:  # each part's scale rows follow the previous parts' in the joined scale_inv
        rows.append(w.scales.scale_row + offset)
        offset += w.scales.scale_inv.shape[0]
    scales = BlockScales(torch.cat([w.scales.scale_inv for w in weights]).contiguous(), torch.cat(rows).contiguous(), first.scales.block_k)
    return BlockFP8Weight(torch.cat([w.data for w in weights]).contiguous(), scales, first.dtype)


def select_rows(weight: torch.Tensor | BlockFP8Weight, rows: slice | torch.Tensor) -> torch.Tensor | BlockFP8Weight:
    """Output rows (dim -2) of a weight [..., N, K], by a slice or an int64 index, as a contiguous
    copy; an FP8 weight's rows keep their scale rows."""
    if isinstance(weight, BlockFP8Weight):
        s = weight.scales
        data = weight.data[..., rows, :] if isinstance(rows, slice) else weight.data.index_select(-2, rows.to(weight.data.device))
        row_index = s.scale_row[rows] if isinstance(rows, slice) else s.scale_row[rows.to(s.scale_row.device)]
        return BlockFP8Weight(data.contiguous(), BlockScales(s.scale_inv, row_index.contiguous(), s.block_k), weight.dtype)
    if isinstance(rows, slice):
        return weight[..., rows, :].contiguous()
    return weight.index_select(-2, rows.to(weight.device)).contiguous()


def stack_experts(weights: list[torch.Tensor | BlockFP8Weight]) -> torch.Tensor | BlockFP8Weight:
    """Per-expert weights [N, K] -> [E, N, K]. FP8 experts (stored alike, so with one scale-row
    layout) stack data and scales [E, S, ceil(K / block_k)]; a mix is dequantized."""
    if not all(isinstance(w, BlockFP8Weight) for w in weights):
        return torch.stack([dense(w) for w in weights])
    first = weights[0].scales
    if any(not torch.equal(w.scales.scale_row, first.scale_row) or w.scales.block_k != first.block_k for w in weights):
        raise ValueError("stack_experts: FP8 experts must share their scale layout")
    scales = BlockScales(torch.stack([w.scales.scale_inv for w in weights]), first.scale_row, first.block_k)
    return BlockFP8Weight(torch.stack([w.data for w in weights]), scales, weights[0].dtype)


def append_expert(stacked: torch.Tensor | BlockFP8Weight, weight: torch.Tensor | BlockFP8Weight) -> torch.Tensor | BlockFP8Weight:
    """Stacked experts [E, N, K] and one more expert's weight [N, K] -> [E + 1, N, K], the new one
    last (a shared expert folded in). FP8 with FP8 of one scale layout stays FP8; else dequantized."""
    if isinstance(stacked, BlockFP8Weight) and isinstance(weight, BlockFP8Weight):
        s, w = stacked.scales, weight.scales
        if torch.equal(s.scale_row, w.scale_row) and s.block_k == w.block_k and stacked.dtype == weight.dtype:
            scales = BlockScales(torch.cat((s.scale_inv, w.scale_inv[None])).contiguous(), s.scale_row, s.block_k)
            return BlockFP8Weight(torch.cat((stacked.data, weight.data[None])).contiguous(), scales, stacked.dtype)
    return torch.cat((dense(stacked), dense(weight)[None])).contiguous()


def dense(weight: torch.Tensor | BlockFP8Weight) -> torch.Tensor:
    """A plain tensor: FP8 weights dequantized to their compute dtype."""
    return weight.dequantize() if isinstance(weight, BlockFP8Weight) else weight


def same_kind(*weights: torch.Tensor | BlockFP8Weight) -> tuple:
    """The weights as they are when all are FP8 or all plain; else all dequantized (one kernel
    reads them together)."""
    if all(isinstance(w, BlockFP8Weight) for w in weights):
        return weights
    return tuple(dense(w) for w in weights)
