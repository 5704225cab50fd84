"""Gated DeltaNet's per-head gates: the decay and the write strength beta of every row.
The design in full: DESIGN.md section 6, "Gated DeltaNet's gates".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .checks import check_launchable, check_operand, check_tensor
from .dependent_launch import after_previous, launch_options
from .rounding import cast_rtne
from .runtime import interpreting

DTYPES = (torch.float32, torch.bfloat16)
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's F.softplus default: above it softplus(x) = x


@triton.jit
def _softplus(b_x):
    """fp32 block -> torch's softplus (beta 1, threshold 20); NaN stays NaN."""
    b_big = b_x > SOFTPLUS_THRESHOLD
    b_e = tl.exp(tl.where(b_big, 0.0, b_x))  # exp only where it is used: no overflow above the threshold
    b_u = 1.0 + b_e
    b_tiny = b_u == 1.0  # e below half an ulp of 1: log1p(e) = e
    b_log1p = tl.log(b_u) * tl.math.div_rn(b_e, tl.where(b_tiny, 1.0, b_u - 1.0))
    return tl.where(b_big, b_x, tl.where(b_tiny, b_e, b_log1p))


@triton.jit(do_not_specialize=["s_b_row", "s_a_row"])
def _gdn_gates_kernel(
    b, a, A_log, dt_bias, decay, beta,
    s_b_row, s_a_row,
    HV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr,
    PDL: tl.constexpr,
):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_m = tl.program_id(0).to(tl.int64)  # the row
    o_h = tl.arange(0, BLOCK_H)  # [BLOCK_H] value heads
    gate_heads(b, a, A_log, dt_bias, decay, beta, i_m, s_b_row, s_a_row, o_h, o_h < HV, HV, EMULATE_BF16_RTNE,
               0, 0, b.dtype.element_ty)


@triton.jit
def _gate_input(p, i_m, s_row, o_h, m_h, SPLITS: tl.constexpr, s_split, DTYPE: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr):
    """Row i_m's gate input columns o_h as fp32: loaded, or (SPLITS > 0) the split-K sums of the GEMM
    that makes them, added in ascending split order and rounded once to DTYPE, as the split's reduce
    (kernels/linear.py's reduce_splits_kernel) would have stored them."""
    if SPLITS == 0:
        return tl.load(p + i_m * s_row + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_x = tl.load(p + i_m * s_row + o_h, mask=m_h, other=0.0)
    for i_s in range(1, SPLITS):  # ascending, fixed
        b_x += tl.load(p + i_s * s_split + i_m * s_row + o_h, mask=m_h, other=0.0)
    return cast_rtne(b_x, DTYPE, EMULATE_BF16_RTNE).to(tl.float32)


@triton.jit
def gate_heads(b, a, A_log, dt_bias, decay, beta, i_m, s_b_row, s_a_row, o_h, m_h, HV: tl.constexpr,
               EMULATE_BF16_RTNE: tl.constexpr, SPLITS: tl.constexpr, s_split, DTYPE: tl.constexpr):
    """Row i_m's decay and beta for the value heads o_h (mask m_h), each element computed alone:
    the one formula of _gdn_gates_kernel and of kernels/gdn_heads.py's head split with its gates
    (`gdn_heads(..., gates=...)`), so both give the same bits whatever heads a program takes.
    DTYPE: the gate inputs' dtype; SPLITS > 0: b and a point into their GEMM's unfinished split-K
    sums (kernels/linear.py's SplitSums, s_split apart), which `_gate_input` finishes."""
    b_b = _gate_input(b, i_m, s_b_row, o_h, m_h, SPLITS, s_split, DTYPE, EMULATE_BF16_RTNE)
    b_sig = tl.math.div_rn(1.0, 1.0 + tl.exp(-b_b))
    b_beta = cast_rtne(b_sig, DTYPE, EMULATE_BF16_RTNE).to(tl.float32)  # sigmoid runs in the inputs' dtype
    b_x = (_gate_input(a, i_m, s_a_row, o_h, m_h, SPLITS, s_split, DTYPE, EMULATE_BF16_RTNE)
           + tl.load(dt_bias + o_h, mask=m_h, other=0.0).to(tl.float32))
    b_A = tl.exp(tl.load(A_log + o_h, mask=m_h, other=0.0).to(tl.float32))
    b_decay = tl.exp(-b_A * _softplus(b_x))
    tl.store(decay + i_m * HV + o_h, b_decay, mask=m_h)
    tl.store(beta + i_m * HV + o_h, b_beta, mask=m_h)


def check_gates(b, a, A_log, dt_bias, out, op: str = "gdn_gates") -> None:
    """The gates' operands (and an optional (decay, beta) out pair), for `op`'s errors."""
    check_operand(op, "b", b, "[n, Hv]", DTYPES)
    check_launchable(op, "b", b)
    n, hv = b.shape
    on_b = ("b", b)
    check_tensor(op, "a", a, (n, hv), b.dtype, on_b)
    check_tensor(op, "A_log", A_log, (hv,), DTYPES, on_b)
    check_tensor(op, "dt_bias", dt_bias, (hv,), DTYPES, on_b)
    for name, t in (("b", b), ("a", a)):
        if hv > 1 and t.stride(1) != 1:
            raise ValueError(f"{op}: {name}'s heads must be contiguous (stride 1), got strides {t.stride()}")
    if out is not None:
        if not isinstance(out, tuple) or len(out) != 2:
            raise ValueError(f"{op}: out must be a (decay, beta) tuple, got {type(out).__name__}")
        check_tensor(op, "decay", out[0], (n, hv, 1), torch.float32, on_b, contiguous=True)
        check_tensor(op, "beta", out[1], (n, hv), torch.float32, on_b, contiguous=True)


def gdn_gates(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (decay [n, Hv, 1] fp32, beta [n, Hv] fp32). out: an optional (decay, beta) pair of
    contiguous buffers, filled and returned."""
    check_gates(b, a, A_log, dt_bias, out)
    n, hv = b.shape
    if out is None:
        out = (torch.empty((n, hv, 1), dtype=torch.float32, device=b.device), torch.empty((n, hv), dtype=torch.float32, device=b.device))
    if n == 0:
        return out
    _gdn_gates_kernel[(n,)](
        b, a, A_log.contiguous(), dt_bias.contiguous(), out[0], out[1],
        b.stride(0), a.stride(0),
        HV=hv, BLOCK_H=triton.next_power_of_2(hv), EMULATE_BF16_RTNE=interpreting(),
        num_warps=1, num_stages=1, enable_fp_fusion=False, **launch_options(b.device),
    )
    return out


def gdn_gates_ref(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    beta = torch.sigmoid(b).float()
    log_decay = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    decay = log_decay.exp()[..., None]
    if out is None:
        return decay, beta
    return out[0].copy_(decay), out[1].copy_(beta)
