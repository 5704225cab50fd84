"""The dense MLP's SwiGLU: silu(gate) * up, from the fused gate | up projection.
The design in full: DESIGN.md section 6, "SwiGLU".
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
MAX_BLOCK_I = 1024  # columns per program: an intermediate of 6144 runs 6 programs per row


@triton.jit(do_not_specialize=["s_row"])
def _silu_mul_kernel(gate_up, out, s_row, I, BLOCK_I: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr, PDL: tl.constexpr):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_m = tl.program_id(0).to(tl.int64)  # the row; int64: rows * 2I can pass 2^31
    i_c = tl.program_id(1)
    DTYPE: tl.constexpr = out.dtype.element_ty
    o_c = i_c * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I] columns of the output
    m_c = o_c < I
    p_row = gate_up + i_m * s_row
    b_g = tl.load(p_row + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_u = tl.load(p_row + I + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_s = cast_rtne(tl.math.div_rn(b_g, 1.0 + tl.exp(-b_g)), DTYPE, EMULATE_BF16_RTNE).to(tl.float32)  # silu, rounded as torch
    tl.store(out + i_m * I + o_c, cast_rtne(b_s * b_u, DTYPE, EMULATE_BF16_RTNE), mask=m_c)


def swiglu_config(intermediate: int) -> tuple[int, int]:
    """(BLOCK_I, num_warps) for an intermediate size: a function of it alone, never of the row
    count; each thread holds at most 8 columns."""
    block_i = min(triton.next_power_of_2(intermediate), MAX_BLOCK_I)
    return block_i, min(4, max(1, block_i // 256))


def _check(gate_up: torch.Tensor, intermediate: int, out: torch.Tensor | None) -> None:
    op = "silu_mul"
    check_operand(op, "gate_up", gate_up, "[n, 2I]", DTYPES)
    check_launchable(op, "gate_up", gate_up)
    if intermediate < 1 or gate_up.shape[1] != 2 * intermediate:
        raise ValueError(f"{op}: gate_up must have 2 * intermediate = {2 * intermediate} columns, got shape {list(gate_up.shape)}")
    if gate_up.stride(1) != 1:
        raise ValueError(f"{op}: gate_up's features must be contiguous (stride 1), got strides {gate_up.stride()}")
    if out is not None:
        check_tensor(op, "out", out, (gate_up.shape[0], intermediate), gate_up.dtype, ("gate_up", gate_up), contiguous=True)


def silu_mul(gate_up: torch.Tensor, intermediate: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [n, 2I] -> [n, I] in its dtype: cast(cast(silu(gate32)) * up32). out: an optional
    contiguous [n, I] buffer, filled and returned."""
    _check(gate_up, intermediate, out)
    n = gate_up.shape[0]
    if out is None:
        out = torch.empty((n, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if n == 0:
        return out
    block_i, num_warps = swiglu_config(intermediate)
    _silu_mul_kernel[(n, triton.cdiv(intermediate, block_i))](
        gate_up, out, gate_up.stride(0), intermediate,
        BLOCK_I=block_i, EMULATE_BF16_RTNE=interpreting(),
        num_warps=num_warps, num_stages=1, enable_fp_fusion=False, **launch_options(gate_up.device),
    )
    return out


def silu_mul_ref(gate_up: torch.Tensor, intermediate: int, out: torch.Tensor | None = None) -> torch.Tensor:
    gate, up = gate_up.split(intermediate, dim=1)
    y = F.silu(gate) * up
    return y if out is None else out.copy_(y)
