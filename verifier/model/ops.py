"""Reference numeric primitives, written to mirror the casts of the HF modules they stand for.
The design in full: DESIGN.md section 6, "Reference primitives".
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybrid_kernels import linear as linear_kernel
from hybrid_kernels import linear_fp8, moe, norms
from hybrid_kernels.linear import SplitSums
from hybrid_kernels.moe_grouped import PendingCombine, group_pairs
from hybrid_kernels.moe_route import Routing
from hybrid_kernels.runtime import pick, use_triton

from .fp8 import BlockFP8Weight, LinearWeight, OutFeatureGroups


@dataclass(frozen=True)
class MixedRows:
    """The rows of a forward that a step and prompts share (HybridModel.compute's prompts): the
    step's `verify` rows first, then prompt groups of `groups` rows each, a group being what one
    prefill forward would hold. As each_row's row_invariant, it gives every row the bits it has in
    the step or in its group's own forward: with the kernels one launch over all rows (a row's bits
    are its own), without them each verify row alone and each group whole, as the CPU reference's
    step and prefill compute them."""

    verify: int
    groups: tuple[int, ...]

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Each group's rows [begin, end), in order after the verify's."""
        return list(itertools.pairwise(itertools.accumulate(self.groups, initial=self.verify)))


def each_row(fn, *tensors: torch.Tensor, row_invariant: bool | MixedRows):
    """fn(*tensors) over all rows at once, or (row_invariant, without the kernels) one row at a
    time, concatenated. Every tensor has rows on dim 0; fn returns a tensor or a tuple of them.
    row_invariant a MixedRows: without the kernels, its verify rows one at a time, then each group
    whole (MixedRows)."""
    if not row_invariant or use_triton(tensors[0]):
        return fn(*tensors)
    if isinstance(row_invariant, MixedRows):
        verify = row_invariant.verify
        outs = [each_row(fn, *(t[:verify] for t in tensors), row_invariant=True)] if verify else []
        for begin, end in row_invariant.spans:
            outs.append(fn(*(t[begin:end].clone() for t in tensors)))
    else:
        outs = [fn(*(t[r : r + 1].clone() for t in tensors)) for r in range(tensors[0].shape[0])]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None, *,
           into_add_norm: bool = False) -> torch.Tensor | SplitSums:
    """x [rows, in] @ weight [out, in]^T (+ bias): the row-invariant Triton GEMM on CUDA.

    weight: a tensor in x's dtype; a BlockFP8Weight (the W8A16 FP8 GEMM on CUDA); or
    OutFeatureGroups (one GEMM per group, outputs side by side).
    into_add_norm: the result goes only to add_rms_norm (a mixer's or an MLP's output projection):
    on CUDA a weight whose K is split then hands over its unfinished sums (hybrid_kernels.linear.SplitSums),
    which the norm's kernel finishes bitwise as the split's reduce would: one launch fewer each
    (48 a step for the 2B model)."""
    if isinstance(weight, OutFeatureGroups):
        biases = [None] * len(weight.groups) if bias is None else bias.split(weight.sizes)
        if not use_triton(x):
            return torch.cat([linear(x, w, b) for w, b in zip(weight.groups, biases)], dim=1)
        # on CUDA each group's GEMM writes its columns of one output: no copy to join them
        out = torch.empty((x.shape[0], sum(weight.sizes)), dtype=x.dtype, device=x.device)
        start = 0
        for w, b in zip(weight.groups, biases):
            _gemm(x, w, b, out[:, start : start + w.shape[0]])
            start += w.shape[0]
        return out
    if isinstance(weight, BlockFP8Weight):
        if use_triton(x):
            return linear_fp8.linear_fp8(x, weight.data, weight.scales, bias, defer_split=into_add_norm, real=weight.real,
                                         raw=weight.raw)
        weight = weight.dequantize()
    if use_triton(x):
        return linear_kernel.linear(x, weight, bias, defer_split=into_add_norm)
    return F.linear(x, weight, bias)


def linear_columns(x: torch.Tensor, weight: LinearWeight, tail: int) -> tuple[torch.Tensor, torch.Tensor | SplitSums]:
    """x [rows, in] @ weight^T split into (the first out - tail columns, the last tail columns).

    On CUDA, where the last tail columns are a plain-tensor group of OutFeatureGroups (the bf16
    module beside a block-FP8 projection), that group's GEMM hands over its unfinished split-K sums
    (SplitSums) where its K is split, for a consumer that finishes them as the reduce would
    (kernels/gdn_heads.py's gates): one launch fewer. Elsewhere both parts are views of `linear`'s
    output."""
    if (use_triton(x) and isinstance(weight, OutFeatureGroups) and isinstance(weight.groups[-1], torch.Tensor)
            and weight.sizes[-1] == tail):
        head = linear(x, OutFeatureGroups(weight.groups[:-1])) if len(weight.groups) > 2 else linear(x, weight.groups[0])
        return head, linear_kernel.linear(x, weight.groups[-1], defer_split=True)
    out = linear(x, weight)
    return out[:, : out.shape[1] - tail], out[:, out.shape[1] - tail :]


def _gemm(x: torch.Tensor, weight: torch.Tensor | BlockFP8Weight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """One CUDA GEMM into out (rows may be strided, features contiguous)."""
    if isinstance(weight, BlockFP8Weight):
        linear_fp8.linear_fp8(x, weight.data, weight.scales, bias, out, real=weight.real, raw=weight.raw)
    else:
        linear_kernel.linear(x, weight, bias, out)


def head_logits(x: torch.Tensor, weight: LinearWeight, out: torch.Tensor | None = None, *, row_invariant: bool) -> torch.Tensor:
    """Final-normed rows x [rows, H] through the LM head weight [vocab, H] -> fp32 logits [rows,
    vocab], into out when given: the head's output in x's dtype, widened. On CUDA, with a plain
    weight, one GEMM writes them so (kernels/linear.py: the bits of .float() of its output, without
    that output and the pass that widens it, a full extra write and read of a rows x vocab tensor;
    `python -m bench.gpu` times the verify steps it shortens)."""
    if use_triton(x) and isinstance(weight, torch.Tensor):
        if out is None:
            out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
        return linear_kernel.linear(x, weight, out=out)
    logits = each_row(lambda rows: linear(rows, weight).float(), x, row_invariant=row_invariant)
    return logits if out is None else out.copy_(logits)


def routed_experts(x: torch.Tensor, routing, w_gate, w_up, w_down, *, into_add_norm: bool = False,
                   prefill: bool = False) -> torch.Tensor | PendingCombine:
    """A MoE layer's experts (kernels/moe.py): x [rows, H]; routing: (ids, fp32 weights) [rows,
    slots], on CUDA normally the routing launch's Routing (its pairs already grouped by expert);
    stacked expert weights [E, I, H], [E, I, H], [E, H, I], all tensors in x's dtype or all
    BlockFP8Weight -> [rows, H].
    into_add_norm: the result goes only to add_rms_norm: on CUDA the experts' outputs before their
    weighted sum (hybrid_kernels.moe_grouped.PendingCombine), which the norm's kernel finishes
    bitwise as the combine would: one launch fewer a MoE layer.
    prefill: the rows are a prefill's: on CUDA block-FP8 experts of many take prefill's launch
    (kernels/moe_grouped.py, PREFILL_LAUNCH)."""
    fp8 = isinstance(w_gate, BlockFP8Weight)
    weights = (w_gate.data, w_up.data, w_down.data) if fp8 else (w_gate, w_up, w_down)
    scales = (w_gate.scales, w_up.scales, w_down.scales) if fp8 else None
    grouped = pick(moe.moe_experts_routed, None, x)  # the kernels on CUDA
    if grouped is not None:
        if not isinstance(routing, Routing):
            routing = group_pairs(routing[0].contiguous(), routing[1].float().contiguous(), weights[0].shape[0])
        return grouped(x, routing, *weights, scales, defer_combine=into_add_norm, prefill=prefill)
    ids, expert_weights = routing[0], routing[1].float()
    if fp8:
        return moe.moe_experts_fp8_ref(x, ids, expert_weights, *weights, scales)
    return moe.moe_experts_ref(x, ids, expert_weights, *weights)


def _rowwise(launcher, reference, x: torch.Tensor, *rest, **kwargs) -> torch.Tensor:
    """Apply a norm over the last dim of x [..., d] (and like-shaped gates) as [rows, d]."""
    shape = x.shape
    flat = [t.reshape(-1, shape[-1]) if isinstance(t, torch.Tensor) and t.shape == shape else t for t in (x, *rest)]
    return pick(launcher, reference, x)(*flat, **kwargs).reshape(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """RMSNorm over the last dim. zero-centred (Qwen): cast(norm(x32) * (1 + w32)); plain (Kimi): w * cast(norm(x32))."""
    return _rowwise(norms.rms_norm, norms.rms_norm_ref, x, weight, eps, zero_centred)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | SplitSums | PendingCombine, weight: torch.Tensor, eps: float,
                 zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)) for [rows, d]: one kernel on CUDA (the residual
    stream's add fused into the next norm; a SplitSums or PendingCombine residual finished there too)."""
    return pick(norms.add_rms_norm, norms.add_rms_norm_ref, x)(x, residual, weight, eps, zero_centred)


def silu_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm of x, gate [rows, heads, d]: cast(w * cast(norm(x32)) * silu(gate32)); weight
    not zero-centred. The gate (z, a column slice of the input projection: its rows strided) goes
    to the kernel as it is, where flattening it to [rows * heads, d] would copy it in every step of
    more than one row."""
    rows, heads, d = x.shape
    return pick(norms.silu_gated_rms_norm, norms.silu_gated_rms_norm_ref, x)(x.reshape(rows * heads, d), gate, weight,
                                                                           eps).reshape(x.shape)


def sigmoid_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: cast(w32 * norm(x32) * sigmoid(gate32))."""
    return _rowwise(norms.sigmoid_gated_rms_norm, norms.sigmoid_gated_rms_norm_ref, x, gate, weight, eps)


def l2norm(x: torch.Tensor, form: str) -> torch.Tensor:
    """fp32 x [..., d] over the last dim: "rsqrt" x * rsqrt(sum x^2 + 1e-6) (GDN), "div" x / sqrt(...) (KDA)."""
    return _rowwise(norms.l2norm, norms.l2norm_ref, x, form)


@functools.lru_cache(maxsize=None)
def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """inv_freq [ceil(rotary_dim / 2)] fp32: theta^(-2i / rotary_dim), exactly as transformers builds
    it; made once per (rotary_dim, theta, device) and shared (the same ops give the same bits every
    time, so a step need not launch them)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows, 2 * len(inv_freq)] for integer positions [rows] (rotate-half layout)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


_ROPE_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rope_table(length: int, rotary_dim: int, theta: float, device: torch.device | str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_cos_sin of every position 0 .. length - 1: cos, sin [length, 2 * ceil(rotary_dim / 2)],
    made once per (length, rotary_dim, theta, device, dtype) and shared by the layers. Each element
    is computed alone (an int-to-float conversion, a product, cos or sin, a cast: elementwise ops
    on CUDA), so row p of the table holds the bits rope_cos_sin gives position p; a kernel then
    reads its rows' entries instead of seven launches per attention layer and step.

    Built outside any CUDA graph capture: inside one, its kernels would only be recorded and the
    table would stay unwritten until a replay (a forward runs eagerly before every capture)."""
    device = torch.device(device)
    key = (length, rotary_dim, theta, device, dtype)
    table = _ROPE_TABLES.get(key)
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("rope_table: a table first asked for inside a CUDA graph capture; run a forward eagerly first")
        positions = torch.arange(length, device=device)
        table = _ROPE_TABLES[key] = rope_cos_sin(positions, rope_inv_freq(rotary_dim, theta, device), dtype)
    return table


def kimi_softplus(x: torch.Tensor) -> torch.Tensor:
    """The Kimi forget gate's softplus: x above 20, else log(1 + exp(x)) (not log1p)."""
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))
