"""The routed experts of a MoE layer, per row, with no host synchronisation (CUDA-graph capturable).
The design in full: DESIGN.md section 6, "The routed experts".
"""

from __future__ import annotations

import torch

from .checks import check_launchable, check_operand, check_tensor, contiguous_aligned
from .linear_fp8 import FP8, BlockScales, check_block_scales, dequantize_ref
from .moe_grouped import PendingCombine, group_pairs, grouped_experts
from .moe_route import Routing

DTYPES = (torch.float32, torch.bfloat16)
MAX_TOP_K = 16  # the ids live in one register block; the supported families use top_k 8 or 10

ExpertScales = tuple[BlockScales, BlockScales, BlockScales]  # (gate, up, down) of fp8 expert weights


def _check(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
           w_down: torch.Tensor, out: torch.Tensor | None, scales: ExpertScales | None = None) -> None:
    """Shapes, dtypes, devices and contiguity, with messages that name the tensor. scales: the
    fp8 path's block scales (the weights are then float8_e4m3fn), else None."""
    op = "moe_experts" if scales is None else "moe_experts_fp8"
    check_operand(op, "x", x, "[R, H]", DTYPES)
    r, h = x.shape
    if w_gate.dim() != 3:
        raise ValueError(f"{op}: w_gate must be 3-D [E, I, H], got shape {list(w_gate.shape)}")
    e, i, _ = w_gate.shape
    if expert_ids.dim() != 2 or expert_ids.shape[0] != r:
        raise ValueError(f"{op}: expert_ids must be [R, T] with R = {r}, got shape {list(expert_ids.shape)}")
    t = expert_ids.shape[1]
    if not 1 <= t <= min(MAX_TOP_K, e):
        raise ValueError(f"{op}: expert_ids has T = {t} slots per row; need 1 <= T <= min({MAX_TOP_K}, E = {e})")
    on_x = ("x", x)
    check_tensor(op, "expert_ids", expert_ids, (r, t), torch.int64, on_x)
    check_tensor(op, "expert_weights", expert_weights, (r, t), torch.float32, on_x, layout="[R, T]")
    # E and I from w_gate, H from x; contiguous: a silent copy of every expert per call would cost
    # more than the layer
    weight_dtype = x.dtype if scales is None else FP8
    check_tensor(op, "w_gate", w_gate, (e, i, h), weight_dtype, on_x, layout="[E, I, H]", contiguous=True)
    check_tensor(op, "w_up", w_up, (e, i, h), weight_dtype, on_x, layout="[E, I, H]", contiguous=True)
    check_tensor(op, "w_down", w_down, (e, h, i), weight_dtype, on_x, layout="[E, H, I]", contiguous=True)
    if out is not None:
        check_tensor(op, "out", out, (r, h), x.dtype, on_x, layout="[R, H]", contiguous=True)
    if scales is not None:
        for name, weight, block_scales in zip(("w_gate", "w_up", "w_down"), (w_gate, w_up, w_down), scales):
            check_block_scales(op, name, weight, block_scales, on_x)
        gate, up, _ = scales
        # stage 1 walks gate and up with one set of scale strides and one block_k
        if gate.scale_inv.shape != up.scale_inv.shape or gate.block_k != up.block_k:
            raise ValueError(f"{op}: w_gate and w_up scales must share a layout: scale_inv {list(gate.scale_inv.shape)} vs "
                             f"{list(up.scale_inv.shape)}, block_k {gate.block_k} vs {up.block_k}")


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, w_gate: torch.Tensor,
                w_up: torch.Tensor, w_down: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' weighted sum, per row, in ascending expert order -> [R, H] in x's dtype.

    out: an optional contiguous [R, H] buffer, filled and returned. x, expert_ids and
    expert_weights may be strided (made contiguous); the expert weights must be contiguous. No
    host synchronisation: ids are read on the device, so the call can be captured in a CUDA graph.
    """
    _check(x, expert_ids, expert_weights, w_gate, w_up, w_down, out)
    return _launch(x, expert_ids, expert_weights, w_gate, w_up, w_down, out, None)


def moe_experts_fp8(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, w_gate: torch.Tensor,
                    w_up: torch.Tensor, w_down: torch.Tensor, scales: ExpertScales, out: torch.Tensor | None = None) -> torch.Tensor:
    """`moe_experts` over float8_e4m3fn expert weights ([E, I, H], [E, I, H], [E, H, I]), each with
    its BlockScales (scale_inv [E, S, ceil(K / block_k)], scale_row over its N): every weight tile
    is dequantized in registers to x's dtype (kernels/linear_fp8.py's real weight) before the same
    fp32 products and sums as the bf16 path, so the result is moe_experts_ref over the
    dequantized weights up to summation order."""
    _check(x, expert_ids, expert_weights, w_gate, w_up, w_down, out, scales)
    return _launch(x, expert_ids, expert_weights, w_gate, w_up, w_down, out, scales)


def moe_experts_routed(x: torch.Tensor, routing: Routing, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                       scales: ExpertScales | None = None, out: torch.Tensor | None = None, *,
                       defer_combine: bool = False, prefill: bool = False) -> torch.Tensor | PendingCombine:
    """`moe_experts` (scales None) or `moe_experts_fp8` on a routing already grouped by expert:
    kernels/moe_route.py's `route` (a MoE layer's routing launch) or moe_grouped.group_pairs.
    routing.counts is left all zero, as the next routing needs it.
    defer_combine: with at least one row, the experts' outputs before their weighted sum
    (moe_grouped.PendingCombine, out unused), for kernels/norms.py's add_rms_norm to finish: the
    counts are zero again once it is finished.
    prefill: the rows are a prefill's (moe_grouped.PREFILL_LAUNCH for block-FP8 experts of many)."""
    _check(x, routing.ids, routing.weights, w_gate, w_up, w_down, out, scales)
    e_all = w_gate.shape[0]
    check_tensor("moe_experts", "routing.counts", routing.counts, (e_all,), torch.int32, ("x", x), layout="[E]", contiguous=True)
    check_tensor("moe_experts", "routing.lists", routing.lists, (e_all, max(x.shape[0], 1)), torch.int32, ("x", x), layout="[E, R]",
                 contiguous=True)
    check_launchable("moe_experts", "x", x)
    if out is None and not (defer_combine and x.shape[0]):
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    return grouped_experts(contiguous_aligned(x), routing, w_gate, w_up, w_down, out, scales, defer_combine=defer_combine,
                           prefill=prefill)


def _launch(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
            w_down: torch.Tensor, out: torch.Tensor | None, scales: ExpertScales | None) -> torch.Tensor:
    """The grouped kernels on checked arguments; scales None: the bf16/fp32 weights' path."""
    check_launchable("moe_experts", "x", x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    x, expert_ids, expert_weights = x.contiguous(), expert_ids.contiguous(), expert_weights.contiguous()
    return grouped_experts(x, group_pairs(expert_ids, expert_weights, w_gate.shape[0]), w_gate, w_up, w_down, out, scales)


def moe_experts_ref(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, w_gate: torch.Tensor,
                    w_up: torch.Tensor, w_down: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The formulas of DESIGN.md section 6, "The routed experts" in torch, one row at a time, experts in ascending id
    order; fp32 products through fp32 copies. Raises ValueError on ids outside [0, E) or repeated
    in a row (the kernel does not check them)."""
    _check(x, expert_ids, expert_weights, w_gate, w_up, w_down, out)
    dtype = x.dtype
    n_experts = w_gate.shape[0]
    result = torch.empty_like(x)
    for r in range(x.shape[0]):
        ids = expert_ids[r].tolist()
        if len(set(ids)) != len(ids) or not all(0 <= e < n_experts for e in ids):
            raise ValueError(f"moe_experts_ref: row {r} has expert ids {ids}; need distinct ids in [0, {n_experts})")
        x_r = x[r].float()  # [H]
        acc = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)  # [H]
        for t in sorted(range(len(ids)), key=lambda t: ids[t]):
            e = ids[t]
            g = w_gate[e].float() @ x_r  # [I]
            u = w_up[e].float() @ x_r  # [I]
            hidden = (g / (1.0 + torch.exp(-g)) * u).to(dtype)  # [I]
            y = w_down[e].float() @ hidden.float()  # [H]
            acc = acc + expert_weights[r, t] * y
        result[r] = acc.to(dtype)
    if out is None:
        return result
    return out.copy_(result)


def moe_experts_fp8_ref(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, w_gate: torch.Tensor,
                        w_up: torch.Tensor, w_down: torch.Tensor, scales: ExpertScales, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of `moe_experts_fp8`: `moe_experts_ref` over each weight dequantized to x's
    dtype by kernels/linear_fp8.dequantize_ref (what the CPU backend does once at load)."""
    _check(x, expert_ids, expert_weights, w_gate, w_up, w_down, out, scales)
    real = (dequantize_ref(w, s, x.dtype) for w, s in zip((w_gate, w_up, w_down), scales))
    return moe_experts_ref(x, expert_ids, expert_weights, *real, out)
