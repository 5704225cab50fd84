"""Gated DeltaNet's head split: the conv output of every row -> normalised queries and keys, one
copy per value head, and the values, all fp32.
The design in full: DESIGN.md section 6, "Gated DeltaNet's head split".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_launchable, check_operand, check_tensor, contiguous_aligned
from .dependent_launch import after_previous, launch_options
from .gdn_gates import check_gates, gate_heads, gdn_gates_ref
from .linear import SplitSums
from .norms import ALIGN, L2_RSQRT, MAX_BLOCK_D, normalise_block, l2norm_ref
from .rounding import TL_DTYPES
from .runtime import interpreting

DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _l2norm_rsqrt(b_x, m_d, D: tl.constexpr):
    """fp32 head [BLOCK_D] (zero past D) -> x * rsqrt(sum(x^2) + 1e-6), as norms.l2norm computes a row."""
    return normalise_block(b_x, tl.sum(b_x * b_x, axis=0), b_x, b_x, m_d, D, 0.0, L2_RSQRT, tl.float32, False)


# Rows a program of a launch of many rows takes, one after the other, each with a one-row
# program's code (so the same bits): a prefill's 2,048-row chunk is otherwise 2,048 x Hk one-warp
# programs of a few loads and stores each. 1: a program a row, as every step's launch
# (`python -m bench.prefill --heads-rows N`).
HEADS_ROWS_PER_PROGRAM = 1
HEADS_MANY_ROWS = 1024  # launches from this many rows take HEADS_ROWS_PER_PROGRAM rows a program


def rows_per_program(rows: int) -> int:
    """Rows a program of a launch over `rows` rows takes (HEADS_ROWS_PER_PROGRAM from HEADS_MANY_ROWS rows, else 1)."""
    return HEADS_ROWS_PER_PROGRAM if rows >= HEADS_MANY_ROWS else 1


# gate row and split strides are not specialised on (a one-row tensor may carry any), as in gdn_gates
@triton.jit(do_not_specialize=["s_b_row", "s_a_row", "s_split", "n_rows"])
def _gdn_heads_kernel(
    mixed, q, k, v,
    q_scale,
    b, a, A_log, dt_bias, decay, beta, s_b_row, s_a_row, s_split,  # HAS_GATES only (else stand-ins)
    n_rows,
    HK: tl.constexpr, R: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_GATES: tl.constexpr, GATE_SPLITS: tl.constexpr, GATE_DTYPE: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr,
    ROWS: tl.constexpr, PDL: tl.constexpr,
):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_g = tl.program_id(1)  # the key head
    if ROWS == 1:  # a program a row
        _split_row(mixed, q, k, v, q_scale, b, a, A_log, dt_bias, decay, beta, s_b_row, s_a_row, s_split,
                   tl.program_id(0).to(tl.int64), i_g, HK, R, D_K, D_V, BLOCK_R, BLOCK_DK, BLOCK_DV,
                   HAS_GATES, GATE_SPLITS, GATE_DTYPE, EMULATE_BF16_RTNE)
    else:  # ROWS rows in turn, each as a one-row program computes it
        i_first = tl.program_id(0).to(tl.int64) * ROWS
        for i_r in range(ROWS):
            if i_first + i_r < n_rows:
                _split_row(mixed, q, k, v, q_scale, b, a, A_log, dt_bias, decay, beta, s_b_row, s_a_row, s_split,
                           i_first + i_r, i_g, HK, R, D_K, D_V, BLOCK_R, BLOCK_DK, BLOCK_DV,
                           HAS_GATES, GATE_SPLITS, GATE_DTYPE, EMULATE_BF16_RTNE)


@triton.jit
def _split_row(mixed, q, k, v, q_scale, b, a, A_log, dt_bias, decay, beta, s_b_row, s_a_row, s_split, i_m, i_g,
               HK: tl.constexpr, R: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
               HAS_GATES: tl.constexpr, GATE_SPLITS: tl.constexpr, GATE_DTYPE: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr):
    """Row i_m's split for key head i_g: its normalised q and k copied to the key head's value heads,
    its values widened, and (HAS_GATES) its gates."""
    HV: tl.constexpr = HK * R
    o_r = tl.arange(0, BLOCK_R)
    o_dk = tl.arange(0, BLOCK_DK)
    o_dv = tl.arange(0, BLOCK_DV)
    m_r, m_dk, m_dv = o_r < R, o_dk < D_K, o_dv < D_V
    o_h = i_g * R + o_r  # [BLOCK_R] the value heads reading this key head
    p_row = mixed + i_m * (2 * HK * D_K + HV * D_V)

    b_q = tl.load(p_row + i_g * D_K + o_dk, mask=m_dk, other=0.0).to(tl.float32)  # [BLOCK_DK]
    b_k = tl.load(p_row + (HK + i_g) * D_K + o_dk, mask=m_dk, other=0.0).to(tl.float32)
    b_q = tl.math.div_rn(_l2norm_rsqrt(b_q, m_dk, D_K), q_scale)
    b_k = _l2norm_rsqrt(b_k, m_dk, D_K)
    m_qk = m_r[:, None] & m_dk[None, :]
    o_qk = i_m * HV * D_K + o_h[:, None] * D_K + o_dk[None, :]  # [BLOCK_R, BLOCK_DK]
    tl.store(q + o_qk, tl.broadcast_to(b_q[None, :], (BLOCK_R, BLOCK_DK)), mask=m_qk)
    tl.store(k + o_qk, tl.broadcast_to(b_k[None, :], (BLOCK_R, BLOCK_DK)), mask=m_qk)

    m_v = m_r[:, None] & m_dv[None, :]
    b_v = tl.load(p_row + 2 * HK * D_K + o_h[:, None] * D_V + o_dv[None, :], mask=m_v, other=0.0)  # [BLOCK_R, BLOCK_DV]
    tl.store(v + i_m * HV * D_V + o_h[:, None] * D_V + o_dv[None, :], b_v.to(tl.float32), mask=m_v)
    if HAS_GATES:  # this row's decay and beta of the same value heads
        gate_heads(b, a, A_log, dt_bias, decay, beta, i_m, s_b_row, s_a_row, o_h, m_r, HV, EMULATE_BF16_RTNE,
                   GATE_SPLITS, s_split, GATE_DTYPE)


def heads_config(r: int, d_k: int, d_v: int) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_DK, BLOCK_DV, num_warps): functions of the head sizes alone, never of the
    row count; a thread holds at most 8 elements of the [r, d_v] value tile."""
    block_r, block_dv = triton.next_power_of_2(r), triton.next_power_of_2(d_v)
    return block_r, triton.next_power_of_2(d_k), block_dv, min(4, max(1, block_r * block_dv // 256))


def _check(mixed, n_k_heads, n_v_heads, d_k, d_v, out) -> None:
    op = "gdn_heads"
    if min(n_k_heads, n_v_heads, d_k, d_v) < 1 or n_v_heads % n_k_heads:
        raise ValueError(f"{op}: n_v_heads ({n_v_heads}) must be a positive multiple of n_k_heads ({n_k_heads}), d_k ({d_k}) and d_v ({d_v}) positive")
    if d_k > MAX_BLOCK_D:
        raise ValueError(f"{op}: d_k ({d_k}) over {MAX_BLOCK_D}: a key head must fit one register block")
    layout = "[n, 2*Hk*d_k + Hv*d_v]"
    check_operand(op, "mixed", mixed, layout, DTYPES)
    width = 2 * n_k_heads * d_k + n_v_heads * d_v
    if mixed.shape[1] != width:
        raise ValueError(f"{op}: mixed must be {layout[:-1]} = {width}], got shape {list(mixed.shape)}")
    check_launchable(op, "mixed", mixed)
    if out is None:
        return
    if not isinstance(out, tuple) or len(out) != 3:
        raise ValueError(f"{op}: out must be a (q, k, v) tuple, got {type(out).__name__}")
    n = mixed.shape[0]
    for name, t, shape in zip("qkv", out, ((n, n_v_heads, d_k), (n, n_v_heads, d_k), (n, n_v_heads, d_v))):
        check_tensor(op, name, t, shape, torch.float32, ("mixed", mixed))
        if not t.is_contiguous() or t.data_ptr() % ALIGN:
            raise ValueError(f"{op}: {name} must be contiguous and start {ALIGN}-byte aligned, got strides {t.stride()}")


def gdn_heads(mixed: torch.Tensor, n_k_heads: int, n_v_heads: int, d_k: int, d_v: int,
              out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              gates: tuple[torch.Tensor | SplitSums, torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None,
              rows: int | None = None) -> tuple[torch.Tensor, ...]:
    """-> (q, k [n, Hv, d_k], v [n, Hv, d_v]), fp32. out: an optional (q, k, v) triple of
    contiguous aligned buffers, filled and returned.
    gates: GatedDeltaNet's (b, a, A_log, dt_bias) as kernels/gdn_gates.py takes them: the same
    programs then also compute each row's gates, returned after v as (decay [n, Hv, 1], beta [n, Hv])
    fp32, bitwise gdn_gates' (its formula, each element alone): one launch where they were two
    (18 a step of the 2B model). b may instead be the unfinished split-K sums of the GEMM whose
    columns are b | a (kernels/linear.py's SplitSums, [n, 2 Hv], no bias), with a None: each
    program finishes its own columns as the split's reduce would, the bits of the finished b and a,
    one launch fewer.
    rows: rows a program takes (None: rows_per_program's); the same bits for any."""
    _check(mixed, n_k_heads, n_v_heads, d_k, d_v, out)
    if rows is not None and rows < 1:
        raise ValueError(f"gdn_heads: rows a program must be at least 1, got {rows}")
    n = mixed.shape[0]
    if out is None:
        empty = lambda d: torch.empty((n, n_v_heads, d), dtype=torch.float32, device=mixed.device)  # noqa: E731
        out = (empty(d_k), empty(d_k), empty(d_v))
    gate_out = ()
    splits, s_split, gate_dtype = 0, 0, mixed.dtype
    if gates is not None:
        b, a, A_log, dt_bias = gates
        if isinstance(b, SplitSums):
            b, a, splits, s_split, gate_dtype = _split_gate_sums(b, a, n, n_v_heads)
        else:
            gate_dtype = b.dtype
        check_gates(b, a, A_log, dt_bias, None, op="gdn_heads")
        if b.shape != (n, n_v_heads):
            raise ValueError(f"gdn_heads: the gates' b must be [n, Hv] = {[n, n_v_heads]}, got {list(b.shape)}")
        gate_out = (torch.empty((n, n_v_heads, 1), dtype=torch.float32, device=mixed.device),
                    torch.empty((n, n_v_heads), dtype=torch.float32, device=mixed.device))
    if n == 0:
        return (*out, *gate_out)
    r = n_v_heads // n_k_heads
    block_r, block_dk, block_dv, num_warps = heads_config(r, d_k, d_v)
    stand_in = out[0]
    gate_args = ((b, a, A_log.contiguous(), dt_bias.contiguous(), *gate_out, b.stride(0), a.stride(0), s_split) if gates is not None
                 else (stand_in,) * 6 + (0, 0, 0))
    rows = rows_per_program(n) if rows is None else rows
    _gdn_heads_kernel[(triton.cdiv(n, rows), n_k_heads)](
        contiguous_aligned(mixed), *out,
        d_k**0.5,  # passed as fp32: the reference divides by the python float cast to fp32
        *gate_args, n,
        HK=n_k_heads, R=r, D_K=d_k, D_V=d_v,
        BLOCK_R=block_r, BLOCK_DK=block_dk, BLOCK_DV=block_dv,
        HAS_GATES=gates is not None, GATE_SPLITS=splits, GATE_DTYPE=TL_DTYPES[gate_dtype], EMULATE_BF16_RTNE=interpreting(),
        ROWS=rows, num_warps=num_warps, num_stages=1, enable_fp_fusion=False, **launch_options(mixed.device),
    )
    return (*out, *gate_out)


def _split_gate_sums(sums: SplitSums, a: torch.Tensor | None, n: int, n_v_heads: int):
    """The b | a GEMM's SplitSums -> (b, a: fp32 [n, Hv] views of split 0's columns, splits, the
    split stride, the dtype the finished sums round to)."""
    partial = sums.partial
    if a is not None:
        raise ValueError("gdn_heads: with the b | a GEMM's split sums in place of b, a must be None")
    if sums.bias is not None:
        raise ValueError("gdn_heads: the b | a GEMM's split sums must have no bias")
    if partial.dim() != 3 or tuple(partial.shape[1:]) != (n, 2 * n_v_heads) or partial.dtype != torch.float32 \
            or not partial.is_contiguous():
        raise ValueError(f"gdn_heads: the b | a split sums must be contiguous fp32 [splits, n, 2 Hv] = [*, {n}, {2 * n_v_heads}], "
                         f"got {partial.dtype} {list(partial.shape)}")
    return partial[0, :, :n_v_heads], partial[0, :, n_v_heads:], partial.shape[0], partial.stride(0), sums.dtype


def gdn_heads_ref(mixed: torch.Tensor, n_k_heads: int, n_v_heads: int, d_k: int, d_v: int,
                  out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  gates: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    heads = _heads_ref(mixed, n_k_heads, n_v_heads, d_k, d_v, out)
    return heads if gates is None else (*heads, *gdn_gates_ref(*gates))


def _heads_ref(mixed, n_k_heads, n_v_heads, d_k, d_v, out):
    n, r, key_dim = mixed.shape[0], n_v_heads // n_k_heads, n_k_heads * d_k
    q = mixed[:, :key_dim].reshape(n, n_k_heads, d_k).float()
    k = mixed[:, key_dim : 2 * key_dim].reshape(n, n_k_heads, d_k).float()
    v = mixed[:, 2 * key_dim :].reshape(n, n_v_heads, d_v).float()
    q = _l2norm_heads(q.repeat_interleave(r, dim=1)) / (d_k**0.5)
    k = _l2norm_heads(k.repeat_interleave(r, dim=1))
    if out is None:
        return q, k, v
    return out[0].copy_(q), out[1].copy_(k), out[2].copy_(v)


def _l2norm_heads(x: torch.Tensor) -> torch.Tensor:
    """[n, heads, d] -> l2norm "rsqrt" over d, as [n * heads, d] rows (verifier.model.ops.l2norm)."""
    return l2norm_ref(x.reshape(-1, x.shape[-1]), "rsqrt").reshape(x.shape)
