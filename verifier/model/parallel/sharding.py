"""Which part of each checkpoint tensor a rank keeps (Megatron-style), and the per-rank config.
The design in full: DESIGN.md section 10, "Sharding".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from hybrid_kernels.linear_fp8 import BlockScales

from ..checkpoint import CheckpointError, TensorSource, feeds_gemm
from ..config import ATTENTION, DENSE, GDN, KDA, MLA, MOE, ModelConfig
from ..fp8 import FP8_DTYPE, BlockFP8Weight
from .group import TensorParallel, split_evenly


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The config one rank of `size` computes: heads and intermediate sizes divided by size (the
    vocabulary whole: its rows are padded to a multiple of size, see DESIGN.md section 10, "Sharding");
    ValueError naming the field that does not divide."""

    def part(n: int, what: str) -> int:
        return split_evenly(n, size, what)

    changes = {}
    if ATTENTION in config.mixers:
        a = config.attention
        kv = part(a.n_kv_heads, "attention n_kv_heads (each rank keeps whole KV heads with their query heads)")
        changes["attention"] = replace(a, n_heads=kv * (a.n_heads // a.n_kv_heads), n_kv_heads=kv)
    if MLA in config.mixers:
        changes["mla"] = replace(config.mla, n_heads=part(config.mla.n_heads, "mla n_heads"))
    if GDN in config.mixers:
        g = config.gdn
        k = part(g.n_k_heads, "gdn n_k_heads (each rank keeps whole key heads with their value heads)")
        changes["gdn"] = replace(g, n_k_heads=k, n_v_heads=k * (g.n_v_heads // g.n_k_heads))
    if KDA in config.mixers:
        changes["kda"] = replace(config.kda, n_heads=part(config.kda.n_heads, "kda n_heads"))
    if MOE in config.mlps:
        m = config.moe
        changes["moe"] = replace(
            m, expert_intermediate_size=part(m.expert_intermediate_size, "moe expert_intermediate_size"),
            shared_intermediate_size=part(m.shared_intermediate_size, "moe shared_intermediate_size") if m.shared_intermediate_size else 0)
    if DENSE in config.mlps:
        changes["intermediate_size"] = part(config.intermediate_size, "intermediate_size (the dense MLP's)")
    return replace(config, **changes)


@dataclass(frozen=True)
class Split:
    """Split a tensor along `dim` into N contiguous parts; with `segments` (their sizes along dim,
    summing to the whole dim) each segment is split so and a rank's parts are joined: q | k | v
    channels, gate | up rows."""

    dim: int
    segments: tuple[int, ...] | None = None

    def whole_shape(self, part_shape: tuple[int, ...], size: int) -> tuple[int, ...]:
        """The stored shape a rank's part of `part_shape` comes from."""
        shape = list(part_shape)
        shape[self.dim] *= size
        return tuple(shape)

    def part(self, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        segments = self.segments or (tensor.shape[self.dim],)
        assert sum(segments) == tensor.shape[self.dim], f"segments {segments} do not cover dim {self.dim} of {list(tensor.shape)}"
        pieces, offset = [], 0
        for length in segments:
            per_rank = length // size
            pieces.append(tensor.narrow(self.dim, offset + rank * per_rank, per_rank))
            offset += length
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def indices(self, length: int, rank: int, size: int) -> torch.Tensor:
        """The positions along dim that `part` keeps, in its order: int64 [length / size]."""
        segments = self.segments or (length,)
        starts = torch.tensor(segments).cumsum(0) - torch.tensor(segments)
        return torch.cat([torch.arange(int(start) + rank * (n // size), int(start) + (rank + 1) * (n // size))
                          for start, n in zip(starts, segments)])

    def describe(self, size: int) -> str:
        what = f"{len(self.segments)} segments {list(self.segments)}, each" if self.segments else "it"
        return f"{what} split into {size} parts along dim {self.dim}"


@dataclass(frozen=True)
class FirstRankOnly:
    """A bias added after a split sum: whole on rank 0, zeros elsewhere (the sum adds it once)."""

    def whole_shape(self, part_shape: tuple[int, ...], size: int) -> tuple[int, ...]:
        return tuple(part_shape)

    def part(self, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        return tensor if rank == 0 else torch.zeros_like(tensor)

    def describe(self, size: int) -> str:
        return "whole on rank 0, zeros on the others"


@dataclass(frozen=True)
class VocabRows:
    """The embedding's and the head's rows, [vocab, H]: cdiv(vocab, N) a rank (TensorParallel.vocab_rows),
    the rows past the last id zeros."""

    vocab: int
    dim: int = 0

    def whole_shape(self, part_shape: tuple[int, ...], size: int) -> tuple[int, ...]:
        return (self.vocab, *part_shape[1:])

    def kept(self, rank: int, size: int) -> range:
        """The ids whose rows this rank holds (the padding aside)."""
        rows = TensorParallel(rank, size).vocab_rows(self.vocab)
        return range(min(rows.start, self.vocab), min(rows.stop, self.vocab))

    def padding(self, rank: int, size: int) -> int:
        return -(-self.vocab // size) - len(self.kept(rank, size))

    def part(self, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        kept = self.kept(rank, size)
        rows = tensor.narrow(0, kept.start, len(kept)) if len(kept) else tensor[:0]
        pad = self.padding(rank, size)
        return torch.cat((rows, rows.new_zeros((pad, *tensor.shape[1:])))) if pad else rows

    def indices(self, length: int, rank: int, size: int) -> torch.Tensor:
        return torch.tensor(self.kept(rank, size), dtype=torch.int64)

    def describe(self, size: int) -> str:
        return f"vocabulary rows split into {size} parts of {-(-self.vocab // size)}, the last padded with zero rows"


COLUMNS, INPUTS, VECTOR = Split(0), Split(1), Split(0)  # [out, in] weights: output features / input features; 1-D per-head vectors

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.\d+\.(gate_proj|up_proj|w1|w3|down_proj|w2)\.weight$")
_EXPERT_INPUTS = ("down_proj", "w2")


class ShardPlan:
    """name -> the Split (or FirstRankOnly) of a canonical tensor name; None: whole on every rank."""

    def __init__(self, config: ModelConfig):
        self.config = config

    def rule(self, name: str):
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return VocabRows(self.config.vocab_size)
        match = _LAYER.match(name)
        if match is None or int(match.group(1)) >= self.config.n_layers:
            return None
        index, rest = int(match.group(1)), match.group(2)
        mixer = self._mixer_rules(self.config.mixers[index]).get(rest)
        return mixer if mixer is not None else self._mlp_rule(self.config.mlps[index], rest)

    def _mixer_rules(self, kind: str) -> dict:
        c = self.config
        if kind == ATTENTION:
            p = "self_attn."
            rules = {p + f"{n}_proj.{t}": COLUMNS for n in "qkv" for t in ("weight", "bias")}
            return {**rules, p + "o_proj.weight": INPUTS, p + "o_proj.bias": FirstRankOnly()}
        if kind == MLA:
            p = "self_attn."
            return {p + "q_proj.weight": COLUMNS, p + "q_b_proj.weight": COLUMNS, p + "kv_b_proj.weight": COLUMNS, p + "o_proj.weight": INPUTS}
        if kind == GDN:
            g, p = c.gdn, "linear_attn."
            qkv = Split(0, (g.key_dim, g.key_dim, g.value_dim))
            rules = {p + f"{n}.weight": COLUMNS for n in ("in_proj_qkvz", "in_proj_ba", "in_proj_z", "in_proj_b", "in_proj_a")}
            return {**rules, p + "in_proj_qkv.weight": qkv, p + "conv1d.weight": qkv, p + "dt_bias": VECTOR, p + "A_log": VECTOR,
                    p + "out_proj.weight": INPUTS}
        if kind == KDA:
            P, p = c.kda.proj_dim, "self_attn."
            rules = {p + f"{n}.weight": COLUMNS for n in ("q_proj", "k_proj", "v_proj", "b_proj", "f_b_proj", "g_b_proj",
                                                          "q_conv1d", "k_conv1d", "v_conv1d")}
            return {**rules, p + "conv1d.weight": Split(0, (P, P, P)), p + "dt_bias": VECTOR, p + "A_log": VECTOR,
                    p + "o_proj.weight": INPUTS}
        raise ValueError(f"unknown mixer {kind!r}")

    def _mlp_rule(self, kind: str, rest: str):
        if kind == DENSE:
            return {"mlp.gate_proj.weight": COLUMNS, "mlp.up_proj.weight": COLUMNS, "mlp.down_proj.weight": INPUTS}.get(rest)
        expert = _EXPERT.match(rest)
        if expert:
            return INPUTS if expert.group(1) in _EXPERT_INPUTS else COLUMNS
        I = self.config.moe.expert_intermediate_size
        fused = {"mlp.experts.gate_up_proj": Split(1, (I, I)), "mlp.experts.down_proj": Split(2)}  # [E, 2I, H], [E, H, I]
        shared = {f"mlp.{s}.{n}.weight": INPUTS if n == "down_proj" else COLUMNS
                  for s in ("shared_expert", "shared_experts") for n in ("gate_proj", "up_proj", "down_proj")}
        return {**fused, **shared}.get(rest)


class ShardedSource(TensorSource):
    """A TensorSource that hands each layer its rank's part of a split tensor (ShardPlan), in the
    shape the layer asks for (the local config's); whole tensors as TensorSource does.

    The stored tensor's whole shape is checked first (an error names it, its stored shape and the
    split), the part is cut on the CPU and only the part moves to the device. A block-FP8 tensor
    is dequantized whole, then cut (what the CPU backend loads anyway), or, where the source keeps
    FP8 for the FP8 GEMMs (CUDA), cut in FP8 (`fp8_part`): the same real values as the dequantized
    part, bit for bit."""

    def __init__(self, model_dir, device, dtype: torch.dtype, config: ModelConfig, parallel: TensorParallel, *,
                 keep_fp8: bool | None = None):
        super().__init__(model_dir, device, dtype, keep_fp8=keep_fp8)
        self.plan = ShardPlan(config)
        self.parallel = parallel

    def take(self, name: str, shape: tuple[int, ...], *, fp32: bool = False):
        rule = self.plan.rule(name)
        if rule is None:
            return super().take(name, shape, fp32=fp32)
        size = self.parallel.size
        whole = rule.whole_shape(tuple(shape), size)
        tensor = self.take_raw(name)
        if tuple(tensor.shape) != whole:
            raise CheckpointError(f"tensor {self.stored_name(name)!r} has shape {list(tensor.shape)}, expected {list(whole)} "
                                  f"(tensor parallelism: {rule.describe(size)}, each rank's part {list(shape)})")
        dtype = torch.float32 if fp32 else self.dtype
        if tensor.dtype == FP8_DTYPE and self.keep_fp8 and not fp32 and feeds_gemm(name, tensor.dim()):
            weight = self._block_fp8(name, tensor, dtype)
            return fp8_part(weight, rule, self.parallel.rank, size, self.stored_name(name)).to(self.device)
        tensor = self._dense(name, tensor, dtype, fp32)
        part = rule.part(tensor, self.parallel.rank, size)
        # a fresh allocation, as TensorSource.take makes (its comment: the CPU GEMV's path follows the address)
        return part.to(device=self.device, dtype=dtype, copy=True).contiguous()

    def take_flat(self, name: str, numel: int, *, fp32: bool = False) -> torch.Tensor:
        rule = self.plan.rule(name)
        if rule is None:
            return super().take_flat(name, numel, fp32=fp32)
        size = self.parallel.size
        tensor = self.take_raw(name)
        if tensor.numel() != numel * size:
            raise CheckpointError(f"tensor {self.stored_name(name)!r} has shape {list(tensor.shape)}, expected {numel * size} "
                                  f"values (tensor parallelism: {size} parts of {numel})")
        dtype = torch.float32 if fp32 else self.dtype
        flat = self._dense(name, tensor, dtype, fp32).reshape(-1)
        return rule.part(flat, self.parallel.rank, size).to(device=self.device, dtype=dtype, copy=True)

    def _dense(self, name: str, tensor: torch.Tensor, dtype: torch.dtype, fp32: bool) -> torch.Tensor:
        """A stored tensor just taken, as a plain tensor on the CPU (block FP8 dequantized to dtype)."""
        if tensor.dtype != FP8_DTYPE:
            return tensor
        return self._block_fp8(name, tensor, dtype).dequantize()


def fp8_part(weight: BlockFP8Weight, rule, rank: int, size: int, stored: str) -> BlockFP8Weight:
    """A rank's part of a block-FP8 weight [..., N, K], kept in FP8 (its real values those of the
    dequantized whole's part, exactly: dequantization is per element, from the element's block).
      rows (output features, any segments): the kept rows and their scale_row entries; scale_inv
          whole (it is small, and scale_row names each row's scale row), so any row split works;
      inputs (K): a contiguous range of columns, which must start on a scale block boundary (the
          kernels find a column's scale block as column // block_k): a part of K / size columns
          where K / size is a multiple of block_k; CheckpointError naming the tensor otherwise."""
    data, scales = weight.data, weight.scales
    if isinstance(rule, VocabRows) and data.dim() == 2:  # the kept rows, then zero rows (scale row 0: real value 0)
        index, pad = rule.indices(data.shape[-2], rank, size), rule.padding(rank, size)
        rows, scale_row = data.index_select(0, index), scales.scale_row.index_select(0, index)
        return BlockFP8Weight(torch.cat((rows, rows.new_zeros((pad, data.shape[1])))).contiguous(),
                              BlockScales(scales.scale_inv, torch.cat((scale_row, scale_row.new_zeros(pad))).contiguous(),
                                          scales.block_k), weight.dtype)
    if not isinstance(rule, Split) or rule.dim not in (data.dim() - 2, data.dim() - 1):
        raise CheckpointError(f"tensor {stored!r}: block FP8 split as {rule.describe(size)} is not supported")
    if rule.dim == data.dim() - 2:
        index = rule.indices(data.shape[-2], rank, size)
        return BlockFP8Weight(data.index_select(-2, index).contiguous(),
                              BlockScales(scales.scale_inv, scales.scale_row.index_select(0, index).contiguous(), scales.block_k),
                              weight.dtype)
    block_k, per_rank = scales.block_k, data.shape[-1] // size
    if rule.segments is not None or per_rank % block_k:
        raise CheckpointError(f"tensor {stored!r} is block FP8 with scale blocks of {block_k} input columns: split into "
                              f"{size} parts of {per_rank} columns, a part would not start on a block boundary; "
                              f"run it with a parallel size whose part is a multiple of {block_k}, or dequantize it")
    start = rank * per_rank
    first, last = start // block_k, -(-(start + per_rank) // block_k)
    return BlockFP8Weight(data.narrow(-1, start, per_rank).contiguous(),
                          BlockScales(scales.scale_inv[..., first:last].contiguous(), scales.scale_row, block_k), weight.dtype)
