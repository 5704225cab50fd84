"""Row-invariant W8A16 GEMM over block-FP8 weights: the projections of a block-FP8 checkpoint.
The design in full: DESIGN.md section 6, "The block-FP8 GEMM".
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .checks import check_contiguous, check_launchable, check_operand, check_tensor, contiguous_aligned
from .dependent_launch import after_previous, launch_options
from .linear import (REDUCE_BLOCK_N, LinearConfig, SplitSums, dot_acc, reduce_splits_kernel, store_tile, tile_start, linear,
                     linear_config, linear_ref, split_bounds, split_for)
from .rounding import TL_DTYPES, cast_rtne
from .runtime import interpreting

DTYPES = (torch.float32, torch.bfloat16)
FP8 = torch.float8_e4m3fn
FP8_BLOCK_M = 64  # the one-tile kernel's rows per tile (one wgmma warpgroup tile): fp32, and a caller's config
ROWS_TILE, ROWS_TILE_FEATURES = 16, 64  # bf16, few rows: rows (the MMA's N) and weight features (its M) a tile
ROWS_WARPS, ROWS_STAGES = 4, 4  # its launch: warps and pipeline stages
DEQUANTIZED_ROWS = 64  # bf16, from this many rows: the real weight made once, then the bf16 GEMM
# bf16: split K until about this many few-rows programs run (64 weight features each), or None for
# the bf16 GEMM's walk of the shape (`fp8_config`)
FP8_TARGET_PROGRAMS: int | None = None
# The scale-after walk for dense bf16 GEMMs where the shape allows (`scale_after_dense`): each K
# step's fp32 sum over raw weights (`raw_bf16`) times its block scale, the few-rows kernel making
# the raw tile in registers, the many-rows kernel (`_linear_raw_kernel`) reading the raw weight
# (`raw_weight`, kept by the caller). False: every weight is dequantized (rule 11's real weight).
# Off: in the engine on an H100 the few-rows kernel took the same time either way and the raw
# many-rows kernel several times the TMA path's (DESIGN.md section 6, rule 11).
SCALE_AFTER_ON = False
RAW_TILES = ((128, 128, 128, 8, 3), (64, 64, 128, 4, 4))  # many rows: (from rows, BLOCK_M, BLOCK_N, warps, stages)


class BlockScales(NamedTuple):
    """How a float8_e4m3fn weight [..., N, K] maps to its real values (DESIGN.md section 6, "The block-FP8 GEMM")."""

    scale_inv: torch.Tensor  # fp32 [..., S, ceil(K / block_k)]
    scale_row: torch.Tensor  # int32 [N]: the scale_inv row of each weight row
    block_k: int  # columns per scale block


def standard_scale_row(n: int, block_n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """scale_row of a weight as a checkpoint stores it: row n uses scale row n // block_n. -> int32 [n]"""
    return (torch.arange(n, device=device) // block_n).to(torch.int32)


@triton.jit
def dequantize_tile(b_w8, scale_inv, p_srow, m_srow, k0, o_kk, m_w,
                    SCALE_BLOCK_K: tl.constexpr, ONE_SCALE_COLUMN: tl.constexpr, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """An fp8 weight tile -> its real values in DTYPE: cast(fp32(w) * scale), the cast rounding to nearest even.

    p_srow: offsets of the tile's rows' scale rows in scale_inv (scale row * its stride), shaped to
    broadcast along the tile's K axis; m_srow: their mask. k0: the tile's first column; o_kk: the
    tile's columns, shaped to broadcast along its N axis; m_w: the tile's mask. ONE_SCALE_COLUMN:
    the tile lies in one block column (block_k is a multiple of the K step and k0 of block_k's
    grid), so one scale per weight row."""
    if ONE_SCALE_COLUMN:
        if m_srow is None:
            b_s = tl.load(scale_inv + p_srow + k0 // SCALE_BLOCK_K)
        else:
            b_s = tl.load(scale_inv + p_srow + k0 // SCALE_BLOCK_K, mask=m_srow, other=0.0)
    elif m_w is None:
        b_s = tl.load(scale_inv + p_srow + o_kk // SCALE_BLOCK_K)
    else:
        b_s = tl.load(scale_inv + p_srow + o_kk // SCALE_BLOCK_K, mask=m_w, other=0.0)
    return cast_rtne(b_w8.to(tl.float32) * b_s, DTYPE, INTERPRET)


SCALE_UP = tl.constexpr(2.0**120)  # the factor `raw_bf16` leaves out of every weight, exact in fp32


@triton.jit
def raw_bf16(b_w8, INTERPRET: tl.constexpr):
    """An fp8 e4m3 tile -> bf16 of the value w * 2^-120, exactly, subnormals included: the sign bit,
    then the seven magnitude bits under bf16's exponent field (e4m3's bias 7 against bf16's 127).
    The two NaN encodings, which no quantizer writes, read as +-480 * 2^-120.
    On the GPU two bytes a `prmt` (each sign-extended to a half), a shift and a mask: about 1.5
    instructions a weight where dequantizing takes about 3.5 (unpack, widen, scale, pack, load)."""
    b_i8 = b_w8.to(tl.int8, bitcast=True)
    if INTERPRET:
        b_h = (b_i8.to(tl.int16) << 4) & tl.full([], -30736, tl.int16)  # 0x87F0
        return b_h.to(tl.bfloat16, bitcast=True)
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1;
        prmt.b32 t0, $2, 0, 0x9180;
        prmt.b32 t1, $2, 0, 0xB3A2;
        shl.b32 t0, t0, 4;
        shl.b32 t1, t1, 4;
        and.b32 $0, t0, 0x87F087F0;
        and.b32 $1, t1, 0x87F087F0;
        }""",
        constraints="=r,=r,r", args=[b_i8], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def scale_step(b_acc, b_d, b_s):
    """b_acc + a K step's fp32 sum over raw weights (`raw_bf16`), times 2^120, times its block
    scale: the one accumulate step of every scale-after walk (the experts' stages, the dense GEMMs'
    few-rows and many-rows kernels), so every kernel rounds it alike. Times 2^120 first (exact: a
    power of two, giving the step's sum over the fp8 values themselves), then the scale: a product
    overflows only where the real weights' would."""
    return b_acc + (b_d * SCALE_UP) * b_s


@triton.jit
def scale_row_offsets(scale_row, o_n, m_n, stride_sn):
    """[1, BLOCK_N] offsets in scale_inv of the scale rows of weight rows o_n [BLOCK_N] (mask m_n):
    `dequantize_tile`'s p_srow, read once per program."""
    return (tl.load(scale_row + o_n, mask=m_n, other=0).to(tl.int64) * stride_sn)[None, :]


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_om"], do_not_specialize_on_alignment=["x", "out"])
def _linear_fp8_kernel(
    x, weight, scale_inv, scale_row, bias, out, partial,
    M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_om,
    SCALE_BLOCK_K: tl.constexpr,
    ONE_SCALE_COLUMN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """kernels/linear.py's _linear_kernel (its tile, K walk and store) with each weight tile
    dequantized in registers before its dot."""
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_s, o_m, o_n, o_k, m_m, m_n, k_start, k_end, p_x, p_w = tile_start(
        x, weight, M, N, K, K_SPLIT, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
    p_srow = scale_row_offsets(scale_row, o_n, m_n, stride_sn)

    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        m_k = (k0 + o_k) < k_end
        m_w = m_k[:, None] & m_n[None, :]
        b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w8 = tl.load(p_w, mask=m_w, other=0.0)  # fp8 [BLOCK_K, BLOCK_N]
        b_w = dequantize_tile(b_w8, scale_inv, p_srow, m_n[None, :], k0, (k0 + o_k)[:, None], m_w,
                              SCALE_BLOCK_K, ONE_SCALE_COLUMN, x.dtype.element_ty, INTERPRET)
        b_acc = dot_acc(b_x, b_w, b_acc, INTERPRET)
        p_x += BLOCK_K
        p_w += BLOCK_K

    # out is in x's dtype (checked): rounded once to it; a split's partial is left to reduce_splits_kernel
    store_tile(b_acc, bias, out, partial, o_m, o_n, i_s, M, N, stride_om, HAS_BIAS, SPLIT_K, x.dtype.element_ty, INTERPRET)


@triton.jit(do_not_specialize=["M", "stride_om"], do_not_specialize_on_alignment=["out"])
def _linear_fp8_rows_kernel(
    x, weight, scale_inv, scale_row, bias, out, partial,
    M, N, K, K_SPLIT,
    stride_wn, stride_sn, stride_om,
    SCALE_BLOCK_K: tl.constexpr,
    ONE_SCALE_COLUMN: tl.constexpr,
    WHOLE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
    SCALE_AFTER: tl.constexpr = False,
):
    """The few-rows path: out^T = real(weight) x^T, the dequantized weight tile [BLOCK_N features,
    BLOCK_K] the MMA's first operand (held in registers where it is made) and x^T [BLOCK_K,
    BLOCK_M rows] the second, so one row fills a 16-wide operand instead of a 64-row tile. The K
    walk (the split's ranges, BLOCK_K steps, the 16-wide chunks in ascending order) is the pinned
    config's.

    x is contiguous [M, K] and 16-byte aligned (the launcher copies it otherwise), so its tiles load
    asynchronously, pipelined with the weight's. Rows past M are masked: cp.async fills them with
    zeros and reads nothing (reading row M - 1 in their place made a row's x traffic 16-fold).
    WHOLE (a function of the weight's shape and the walk: N a multiple of BLOCK_N, every K step
    whole) drops the masks along K and N, whose compares and selects were a fifth of the loop."""
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    i_s = tl.program_id(2)  # which range of K (0 without a split)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    o_k = tl.arange(0, BLOCK_K)
    m_n = o_n < N
    k_start = i_s * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    p_w = weight + o_n[:, None].to(tl.int64) * stride_wn + (k_start + o_k)[None, :]  # [BLOCK_N, BLOCK_K]
    p_x = x + o_m[None, :].to(tl.int64) * K + (k_start + o_k)[:, None]  # [BLOCK_K, BLOCK_M]: x^T
    m_m = o_m < M
    p_srow = (tl.load(scale_row + o_n, mask=m_n, other=0).to(tl.int64) * stride_sn)[:, None]  # [BLOCK_N, 1]
    b_acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        if SCALE_AFTER:  # whole tiles, one scale column a step (`scale_after_dense`): the step's raw sum, then its scale
            b_x = tl.load(p_x, mask=m_m[None, :], other=0.0)
            b_d = dot_acc(raw_bf16(tl.load(p_w), INTERPRET), b_x, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), INTERPRET)
            b_acc = scale_step(b_acc, b_d, tl.load(scale_inv + p_srow + k0 // SCALE_BLOCK_K))
        elif WHOLE:
            b_x = tl.load(p_x, mask=m_m[None, :], other=0.0)
            b_w = dequantize_tile(tl.load(p_w), scale_inv, p_srow, None, k0, (k0 + o_k)[None, :], None, SCALE_BLOCK_K,
                                  ONE_SCALE_COLUMN, x.dtype.element_ty, INTERPRET)
            b_acc = dot_acc(b_w, b_x, b_acc, INTERPRET)
        else:
            m_k = (k0 + o_k) < k_end
            b_x = tl.load(p_x, mask=m_k[:, None] & m_m[None, :], other=0.0)
            m_w = m_n[:, None] & m_k[None, :]
            b_w = dequantize_tile(tl.load(p_w, mask=m_w, other=0.0), scale_inv, p_srow, m_n[:, None], k0, (k0 + o_k)[None, :], m_w,
                                  SCALE_BLOCK_K, ONE_SCALE_COLUMN, x.dtype.element_ty, INTERPRET)
            b_acc = dot_acc(b_w, b_x, b_acc, INTERPRET)
        p_x += BLOCK_K
        p_w += BLOCK_K
    store_tile(tl.trans(b_acc), bias, out, partial, o_m, o_n, i_s, M, N, stride_om, HAS_BIAS, SPLIT_K, x.dtype.element_ty, INTERPRET)


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_om"])
def _linear_raw_kernel(
    x, raw, scale_inv, scale_row, bias, out, partial,
    M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_om,
    SCALE_BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    """The many-rows path of the scale-after walk: raw [N, K] bf16 (`raw_weight`: each fp8 value
    times 2^-120, exact) multiplied as it is, each K step's fp32 sum (a fresh MMA chain over the
    step's 16-wide chunks in ascending order) times 2^120 and its block scale, added to the tile's
    sum (`scale_step`): the few-rows kernel's arithmetic, step by step, in an x-first tile of
    BLOCK_M rows. Whole K steps (K a multiple of BLOCK_K, each in one scale column); features and
    rows past N and M are masked."""
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_s, o_m, o_n, o_k, m_m, m_n, k_start, k_end, p_x, p_w = tile_start(
        x, raw, M, N, K, K_SPLIT, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)
    p_s = scale_inv + (tl.load(scale_row + o_n, mask=m_n, other=0).to(tl.int64) * stride_sn)[None, :]  # [1, BLOCK_N]
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        b_x = tl.load(p_x, mask=m_m[:, None], other=0.0)
        b_w = tl.load(p_w, mask=m_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]: raw^T
        b_d = dot_acc(b_x, b_w, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INTERPRET)
        b_acc = scale_step(b_acc, b_d, tl.load(p_s + k0 // SCALE_BLOCK_K, mask=m_n[None, :], other=0.0))
        p_x += BLOCK_K
        p_w += BLOCK_K
    store_tile(b_acc, bias, out, partial, o_m, o_n, i_s, M, N, stride_om, HAS_BIAS, SPLIT_K, x.dtype.element_ty, INTERPRET)


@triton.jit
def _dequantize_kernel(weight, scale_inv, scale_row, out, N, K, stride_sn, SCALE_BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    """out [N, K] = the real weight in out's dtype: dequantize_ref's values, element by element."""
    after_previous(PDL)  # first: kernels/dependent_launch.py
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (o_n < N)[:, None] & (o_k < K)[None, :]
    p = o_n[:, None].to(tl.int64) * K + o_k[None, :]
    b_w8 = tl.load(weight + p, mask=m, other=0.0)
    p_srow = (tl.load(scale_row + o_n, mask=o_n < N, other=0).to(tl.int64) * stride_sn)[:, None]
    b_w = dequantize_tile(b_w8, scale_inv, p_srow, m, 0, o_k[None, :], m, SCALE_BLOCK_K, False, out.dtype.element_ty, INTERPRET)
    tl.store(out + p, b_w, mask=m)


def dequantize(weight: torch.Tensor, scales: BlockScales, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_ref` on the device in one launch (the same values): fp8 [N, K] -> [N, K] in dtype."""
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    if n and k:
        _dequantize_kernel[(triton.cdiv(n, 32), triton.cdiv(k, 256))](
            weight, scales.scale_inv, scales.scale_row, out, n, k, scales.scale_inv.stride(0), SCALE_BLOCK_K=scales.block_k,
            BLOCK_N=32, BLOCK_K=256, INTERPRET=interpreting(), num_warps=4, **launch_options(weight.device))
    return out


def scale_after_dense(n: int, k: int, cfg: LinearConfig, scale_block_k: int) -> bool:
    """Whether a dense bf16 GEMM of an fp8 weight [n, k] under config cfg takes the scale-after
    walk: the walk is on (SCALE_AFTER_ON), every K step whole and in one scale column, and the
    features whole tiles of every kernel's feature tile (a multiple of 128). A function of the shape."""
    return SCALE_AFTER_ON and k % cfg.BLOCK_K == 0 and scale_block_k % cfg.BLOCK_K == 0 and n % 128 == 0


def raw_weight(weight: torch.Tensor) -> torch.Tensor:
    """fp8 [..., N, K] -> bf16 [..., N, K] of each value times 2^-120 (exact: the fp8 value's sign and
    magnitude bits under bf16's exponent field, `raw_bf16`'s values): what the scale-after walk's
    many-rows kernel multiplies. The two NaN encodings read as +-480 * 2^-120, as `raw_bf16` reads them."""
    bits = weight.view(torch.uint8).to(torch.int16)
    b = ((bits << 8).to(torch.int16) >> 4) & -30736  # 0x87F0: sign, then seven magnitude bits from bf16's exponent on
    return b.view(torch.bfloat16)


def fp8_config(n: int, k: int, dtype: torch.dtype) -> LinearConfig:
    """The one launch config of an fp8 weight [n, k] with activations in dtype, for every row count.

    kernels/linear.py's pinned config of the shape (its K walk: BLOCK_K, the split of K, BLOCK_N,
    warps, stages) with FP8_BLOCK_M rows a tile for bf16; fp32 (tests, the interpreter) keeps
    its FMA tile of 16 rows. `python -m bench.fp8_configs` times candidates one call at a time;
    an unsplit 64-feature tile that wins there made the engine's batch-1 steps slower (its
    kernel_breakdowns in `python -m bench.fp8_real_size`), so a change is judged in the engine."""
    pinned = linear_config(n, k, dtype)
    if dtype != torch.bfloat16:
        return pinned
    if FP8_TARGET_PROGRAMS is not None:
        pinned = pinned._replace(SPLIT_K=split_for(triton.cdiv(n, ROWS_TILE_FEATURES), triton.cdiv(k, pinned.BLOCK_K),
                                                   FP8_TARGET_PROGRAMS))
    return pinned._replace(BLOCK_M=FP8_BLOCK_M)


def check_block_scales(op: str, name: str, weight: torch.Tensor, scales: BlockScales, operand: tuple[str, torch.Tensor]) -> None:
    """An fp8 weight [..., N, K] and its BlockScales: dtypes, shapes, devices, contiguity.

    scale_row's values are not read (on the device that would synchronise); `dequantize_ref`
    checks them."""
    n, k = weight.shape[-2:]
    lead = list(weight.shape[:-2])  # [E] for stacked experts, else []
    if weight.dtype != FP8:
        raise ValueError(f"{op}: {name} dtype {weight.dtype} != {FP8}")
    check_tensor(op, name, weight, weight.shape, FP8, operand)
    check_contiguous(op, name, weight, along="K")
    if scales.block_k < 1:
        raise ValueError(f"{op}: {name} block_k must be >= 1, got {scales.block_k}")
    s = scales.scale_inv
    k_blocks = triton.cdiv(k, scales.block_k)
    if s.dim() != weight.dim() or list(s.shape[:-2]) != lead or s.shape[-1] != k_blocks:
        raise ValueError(f"{op}: {name} scale_inv must have shape {lead + ['S', k_blocks]} (ceil(K / block_k) = "
                         f"ceil({k} / {scales.block_k}) block columns), got {list(s.shape)}")
    check_tensor(op, f"{name} scale_inv", s, s.shape, torch.float32, operand, contiguous=True)
    check_tensor(op, f"{name} scale_row", scales.scale_row, (n,), torch.int32, operand, layout="[N]", contiguous=True)


def _check(x: torch.Tensor, weight: torch.Tensor, scales: BlockScales, bias: torch.Tensor | None, out: torch.Tensor | None) -> None:
    op = "linear_fp8"
    check_operand(op, "x", x, "[M, K]", DTYPES)
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be 2-D [N, K], got shape {list(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"{op}: weight K {weight.shape[1]} != x K {x.shape[1]} (weight {list(weight.shape)}, x {list(x.shape)})")
    check_block_scales(op, "weight", weight, scales, ("x", x))
    n = weight.shape[0]
    if bias is not None:
        check_tensor(op, "bias", bias, (n,), x.dtype, ("x", x), layout="[N]")
    if out is not None:
        check_tensor(op, "out", out, (x.shape[0], n), x.dtype, ("x", x), layout="[M, N]")
        check_contiguous(op, "out", out, along="N")


def linear_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: BlockScales,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    config: LinearConfig | None = None,
    defer_split: bool = False,
    real: torch.Tensor | None = None,
    raw: torch.Tensor | None = None,
) -> torch.Tensor | SplitSums:
    """x [M, K] @ real(weight, scales)[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, row-invariant.

    out: an optional [M, N] buffer (rows may be strided, features contiguous), filled and returned.
    config: overrides `fp8_config`: that one config then runs every M.
    defer_split: as kernels/linear.py's: where K is split, the splits' sums (SplitSums) for a
    consumer that finishes them the reduce's way (add_rms_norm); out must then be None.
    real: the weight's real values [N, K] in x's dtype (`dequantize`'s), kept by the caller: from
    DEQUANTIZED_ROWS rows on the bf16 GEMM multiplies them instead of a dequantization per call
    (the same values, so the same bits).
    raw: the weight's raw values [N, K] bf16 (`raw_weight`'s), kept by the caller: where the walk
    is scale-after (`scale_after_dense`), the many-rows kernel multiplies them instead of making
    them per call.
    """
    _check(x, weight, scales, bias, out)
    if real is not None:
        check_tensor("linear_fp8", "real", real, tuple(weight.shape), x.dtype, ("x", x), layout="[N, K]", contiguous=True)
    if raw is not None:
        check_tensor("linear_fp8", "raw", raw, tuple(weight.shape), torch.bfloat16, ("x", x), layout="[N, K]", contiguous=True)
    check_launchable("linear_fp8", "x", x)
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1 and k > 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    if defer_split and out is not None:
        raise ValueError("linear_fp8: defer_split returns the split sums; it takes no out buffer")
    cfg = config or fp8_config(n, k, x.dtype)  # the K walk is never a function of m: DESIGN.md section 6, "The block-FP8 GEMM"
    after = config is None and x.dtype == torch.bfloat16 and scale_after_dense(n, k, cfg, scales.block_k)
    if config is None and x.dtype == torch.bfloat16 and m >= DEQUANTIZED_ROWS and not after:  # many rows: the bf16 GEMM of the real weight
        real = dequantize(weight, scales, x.dtype) if real is None else real
        return linear(x, real, bias, out, pinned=cfg, defer_split=defer_split)
    deferred = defer_split and cfg.SPLIT_K > 1
    if out is None and not deferred:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return SplitSums(torch.zeros((cfg.SPLIT_K, m, n), dtype=torch.float32, device=x.device), bias, x.dtype) if deferred else out
    if out is None:
        out = x  # deferred: never stored (the partial takes the sums), so the launch compiles as undeferred
    partial = torch.empty((cfg.SPLIT_K, m, n), dtype=torch.float32, device=x.device) if cfg.SPLIT_K > 1 else out
    flags = dict(HAS_BIAS=bias is not None, INTERPRET=interpreting(), SPLIT_K=cfg.SPLIT_K)
    k_split = split_bounds(k, cfg)
    operands = (x, weight, scales.scale_inv, scales.scale_row, bias if bias is not None else x, out, partial, m, n, k, k_split)
    if after and m >= DEQUANTIZED_ROWS:  # many rows, scale after: the raw weight in x-first tiles
        raw = raw_weight(weight) if raw is None else raw
        # the interpreter's dot holds a [BLOCK_M, BLOCK_K, BLOCK_N] product (its bits follow no tile)
        block_m, block_n, warps, stages = (16, 64, 4, 1) if interpreting() else next(t[1:] for t in RAW_TILES if m >= t[0])
        _linear_raw_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), cfg.SPLIT_K)](
            x, raw, *operands[2:], x.stride(0), raw.stride(0), scales.scale_inv.stride(0), out.stride(0), SCALE_BLOCK_K=scales.block_k,
            **flags, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg.BLOCK_K, STAGES=stages, num_warps=warps,
            **launch_options(x.device))
    elif config is None and x.dtype == torch.bfloat16:  # few rows: the weight tile as the MMA's first operand
        x = contiguous_aligned(x)  # the kernel reads x [M, K] with row stride K, specialised on its alignment
        operands = (x, *operands[1:])
        _linear_fp8_rows_kernel[(triton.cdiv(m, ROWS_TILE), triton.cdiv(n, ROWS_TILE_FEATURES), cfg.SPLIT_K)](
            *operands, weight.stride(0), scales.scale_inv.stride(0), out.stride(0), SCALE_BLOCK_K=scales.block_k,
            ONE_SCALE_COLUMN=scales.block_k % cfg.BLOCK_K == 0, WHOLE=n % ROWS_TILE_FEATURES == 0 and k % cfg.BLOCK_K == 0,
            **flags, BLOCK_M=ROWS_TILE, BLOCK_N=ROWS_TILE_FEATURES, BLOCK_K=cfg.BLOCK_K, STAGES=ROWS_STAGES,
            num_warps=ROWS_WARPS, SCALE_AFTER=after, **launch_options(x.device))
    else:
        _linear_fp8_kernel[(triton.cdiv(m, cfg.BLOCK_M), triton.cdiv(n, cfg.BLOCK_N), cfg.SPLIT_K)](
            *operands, x.stride(0), weight.stride(0), scales.scale_inv.stride(0), out.stride(0), SCALE_BLOCK_K=scales.block_k,
            ONE_SCALE_COLUMN=scales.block_k % cfg.BLOCK_K == 0, **flags, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **launch_options(x.device))
    if deferred:
        return SplitSums(partial, bias, x.dtype)
    if cfg.SPLIT_K > 1:
        reduce_splits_kernel[(m, triton.cdiv(n, REDUCE_BLOCK_N))](
            partial, bias if bias is not None else x, out, m, n, out.stride(0), **flags, BLOCK_N=REDUCE_BLOCK_N,
            ROUND_TO=TL_DTYPES[x.dtype], num_warps=4, **launch_options(x.device),
        )
    return out


def dequantize_ref(weight: torch.Tensor, scales: BlockScales, dtype: torch.dtype) -> torch.Tensor:
    """The real weight: fp8 [..., N, K] -> cast(fp32(weight) * its block's scale) in dtype, [..., N, K].

    The product is formed in fp32 and rounded once; it is what the kernels rebuild per tile."""
    n, k = weight.shape[-2:]
    rows = scales.scale_row.long()
    n_scale_rows, n_scale_cols = scales.scale_inv.shape[-2:]
    if rows.shape != (n,) or (n and not (0 <= int(rows.min()) and int(rows.max()) < n_scale_rows)):
        raise ValueError(f"dequantize_ref: scale_row must be [N = {n}] ints in [0, {n_scale_rows}), got shape {list(rows.shape)}")
    if n_scale_cols != triton.cdiv(k, scales.block_k):
        raise ValueError(f"dequantize_ref: scale_inv has {n_scale_cols} block columns; K {k} / block_k {scales.block_k} needs "
                         f"{triton.cdiv(k, scales.block_k)}")
    per_element = scales.scale_inv.float().index_select(-2, rows).repeat_interleave(scales.block_k, dim=-1)[..., :k]  # [..., N, K]
    return (weight.float() * per_element).to(dtype)


def linear_fp8_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: BlockScales,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: `linear_ref` (one row at a time) over `dequantize_ref(weight, scales, x.dtype)`."""
    _check(x, weight, scales, bias, out)
    return linear_ref(x, dequantize_ref(weight, scales, x.dtype), bias, out)
