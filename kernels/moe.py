"""The routed experts of a MoE layer, per row, with no host synchronisation (CUDA-graph capturable).

    x               [R, H]     fp32 or bf16: R rows (a decode or verify batch), H hidden features
    expert_ids      [R, T]     int64: each row's T = top_k experts, distinct, in [0, E), any order
    expert_weights  [R, T]     fp32: the routing weight of each (row, slot)
    w_gate, w_up    [E, I, H]  x's dtype, contiguous: E experts, I intermediate features
    w_down          [E, H, I]  x's dtype, contiguous
    out             [R, H]     x's dtype, contiguous

Per row r, its T (expert e, weight w) pairs visited in ASCENDING expert id order, with
cast = to x's dtype and every dot an fp32 sum of fp32 products:
    g = x_r . w_gate[e]^T,  u = x_r . w_up[e]^T              [I]
    h = cast(silu(g) * u),  silu(g) = g / (1 + exp(-g))       [I]   (the hidden in x's dtype)
    y = h . w_down[e]^T                                        [H]
    acc_r += w * y  (fp32, in ascending expert order);   out_r = cast(acc_r)
`moe_experts_ref` is this in torch, one row at a time; `moe_experts` runs it in two kernels.

Stage 1, `_moe_hidden_kernel`, grid (R * T, cdiv(I, BLOCK_I)): a program reads its (row, slot)'s
expert id from device memory and computes g and u for BLOCK_I hidden features: it walks H from 0
upward in BLOCK_H steps, accumulating w * x per lane in [BLOCK_I, BLOCK_H] fp32 blocks, and sums
the lanes once after the loop (one tl.sum over BLOCK_H). h goes to a scratch [R, T, I] in x's dtype.
Stage 2, `_moe_down_kernel`, grid (R, cdiv(H, BLOCK_H2)): a program holds its row's T ids in
registers and makes T passes, each picking the smallest id greater than the previous pass's
(the ascending order without a host sort); per expert it walks I from 0 upward in BLOCK_I2 steps
the same way, then adds w * y to an fp32 accumulator, and stores the row's block once.

The dots are broadcast-multiply-and-sum on one row, not tl.dot over a padded tile: a row's
arithmetic never sees another row (nothing to pad or mask), and a decode GEMV is bound by reading
the expert weights, not by FLOPs. bf16 tiles are upcast to fp32 before the multiply (bf16
products are exact in fp32), so the interpreter's bf16 tl.dot bug (see kernels/linear.py) never
arises; the interpreter's truncating fp32 -> bf16 cast is replaced by `cast_rtne`'s rounding on
the bits there (INTERPRET), as in every kernel.

Row invariance (DESIGN.md section 6): no row count reaches either kernel (the grids carry it,
each program finds its row from its program id), H, I and T are constexpr, the launch config is
a function of (H, I, dtype) only, and the row-side pointers (x, ids, weights, out) are not
specialised on alignment, so a row sliced out of a batch at any offset meets the same compiled
code. The expert weights keep their alignment specialisation (vectorised weight loads); it does
not depend on the rows. Each (row, slot)'s hidden and each row's output are computed by the same
instructions in the same order whatever else shares the launch, so op(x[:r]) == op(x)[:r] and a
row's bits do not depend on the order its expert ids are listed in.

Block-FP8 experts (`moe_experts_fp8`, from an FP8 checkpoint on the GPU): the weights are
float8_e4m3fn with kernels/linear_fp8.py's BlockScales per weight (scale_inv [E, S, ceil(K /
block_k)], scale_row over the weight's N). Each weight tile is dequantized in registers to x's
dtype by `dequantize_tile` (fp8 value x its block's scale in fp32, rounded once: the real weight
`dequantize_ref` gives the CPU backend) and then goes through the same fp32 products and sums as
above; the FP8 constexpr is False on the bf16/fp32 path, which compiles to the code it always had.

The ids are not checked on the device (that would synchronise): an id outside [0, E) reads out of
bounds, and a repeated id is visited once. The reference checks both. On a GPU fp32 products and
sums may contract to FMA and tl.exp is ex2.approx-based, so kernel and reference differ there by
a few fp32 ulps besides summation order; within one backend the bits are fixed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .checks import check_launchable, check_operand, check_tensor
from .linear_fp8 import FP8, BlockScales, check_block_scales, dequantize_ref, dequantize_tile
from .rounding import cast_rtne
from .runtime import interpreting

DTYPES = (torch.float32, torch.bfloat16)
MAX_TOP_K = 16  # the ids live in one register block; the supported families use top_k 8 or 10
NO_EXPERT = tl.constexpr(2**62)  # larger than any expert id: masked slots and "no id left"


class MoEConfig(NamedTuple):
    BLOCK_I: int  # stage 1: hidden features per program
    BLOCK_H: int  # stage 1: H step of the gate / up dots
    BLOCK_H2: int  # stage 2: output features per program
    BLOCK_I2: int  # stage 2: I step of the down dot
    num_warps: int


def moe_config(h: int, i: int, dtype: torch.dtype) -> MoEConfig:
    """The pinned launch config for experts of hidden size h and intermediate size i; never a
    function of the row count.

    Both stages stream expert weights: the step along the contiguous dim is 256 bytes per weight
    row (128 bf16 or 64 fp32), so 16 weight rows make a 4 KiB (bf16) tile per load, and each of
    the 4 warps' threads holds 16 fp32 lanes per accumulator. 16 features per program spreads a
    decode row over many SMs: Qwen3-Next (H 2048, I 512, top_k 10) gives 320 stage-1 programs and
    128 stage-2 programs per row. Small h or i shrink the blocks to the next power of two.
    Reasoned, not timed; changing them changes the CUDA backend's bits (another association of
    the sums) but never the row-invariance contract.
    """
    step = 128 if dtype == torch.bfloat16 else 64
    return MoEConfig(
        BLOCK_I=min(16, triton.next_power_of_2(i)),
        BLOCK_H=min(step, triton.next_power_of_2(h)),
        BLOCK_H2=min(16, triton.next_power_of_2(h)),
        BLOCK_I2=min(step, triton.next_power_of_2(i)),
        num_warps=4,
    )


@triton.jit(do_not_specialize_on_alignment=["x", "expert_ids"])
def _moe_hidden_kernel(
    x, expert_ids, w_gate, w_up, hidden,
    gate_scale, gate_scale_row, up_scale, up_scale_row,  # FP8 only (else unused)
    stride_se, stride_sn,  # FP8: scale_inv strides per expert and per scale row (gate's = up's)
    H: tl.constexpr,
    I: tl.constexpr,
    T: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FP8: tl.constexpr = False,
    SCALE_BLOCK_K: tl.constexpr = 1,
    ONE_SCALE_COLUMN: tl.constexpr = False,
):
    i_rt = tl.program_id(0).to(tl.int64)  # row * T + slot; int64: offsets below can pass 2^31
    i_i = tl.program_id(1)
    i_r = i_rt // T
    i_e = tl.load(expert_ids + i_rt)  # int64 expert id of this (row, slot)
    o_i = i_i * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I] hidden features
    o_h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    m_i = o_i < I
    p_x = x + i_r * H + o_h  # [BLOCK_H]
    o_w = i_e * (I * H) + o_i[:, None] * H + o_h[None, :]  # [BLOCK_I, BLOCK_H]: rows of w[e]
    p_g = w_gate + o_w
    p_u = w_up + o_w
    if FP8:  # [BLOCK_I, 1] offsets of each hidden feature's scale row in expert e's scales
        p_sg = i_e * stride_se + (tl.load(gate_scale_row + o_i, mask=m_i, other=0).to(tl.int64) * stride_sn)[:, None]
        p_su = i_e * stride_se + (tl.load(up_scale_row + o_i, mask=m_i, other=0).to(tl.int64) * stride_sn)[:, None]

    b_g = tl.zeros([BLOCK_I, BLOCK_H], dtype=tl.float32)  # per-lane partial dots
    b_u = tl.zeros([BLOCK_I, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        m_h = (h0 + o_h) < H
        m_w = m_i[:, None] & m_h[None, :]
        b_x = tl.load(p_x, mask=m_h, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_H]
        b_wg = tl.load(p_g, mask=m_w, other=0.0)
        b_wu = tl.load(p_u, mask=m_w, other=0.0)
        if FP8:  # the real weight in x's dtype, as dequantize_ref makes it
            o_hh = (h0 + o_h)[None, :]
            b_wg = dequantize_tile(b_wg, gate_scale, p_sg, m_i[:, None], h0, o_hh, m_w,
                                   SCALE_BLOCK_K, ONE_SCALE_COLUMN, x.dtype.element_ty, INTERPRET)
            b_wu = dequantize_tile(b_wu, up_scale, p_su, m_i[:, None], h0, o_hh, m_w,
                                   SCALE_BLOCK_K, ONE_SCALE_COLUMN, x.dtype.element_ty, INTERPRET)
        b_g += b_wg.to(tl.float32) * b_x
        b_u += b_wu.to(tl.float32) * b_x
        p_x += BLOCK_H
        p_g += BLOCK_H
        p_u += BLOCK_H
    b_gs = tl.sum(b_g, axis=1)  # [BLOCK_I] g
    b_us = tl.sum(b_u, axis=1)  # [BLOCK_I] u
    b_h = tl.math.div_rn(b_gs, 1.0 + tl.exp(-b_gs)) * b_us  # silu(g) * u as torch: g / (1 + exp(-g))
    tl.store(hidden + i_rt * I + o_i, cast_rtne(b_h, hidden.dtype.element_ty, INTERPRET), mask=m_i)


@triton.jit(do_not_specialize_on_alignment=["expert_ids", "expert_weights", "out"])
def _moe_down_kernel(
    hidden, expert_ids, expert_weights, w_down, out,
    down_scale, down_scale_row,  # FP8 only (else unused)
    stride_se, stride_sn,  # FP8: scale_inv strides per expert and per scale row
    H: tl.constexpr,
    I: tl.constexpr,
    T: tl.constexpr,
    BLOCK_T: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_I: tl.constexpr,
    FP8: tl.constexpr = False,
    SCALE_BLOCK_K: tl.constexpr = 1,
    ONE_SCALE_COLUMN: tl.constexpr = False,
):
    i_r = tl.program_id(0).to(tl.int64)  # the row
    i_h = tl.program_id(1)
    o_t = tl.arange(0, BLOCK_T)  # [BLOCK_T] slots
    b_ids = tl.load(expert_ids + i_r * T + o_t, mask=o_t < T, other=NO_EXPERT)  # [BLOCK_T] int64
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] output features
    o_i = tl.arange(0, BLOCK_I)  # [BLOCK_I]
    m_h = o_h < H
    if FP8:  # [BLOCK_H, 1] offsets of each output feature's scale row (within an expert's scales)
        p_srow = (tl.load(down_scale_row + o_h, mask=m_h, other=0).to(tl.int64) * stride_sn)[:, None]

    b_out = tl.zeros([BLOCK_H], dtype=tl.float32)
    i_prev = tl.full([], -1, dtype=tl.int64)
    for _ in range(T):
        # the next expert in ascending id order, and the slot that lists it
        i_e = tl.min(tl.where(b_ids > i_prev, b_ids, NO_EXPERT), axis=0)
        i_t = tl.min(tl.where(b_ids == i_e, o_t, BLOCK_T), axis=0)
        b_w = tl.load(expert_weights + i_r * T + i_t)  # fp32 routing weight
        p_hid = hidden + (i_r * T + i_t) * I + o_i  # [BLOCK_I]
        p_w = w_down + i_e * (H * I) + o_h[:, None] * I + o_i[None, :]  # [BLOCK_H, BLOCK_I]: rows of w_down[e]
        b_y = tl.zeros([BLOCK_H, BLOCK_I], dtype=tl.float32)  # per-lane partial dots
        for i0 in range(0, I, BLOCK_I):
            m_i = (i0 + o_i) < I
            b_hid = tl.load(p_hid, mask=m_i, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_I]
            m_w = m_h[:, None] & m_i[None, :]
            b_wd = tl.load(p_w, mask=m_w, other=0.0)
            if FP8:
                b_wd = dequantize_tile(b_wd, down_scale, i_e * stride_se + p_srow, m_h[:, None], i0, (i0 + o_i)[None, :], m_w,
                                       SCALE_BLOCK_K, ONE_SCALE_COLUMN, hidden.dtype.element_ty, INTERPRET)
            b_y += b_wd.to(tl.float32) * b_hid
            p_hid += BLOCK_I
            p_w += BLOCK_I
        b_out += b_w * tl.sum(b_y, axis=1)
        i_prev = i_e
    tl.store(out + i_r * H + o_h, cast_rtne(b_out, out.dtype.element_ty, INTERPRET), mask=m_h)


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


def _launch(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
            w_down: torch.Tensor, out: torch.Tensor | None, scales: ExpertScales | None) -> torch.Tensor:
    """Both stages, on checked arguments; scales None: the bf16/fp32 weights' path."""
    check_launchable("moe_experts", "x", x)
    r, h = x.shape
    t = expert_ids.shape[1]
    i = w_gate.shape[1]
    if out is None:
        out = torch.empty((r, h), dtype=x.dtype, device=x.device)
    if r == 0:
        return out
    x, expert_ids, expert_weights = x.contiguous(), expert_ids.contiguous(), expert_weights.contiguous()
    hidden = torch.empty((r, t, i), dtype=x.dtype, device=x.device)  # [R, T, I] h per (row, slot)
    cfg = moe_config(h, i, x.dtype)
    # scale pointers, strides and flags per stage (unused placeholders on the bf16/fp32 path)
    hidden_fp8, down_fp8 = (x, x, x, x, 0, 0), (x, x, 0, 0)
    hidden_flags, down_flags = {}, {}
    if scales is not None:
        gate, up, down = scales
        hidden_fp8 = (gate.scale_inv, gate.scale_row, up.scale_inv, up.scale_row, gate.scale_inv.stride(0), gate.scale_inv.stride(1))
        down_fp8 = (down.scale_inv, down.scale_row, down.scale_inv.stride(0), down.scale_inv.stride(1))
        hidden_flags = dict(FP8=True, SCALE_BLOCK_K=gate.block_k, ONE_SCALE_COLUMN=gate.block_k % cfg.BLOCK_H == 0)
        down_flags = dict(FP8=True, SCALE_BLOCK_K=down.block_k, ONE_SCALE_COLUMN=down.block_k % cfg.BLOCK_I2 == 0)
    _moe_hidden_kernel[(r * t, triton.cdiv(i, cfg.BLOCK_I))](
        x, expert_ids, w_gate, w_up, hidden, *hidden_fp8,
        H=h, I=i, T=t,
        INTERPRET=interpreting(),
        BLOCK_I=cfg.BLOCK_I,
        BLOCK_H=cfg.BLOCK_H,
        num_warps=cfg.num_warps,
        **hidden_flags,
    )
    _moe_down_kernel[(r, triton.cdiv(h, cfg.BLOCK_H2))](
        hidden, expert_ids, expert_weights, w_down, out, *down_fp8,
        H=h, I=i, T=t,
        BLOCK_T=triton.next_power_of_2(t),
        INTERPRET=interpreting(),
        BLOCK_H=cfg.BLOCK_H2,
        BLOCK_I=cfg.BLOCK_I2,
        num_warps=cfg.num_warps,
        **down_flags,
    )
    return out


def moe_experts_ref(x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor, w_gate: torch.Tensor,
                    w_up: torch.Tensor, w_down: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The formulas of the module docstring in torch, one row at a time, experts in ascending id
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
