"""Row-invariant skinny GEMM: every projection, MLP, expert and the LM head.
The design in full: DESIGN.md section 6, "The skinny GEMM".
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .checks import check_contiguous, check_launchable, check_operand, check_tensor
from .dependent_launch import after_previous, launch_options
from .rounding import TL_DTYPES, cast_rtne
from .runtime import hopper, interpreting

BLOCK_M = 16  # rows per tile, fixed: tl.dot's smallest M, enough for a decode row or a 16-row verify
DTYPES = (torch.float32, torch.bfloat16)


class LinearConfig(NamedTuple):
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    SPLIT_K: int = 1  # programs per output tile, each over a fixed contiguous range of K
    BLOCK_M: int = BLOCK_M
    TMA: bool = False  # load the tiles through Hopper's tensor memory accelerator (`_linear_tma_kernel`)


# (from this many rows, the tile: BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages; the tile for
# weights of at least WIDE_N features; the tile for split-K weights; whether the tiles load through
# TMA), largest first.
# 128 rows on, timed on the H200 at M = 576 on the 2B model's shapes against cuBLAS: TMA loads
# (`_linear_tma_kernel`, the same bits) and 64-row tiles for the split-K output projections and the
# LM head, whose 2048 features (16 tiles of 128) or 152k give too few or too long programs for
# 128-row tiles, which are slower there (the 12k-feature input projections keep 128-row tiles,
# as fast either way; `python -m bench.gemm` times each shape against cuBLAS). 32 to 127 rows
# (64 decoding sequences, a few verifies): 64 features a tile, so that a 2048-wide output projection runs 32 tiles x its split of K, not 16, on 132 SMs (every
# tile tried gave the pinned tile's bits). Weights of at least WIDE_N features (an LM head) have
# tiles enough, and keep 128 features a tile there, which is faster. Split-K weights (the output
# projections and MLP down, 2048 features) walk BLOCK_K 128 there, faster at every row count from
# 32 to 127. Up to 64 rows (one M tile) 32 features a tile: more,
# shorter programs stream the weights faster there, and from 65 rows (two M tiles, each weight tile
# read twice) they are far slower (the engine's steps, timed by `python -m bench.gpu`). No TMA
# below 128 rows: there its 64 x 64 tile is slower than the pointer loads on the wide weights.
ROW_TILES = ((128, (128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (64, 128, 64, 4, 3), True),
             (65, (64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (64, 64, 128, 4, 3), False),
             (32, (64, 32, 64, 4, 4), (64, 128, 64, 4, 3), (64, 32, 128, 4, 4), False))
WIDE_N = 32768


TARGET_PROGRAMS = 256  # split narrow weights until about this many programs run (~2 per H200 SM)
MAX_SPLIT_K = 8
MIN_K_STEPS_PER_SPLIT = 4  # each split walks at least this many BLOCK_K steps


def linear_config(n: int, k: int, dtype: torch.dtype) -> LinearConfig:
    """The pinned launch config for a weight of shape [n, k]; never a function of the row count.

    bf16 (the GPU's serving dtype) is measured: `python -m bench.linear_configs` times candidate
    (BLOCK_N, BLOCK_K, warps, stages) configs on the 2B checkpoint's weight shapes at 1 and 9 rows
    (bench/results/linear_configs_2026-11-29.json). The rule: one config for every shape, chosen
    because it stays close to the best candidate on each of them rather than best on one. BLOCK_N
    32, BLOCK_K 128, 4 warps, 6 stages is that config from the 2048-wide output projections (64
    tiles, too few for the H200's 132 SMs, so deep pipelining of each tile's K walk is what helps;
    that sweep ran every candidate unsplit, before SPLIT_K) to the 152k-row LM head.
    bf16 weights with few output tiles also split K (SPLIT_K, below): until about
    TARGET_PROGRAMS programs run, at most MAX_SPLIT_K ways, each split at least
    MIN_K_STEPS_PER_SPLIT BLOCK_K steps long; fp32 never splits.
    fp32 (tests, the CPU interpreter) is chosen by reasoning, since no fp32 path is served for
    speed: input_precision="ieee" has no tensor cores, the dot is FMA with both tiles in
    registers, so BLOCK_K 32 and 3 stages keep a [16, 32] x [32, 64] product in 4 warps without
    spilling; BLOCK_N 64 when N gives at least 128 tiles, else 32.
    Small N or K shrink the block to the next power of two, at least 16 (tl.dot's minimum).
    Changing a config changes the CUDA backend's bits (another association of the K sum) but
    never the row-invariance contract, since decode and verify read the same config.
    Pipelined 4 stages deep, not 6, below WIDE_N features: timed as the engine runs them (a CUDA
    graph of GEMMs on distinct weights of one shape, dependent launches, split sums handed on) at
    1 and 9 rows, (32, 4 warps, 4 stages) was the fastest (BLOCK_N, warps, stages) tile, or close
    to it, on every 2B layer shape, and faster than 6 stages on each of them (the MLP down, output
    and input projections); `python -m bench.gemm` times the shapes, so rerun it before changing
    the stages. None of BLOCK_N, warps or stages changes the K walk, so every tile gives the same
    bits: a change here is a speed question only. The LM head (not in that sweep) keeps 6.
    """
    if dtype == torch.bfloat16:
        block_n, block_k, num_stages = 32, 128, (6 if n >= WIDE_N else 4)
    else:
        block_n, block_k, num_stages = (64 if n >= 128 * 64 else 32), 32, 3
    block_n = max(16, min(block_n, triton.next_power_of_2(n)))
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    # the GPU's serving dtype splits; fp32 (tests) keeps one K walk
    split_k = split_for(triton.cdiv(n, block_n), triton.cdiv(k, block_k), TARGET_PROGRAMS) if dtype == torch.bfloat16 else 1
    return LinearConfig(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=num_stages, SPLIT_K=split_k)


def split_for(tiles: int, k_steps: int, target: int) -> int:
    """SPLIT_K for a weight of `tiles` output tiles and `k_steps` BLOCK_K steps: doubled while
    tiles * SPLIT_K stays within `target` programs, at most MAX_SPLIT_K ways, each split at least
    MIN_K_STEPS_PER_SPLIT steps long."""
    split_k = 1
    while split_k < MAX_SPLIT_K and tiles * split_k * 2 <= target and k_steps >= 2 * split_k * MIN_K_STEPS_PER_SPLIT:
        split_k *= 2
    return split_k


def tile_for_rows(cfg: LinearConfig, n: int, m: int, dtype: torch.dtype) -> LinearConfig:
    """The pinned config `cfg` of an [n, K] weight with its tile for a batch of m rows (bf16: ROW_TILES;
    fp32 keeps the pinned tile). The K walk is cfg's: SPLIT_K is kept, the tile's BLOCK_K divides
    cfg's (so the split bounds, whole BLOCK_K steps of cfg, are whole steps of the tile too), and
    the bounds are computed from cfg (see `linear`)."""
    if dtype != torch.bfloat16:
        return cfg
    for min_rows, tile, wide_tile, split_tile, tma in ROW_TILES:
        if m >= min_rows:
            block_m, block_n, block_k, num_warps, num_stages = (
                wide_tile if n >= WIDE_N else split_tile if cfg.SPLIT_K > 1 else tile)
            return cfg._replace(BLOCK_M=block_m, BLOCK_N=max(16, min(block_n, triton.next_power_of_2(n))), BLOCK_K=min(block_k, cfg.BLOCK_K),
                                num_warps=num_warps, num_stages=num_stages, TMA=tma)
    return cfg


def split_bounds(k: int, cfg: LinearConfig) -> int:
    """K elements per split: whole BLOCK_K steps, the last split taking what is left."""
    return triton.cdiv(triton.cdiv(k, cfg.BLOCK_K), cfg.SPLIT_K) * cfg.BLOCK_K


@triton.jit
def _dot_rows_apart(b_x, b_w):
    """b_x [BLOCK_M, BLOCK_K] @ b_w [BLOCK_K, BLOCK_N], fp32, each row's K products summed on their own.

    Interpreter only. There tl.dot is numpy's matmul, and OpenBLAS's GEMM kernels give a row other
    bits at another place in the tile (on a Haswell build rows 6..15 of a 16-row tile differ from
    the same row at row 0), so a row decoded alone would not match itself inside a verify batch. A
    broadcast product summed over K (numpy adds along K for every (row, column) alike) cannot
    depend on the other rows. The GPU's tl.dot has no such dependence and never takes this path.
    """
    return tl.sum(b_x[:, :, None] * b_w[None, :, :], axis=1)


@triton.jit
def _widen(b):
    """b in fp32, exactly. Interpreter only: its bf16 -> fp32 conversion loses bf16's subnormals
    (the raw weights of the scale-after walks, kernels/linear_fp8.py's `raw_bf16`, are subnormal
    where the fp8 values are), so bf16 is widened on its bits, as the GPU widens it."""
    if b.dtype == tl.bfloat16:
        return (b.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return b.to(tl.float32)


@triton.jit
def dot_acc(b_a, b_b, b_acc, INTERPRET: tl.constexpr):
    """b_acc + b_a [BLOCK_M, K] @ b_b [K, N] in fp32, each output row from its own input row: the one
    accumulate step of every GEMM's K walk here (linear, linear_fp8, the grouped experts).

    Under the interpreter not tl.dot (see _dot_rows_apart): bf16 products are exact in fp32, so
    upcasting keeps the MMA's math up to summation order. fp32 operands: an IEEE dot (no TF32)."""
    if INTERPRET:
        return b_acc + _dot_rows_apart(_widen(b_a), _widen(b_b))
    elif b_a.dtype == tl.float32:
        return tl.dot(b_a, b_b, b_acc, input_precision="ieee")
    else:
        return tl.dot(b_a, b_b, b_acc)  # bf16 MMA, fp32 accumulate


@triton.jit
def tile_start(x, weight, M, N, K, K_SPLIT, stride_xm, stride_wn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """What a GEMM program of grid (row blocks, feature blocks, splits of K) walks: its split i_s,
    rows o_m [BLOCK_M] and output features o_n [BLOCK_N] with their masks, the K offsets o_k
    [BLOCK_K] of a step, its range of K (k_start .. k_end) and its first x [BLOCK_M, BLOCK_K] and
    weight^T [BLOCK_K, BLOCK_N] tile pointers (x rows stride_xm apart, weight rows stride_wn)."""
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    i_s = tl.program_id(2)  # which range of K (0 without a split)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    o_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    k_start = i_s * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    # int64 row offsets: an LM head's N * K can pass 2^31 elements
    p_x = x + o_m[:, None].to(tl.int64) * stride_xm + (k_start + o_k)[None, :]  # [BLOCK_M, BLOCK_K]
    p_w = weight + o_n[None, :].to(tl.int64) * stride_wn + (k_start + o_k)[:, None]  # [BLOCK_K, BLOCK_N]: weight^T
    return i_s, o_m, o_n, o_k, o_m < M, o_n < N, k_start, k_end, p_x, p_w


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x, weight, bias, out, partial,
    M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_s, o_m, o_n, o_k, m_m, m_n, k_start, k_end, p_x, p_w = tile_start(
        x, weight, M, N, K, K_SPLIT, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K)

    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        m_k = (k0 + o_k) < k_end
        b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_acc = dot_acc(b_x, b_w, b_acc, INTERPRET)
        p_x += BLOCK_K
        p_w += BLOCK_K

    store_tile(b_acc, bias, out, partial, o_m, o_n, i_s, M, N, stride_om, HAS_BIAS, SPLIT_K, x.dtype.element_ty, INTERPRET)


@triton.jit
def store_tile(b_acc, bias, out, partial, o_m, o_n, i_s, M, N, stride_om, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                ROUND_TO: tl.constexpr, INTERPRET: tl.constexpr):
    """A program's [BLOCK_M, BLOCK_N] fp32 sum (rows o_m, features o_n): split i_s's partial, or
    (+ bias) rounded once to ROUND_TO (x's dtype), widened to out's dtype, stored."""
    m_mn = (o_m < M)[:, None] & (o_n < N)[None, :]
    if SPLIT_K > 1:  # the fp32 partial of this range; reduce_splits_kernel finishes the tile
        p_part = partial + (i_s * M + o_m[:, None]).to(tl.int64) * N + o_n[None, :]
        tl.store(p_part, b_acc, mask=m_mn)
    else:
        if HAS_BIAS:
            b_bias = tl.load(bias + o_n, mask=o_n < N, other=0.0).to(tl.float32)  # [BLOCK_N]
            b_acc += b_bias[None, :]
        b_out = cast_rtne(b_acc, ROUND_TO, INTERPRET).to(out.dtype.element_ty)  # rounded to x's dtype, then widened if out is fp32
        p_out = out + o_m[:, None].to(tl.int64) * stride_om + o_n[None, :]
        tl.store(p_out, b_out, mask=m_mn)


# M only masks the stores: not specialised, as in _linear_kernel
@triton.jit(do_not_specialize=["M"])
def _linear_tma_kernel(
    x_desc, w_desc, bias, out, partial,
    M, N, K, K_SPLIT, stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    """_linear_kernel's K walk (bf16, the GPU only) with the x and weight tiles loaded by tensor
    descriptors (TMA): the same 16-wide K chunks into the same MMAs in the same order, so the same
    bits (measured on every tile and every 2B weight shape: `python -m bench.gemm`'s tiles_equal). Rows
    past M and K past its end read 0, as the masked loads do; split ranges end on whole BLOCK_K steps."""
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_m = tl.program_id(0)
    i_n = tl.program_id(1)
    i_s = tl.program_id(2)  # which range of K (0 without a split)
    k_start = i_s * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    b_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        b_x = x_desc.load([i_m * BLOCK_M, k0])  # [BLOCK_M, BLOCK_K]
        b_w = w_desc.load([i_n * BLOCK_N, k0])  # [BLOCK_N, BLOCK_K]
        b_acc = tl.dot(b_x, b_w.T, b_acc)  # bf16 MMA, fp32 accumulate
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    store_tile(b_acc, bias, out, partial, o_m, o_n, i_s, M, N, stride_om, HAS_BIAS, SPLIT_K, tl.bfloat16, False)


@triton.jit(do_not_specialize=["M"])
def reduce_splits_kernel(
    partial, bias, out,
    M, N, stride_om,
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROUND_TO: tl.constexpr,  # x's dtype: the sum is rounded to it, then stored in out's (widened if fp32)
    PDL: tl.constexpr,
):
    """out[m, n-block] = cast(sum over s = 0, 1, .. SPLIT_K-1 of partial[s, m, n-block] (+ bias))."""
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_m = tl.program_id(0).to(tl.int64)  # one row per program: rows never share a sum
    i_n = tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_acc = tl.load(partial + i_m * N + o_n, mask=m_n, other=0.0)
    for i_s in range(1, SPLIT_K):  # ascending, fixed
        b_acc += tl.load(partial + (i_s * M + i_m) * N + o_n, mask=m_n, other=0.0)
    if HAS_BIAS:
        b_acc += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_out = cast_rtne(b_acc, ROUND_TO, INTERPRET).to(out.dtype.element_ty)
    tl.store(out + i_m * stride_om + o_n, b_out, mask=m_n)


REDUCE_BLOCK_N = 1024


class SplitSums(NamedTuple):
    """A split-K product before its reduce (`linear(..., defer_split=True)`): what
    `reduce_splits_kernel` would add up, for a consumer that adds it up itself the same way
    (kernels/norms.py's add_rms_norm: one launch fewer per projection).

    partial [SPLIT_K, M, N] fp32: the splits' sums, in split order; bias [N] or None; dtype: what
    the finished sum rounds to (x's dtype). The finished rows are partial[0] + partial[1] + ...
    in ascending order, + bias, rounded once to dtype."""

    partial: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.partial.shape[1:]

    def finish(self) -> torch.Tensor:
        """The reduce: [M, N] in dtype, bitwise what linear() without defer_split returns."""
        _, m, n = self.partial.shape
        out = torch.empty((m, n), dtype=self.dtype, device=self.partial.device)
        _reduce(self, out)
        return out


def _reduce(sums: SplitSums, out: torch.Tensor) -> None:
    m, n = sums.shape
    if m == 0 or n == 0:
        return
    reduce_splits_kernel[(m, triton.cdiv(n, REDUCE_BLOCK_N))](
        sums.partial, sums.bias if sums.bias is not None else out, out, m, n, out.stride(0),
        HAS_BIAS=sums.bias is not None, INTERPRET=interpreting(), SPLIT_K=sums.partial.shape[0], BLOCK_N=REDUCE_BLOCK_N,
        ROUND_TO=TL_DTYPES[sums.dtype], num_warps=4, **launch_options(out.device),
    )


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> None:
    op = "linear"
    check_operand(op, "x", x, "[M, K]", DTYPES)
    check_launchable(op, "x", x)
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be 2-D [N, K], got shape {list(weight.shape)}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"{op}: weight K {weight.shape[1]} != x K {x.shape[1]} (weight {list(weight.shape)}, x {list(x.shape)})")
    n = weight.shape[0]
    check_tensor(op, "weight", weight, (n, x.shape[1]), x.dtype, ("x", x))
    # a silent copy of an LM head per call would cost more than the GEMM
    check_contiguous(op, "weight", weight, along="K")
    if bias is not None:
        check_tensor(op, "bias", bias, (n,), x.dtype, ("x", x), layout="[N]")
    if out is not None:
        # fp32 out for bf16 x: the bf16 products widened (DESIGN.md section 6, "The skinny GEMM")
        widened = x.dtype == torch.bfloat16 and out.dtype == torch.float32
        check_tensor(op, "out", out, (x.shape[0], n), out.dtype if widened else x.dtype, ("x", x), layout="[M, N]")
        check_contiguous(op, "out", out, along="N")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    config: LinearConfig | None = None,
    pinned: LinearConfig | None = None,
    defer_split: bool = False,
) -> torch.Tensor | SplitSums:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, row-invariant.

    out: an optional [M, N] buffer to write into (rows may be strided, features contiguous), in x's
    dtype or, for bf16 x, fp32 (the bf16 result widened); it is returned. Rows of x may be strided (a slice of a larger buffer); features are made contiguous.
    config: overrides the pinned linear_config and its tiles by row count (bench/linear_configs.py
    measures candidates with it): that one config then runs every M.
    pinned: the weight's pinned config in place of linear_config's (its K walk: BLOCK_K steps, the
    split of K), its tile still chosen by row count (kernels/linear_fp8.py's many-rows path walks
    K as its few-rows kernel does).
    defer_split: where the weight's K is split (SPLIT_K > 1, a function of its shape), return the
    splits' sums (SplitSums) for the caller to finish instead of launching the reduce; out must
    then be None.
    """
    _check(x, weight, bias, out)
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1 and k > 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    if defer_split and out is not None:
        raise ValueError("linear: defer_split returns the split sums; it takes no out buffer")
    pinned = config or pinned or linear_config(n, k, x.dtype)
    cfg = tile_for_rows(pinned, n, m, x.dtype) if config is None else pinned
    deferred = defer_split and cfg.SPLIT_K > 1
    if out is None and not deferred:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return SplitSums(torch.zeros((cfg.SPLIT_K, m, n), dtype=torch.float32, device=x.device), bias, x.dtype) if deferred else out
    # [SPLIT_K, M, N] fp32 partial sums when K is split (else unused)
    partial = torch.empty((cfg.SPLIT_K, m, n), dtype=torch.float32, device=x.device) if cfg.SPLIT_K > 1 else out
    grid = (triton.cdiv(m, cfg.BLOCK_M), triton.cdiv(n, cfg.BLOCK_N), cfg.SPLIT_K)
    if cfg.TMA and _tma_loads(x, weight):
        _linear_tma_kernel[grid](
            TensorDescriptor.from_tensor(x, [cfg.BLOCK_M, cfg.BLOCK_K]), TensorDescriptor.from_tensor(weight, [cfg.BLOCK_N, cfg.BLOCK_K]),
            bias if bias is not None else x, out if out is not None else x, partial,
            m, n, k, split_bounds(k, pinned), out.stride(0) if out is not None else n,
            HAS_BIAS=bias is not None, SPLIT_K=cfg.SPLIT_K, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
            STAGES=cfg.num_stages, num_warps=cfg.num_warps, **launch_options(x.device),
        )
        return _finish(cfg, partial, bias, x.dtype, out, deferred)
    flags = dict(HAS_BIAS=bias is not None, INTERPRET=interpreting(), SPLIT_K=cfg.SPLIT_K)
    _linear_kernel[grid](
        # deferred: x stands in for out (never stored), so the launch compiles to the kernel linear() runs undeferred
        x, weight, bias if bias is not None else x, out if out is not None else x, partial,
        m, n, k, split_bounds(k, pinned),
        x.stride(0), weight.stride(0), out.stride(0) if out is not None else n,
        **flags,
        BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N,
        BLOCK_K=cfg.BLOCK_K,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **launch_options(x.device),
    )
    return _finish(cfg, partial, bias, x.dtype, out, deferred)


def _finish(cfg: LinearConfig, partial: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, out: torch.Tensor | None,
            deferred: bool) -> torch.Tensor | SplitSums:
    """After the GEMM's launch: out, or with a split of K its sums (deferred) or their reduce into out."""
    if cfg.SPLIT_K > 1:
        sums = SplitSums(partial, bias, dtype)
        if deferred:
            return sums
        _reduce(sums, out)
    return out


def _tma_loads(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether tensor descriptors can address x and weight (bf16 on a Hopper-class GPU, not under the
    interpreter; 16-byte aligned starts and row strides, dense rows). Otherwise the tile loads by
    pointers, with the same bits."""
    if interpreting() or x.device.type != "cuda" or x.dtype != torch.bfloat16 or not hopper(x.device.index):
        return False
    return all(t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x, weight))


def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference backend's projection: F.linear one row at a time on a fresh copy of the row.

    Mirrors `verifier.model.ops.each_row(..., row_invariant=True)`: a K-row F.linear on the CPU
    takes a GEMM path whose bits differ from the rows' one-row (GEMV) products, so every row is
    computed alone. out, if given, is filled and returned (same contract as `linear`).
    """
    rows = [F.linear(x[r : r + 1].clone(), weight, bias) for r in range(x.shape[0])]
    result = torch.cat(rows) if rows else F.linear(x, weight, bias)
    if out is None:
        return result
    out.copy_(result)
    return out
