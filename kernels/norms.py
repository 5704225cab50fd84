"""Row-wise normalisations: RMSNorm (zero-centred and plain), the SiLU- and sigmoid-gated output
RMSNorms of GDN and KDA, and the l2norm of GDN / KDA queries and keys.
The design in full: DESIGN.md section 6, "Norms".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .checks import check_launchable, check_operand, check_tensor, contiguous_aligned
from .dependent_launch import after_previous, launch_options
from .linear import SplitSums
from .moe_grouped import PendingCombine, combine_block, release_counts
from .rounding import cast_rtne
from .runtime import interpreting

MAX_BLOCK_D = 4096  # longest row held in registers at once; longer rows loop over blocks of this
L2_EPS = tl.constexpr(1e-6)  # the l2norm's epsilon, fixed by GDN and KDA
ALIGN = 16  # bytes: Triton specialises pointer arguments on 16-byte alignment
DTYPES = (torch.float32, torch.bfloat16)  # the compute dtypes (fp16 checkpoints compute in fp32 or bf16)

# FORM: which normalisation the kernel computes (constexpr globals, readable inside @triton.jit)
RMS_ZERO_CENTRED = tl.constexpr(0)
RMS_PLAIN = tl.constexpr(1)
RMS_SILU_GATED = tl.constexpr(2)
RMS_SIGMOID_GATED = tl.constexpr(3)
L2_RSQRT = tl.constexpr(4)
L2_DIV = tl.constexpr(5)
L2_FORMS = {"rsqrt": L2_RSQRT, "div": L2_DIV}


@triton.jit
def normalise_block(b_x, b_ss, p_gate, p_w, m_d, D, eps, FORM: tl.constexpr, DTYPE: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr):
    """One block of a row: b_x [BLOCK_D] fp32, b_ss the row's fp32 sum of squares -> fp32 block
    whose cast to the output dtype is the result; intermediate casts to DTYPE where the reference
    casts. p_gate / p_w point at this block's gate and weight elements."""
    if FORM == L2_RSQRT:
        b_y = b_x * tl.math.div_rn(1.0, tl.sqrt_rn(b_ss + L2_EPS))
    elif FORM == L2_DIV:
        b_y = tl.math.div_rn(b_x, tl.sqrt_rn(b_ss + L2_EPS))
    else:
        # mean = sum / D as the CPU reference divides; D * 1.0, not D.to(): D == 1 arrives as a constexpr
        b_inv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(b_ss, D * 1.0) + eps))
        b_n = b_x * b_inv  # norm(x32)
        b_w = tl.load(p_w, mask=m_d, other=0.0).to(tl.float32)
        if FORM == RMS_ZERO_CENTRED:
            b_y = b_n * (1.0 + b_w)
        elif FORM == RMS_PLAIN:
            b_y = b_w * cast_rtne(b_n, DTYPE, EMULATE_BF16_RTNE).to(tl.float32)
        elif FORM == RMS_SILU_GATED:
            b_g = tl.load(p_gate, mask=m_d, other=0.0).to(tl.float32)
            b_wn = cast_rtne(b_w * cast_rtne(b_n, DTYPE, EMULATE_BF16_RTNE).to(tl.float32), DTYPE, EMULATE_BF16_RTNE).to(tl.float32)
            b_y = b_wn * tl.math.div_rn(b_g, 1.0 + tl.exp(-b_g))  # silu as torch: g / (1 + exp(-g))
        else:  # RMS_SIGMOID_GATED
            b_g = tl.load(p_gate, mask=m_d, other=0.0).to(tl.float32)
            b_y = (b_w * b_n) * tl.math.div_rn(1.0, 1.0 + tl.exp(-b_g))
    return b_y


@triton.jit
def _load_residual(p_r, p_split, split_stride, p_split_bias, pair_out, pair_ids, pair_weights, i_m, o_c, m_c, D, SPLIT_K: tl.constexpr,
                   HAS_SPLIT_BIAS: tl.constexpr, COMBINE_T: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                   DTYPE: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr):
    """One block of the residual, fp32: loaded; or (SPLIT_K > 1) finished from a split-K GEMM's
    sums as kernels/linear.py's reduce_splits_kernel finishes them: split 0, + each next split in
    ascending order, + bias, rounded once to DTYPE; or (COMBINE_T > 0) finished from grouped
    experts' pair outputs as kernels/moe_grouped.py's combine finishes them (`combine_block`,
    rounded once to DTYPE; pair_out, pair_ids, pair_weights its tensors). Either way the bits of
    the tensor the finishing launch would store."""
    if COMBINE_T > 0:
        b_r = combine_block(pair_out, pair_ids, pair_weights, i_m, o_c, m_c, D, COMBINE_T, BLOCK_T, BLOCK_D)
        return cast_rtne(b_r, DTYPE, EMULATE_BF16_RTNE).to(tl.float32)
    if SPLIT_K > 1:
        b_r = tl.load(p_split + o_c, mask=m_c, other=0.0)
        for i_s in tl.static_range(1, SPLIT_K):
            b_r += tl.load(p_split + i_s * split_stride + o_c, mask=m_c, other=0.0)
        if HAS_SPLIT_BIAS:
            b_r += tl.load(p_split_bias + o_c, mask=m_c, other=0.0).to(tl.float32)
        return cast_rtne(b_r, DTYPE, EMULATE_BF16_RTNE).to(tl.float32)
    return tl.load(p_r + o_c, mask=m_c, other=0.0).to(tl.float32)


@triton.jit
def _load_row_block(p_x, p_r, p_split, split_stride, p_split_bias, pair_out, pair_ids, pair_weights, i_m, o_c, m_c, D,
                    HAS_RESIDUAL: tl.constexpr, SPLIT_K: tl.constexpr, HAS_SPLIT_BIAS: tl.constexpr, COMBINE_T: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, DTYPE: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr):
    """One block of the row to normalise, fp32: x, or x + residual rounded to DTYPE (torch's add)."""
    b_x = tl.load(p_x + o_c, mask=m_c, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        b_r = _load_residual(p_r, p_split, split_stride, p_split_bias, pair_out, pair_ids, pair_weights, i_m, o_c, m_c, D, SPLIT_K,
                             HAS_SPLIT_BIAS, COMBINE_T, BLOCK_T, BLOCK_D, DTYPE, EMULATE_BF16_RTNE)
        b_x = cast_rtne(b_x + b_r, DTYPE, EMULATE_BF16_RTNE).to(tl.float32)
    return b_x


# split_stride is not specialised: its value (M * D) must not pick another compiled kernel
@triton.jit(do_not_specialize=["split_stride"])
def _row_norm_kernel(
    x, gate, weight, out, residual, total, split, split_bias, pair_out, pair_ids, pair_weights, counts,
    D, eps, gate_group, gate_group_stride, split_stride,
    FORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT_K: tl.constexpr,  # > 1: the residual is a split-K GEMM's sums (split [SPLIT_K, M, D] fp32), finished here
    HAS_SPLIT_BIAS: tl.constexpr,
    COMBINE_T: tl.constexpr,  # > 0: the residual is grouped experts' T pairs a row (a PendingCombine), finished here
    BLOCK_T: tl.constexpr,
    E_ALL: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    N_BLOCKS: tl.constexpr,
    EMULATE_BF16_RTNE: tl.constexpr,
    PDL: tl.constexpr,
):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_m = tl.program_id(0).to(tl.int64)  # the row; int64: rows * D can pass 2^31
    DTYPE: tl.constexpr = out.dtype.element_ty
    p_x = x + i_m * D
    p_r = residual + i_m * D
    p_split = split + i_m * D  # split 0's row i_m; split s is s * split_stride further
    # the gate's row i_m: row i_m % G of group i_m // G (G = 1 and a stride of D: rows stacked densely)
    p_g = gate + (i_m // gate_group) * gate_group_stride + (i_m % gate_group) * D
    p_out = out + i_m * D
    p_total = total + i_m * D
    o_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    if N_BLOCKS == 1:
        m_d = o_d < D
        b_x = _load_row_block(p_x, p_r, p_split, split_stride, split_bias, pair_out, pair_ids, pair_weights, i_m, o_d, m_d, D, HAS_RESIDUAL, SPLIT_K,
                              HAS_SPLIT_BIAS, COMBINE_T, BLOCK_T, BLOCK_D, DTYPE, EMULATE_BF16_RTNE)  # [BLOCK_D]
        if HAS_RESIDUAL:
            tl.store(p_total + o_d, b_x.to(DTYPE), mask=m_d)  # exact: b_x already holds a DTYPE value
        b_ss = tl.sum(b_x * b_x, axis=0)
        b_y = normalise_block(b_x, b_ss, p_g + o_d, weight + o_d, m_d, D, eps, FORM, DTYPE, EMULATE_BF16_RTNE)
        tl.store(p_out + o_d, cast_rtne(b_y, DTYPE, EMULATE_BF16_RTNE), mask=m_d)
    else:
        # a row past MAX_BLOCK_D is loaded twice (squares, then output): a residual owed its reduce or
        # combine is finished twice, the same bits each time (no published MoE hidden size is that wide)
        b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # per-lane partial sums of squares
        for i_b in range(N_BLOCKS):
            o_c = i_b * BLOCK_D + o_d
            b_x = _load_row_block(p_x, p_r, p_split, split_stride, split_bias, pair_out, pair_ids, pair_weights, i_m, o_c, o_c < D, D, HAS_RESIDUAL, SPLIT_K,
                                  HAS_SPLIT_BIAS, COMBINE_T, BLOCK_T, BLOCK_D, DTYPE, EMULATE_BF16_RTNE)
            b_acc += b_x * b_x
        b_ss = tl.sum(b_acc, axis=0)
        for i_b in range(N_BLOCKS):
            o_c = i_b * BLOCK_D + o_d
            m_c = o_c < D
            b_x = _load_row_block(p_x, p_r, p_split, split_stride, split_bias, pair_out, pair_ids, pair_weights, i_m, o_c, m_c, D, HAS_RESIDUAL, SPLIT_K,
                                  HAS_SPLIT_BIAS, COMBINE_T, BLOCK_T, BLOCK_D, DTYPE, EMULATE_BF16_RTNE)
            if HAS_RESIDUAL:
                tl.store(p_total + o_c, b_x.to(DTYPE), mask=m_c)
            b_y = normalise_block(b_x, b_ss, p_g + o_c, weight + o_c, m_c, D, eps, FORM, DTYPE, EMULATE_BF16_RTNE)
            tl.store(p_out + o_c, cast_rtne(b_y, DTYPE, EMULATE_BF16_RTNE), mask=m_c)
    if COMBINE_T > 0:
        if i_m == 0:  # the grouping's last reader
            release_counts(counts, E_ALL, BLOCK_E)


def norm_config(d: int) -> tuple[int, int, int]:
    """(BLOCK_D, N_BLOCKS, num_warps) for rows of d elements: a function of d alone, never of the
    row count. Below 2048 num_warps gives each thread at most 16 elements of a block (1 warp for a
    128-wide head); blocks of 2048 and more (the hidden-size norms) take 16 warps: a one-row
    decode runs one program a norm, and its latency falls with the threads that share its row
    (the 2B model's verify graph is faster at 1, 9 and 64 rows than at 4 or 8 warps; `python -m
    bench.gpu` times it)."""
    block_d = min(triton.next_power_of_2(d), MAX_BLOCK_D)
    return block_d, triton.cdiv(d, block_d), 16 if block_d >= 2048 else min(8, max(1, block_d // 512))


def _grouped_gate(op: str, gate: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A gate [M / G, G, D] whose G rows of D are dense and whose groups may be strided (GDN's z: a
    column slice of the input projection's output, [rows, heads, d_v]) -> (the gate, G, the groups'
    stride), read in place when every row starts 16-byte aligned, else made dense: (copy, 1, D).
    Whichever it is follows from the model's shapes, the same for every row count (see checks.contiguous_aligned)."""
    m, d = x.shape
    if gate.shape[0] * gate.shape[1] != m or gate.shape[2] != d:
        raise ValueError(f"{op}: gate must be [M / G, G, D] with M = {m} rows of D = {d}, got shape {list(gate.shape)}")
    check_tensor(op, "gate", gate, gate.shape, x.dtype, ("x", x))
    size = gate.element_size()
    dense_rows = gate.stride(2) == 1 and (gate.shape[1] == 1 or gate.stride(1) == d)
    if dense_rows and gate.data_ptr() % ALIGN == 0 and (gate.stride(0) * size) % ALIGN == 0 and (d * size) % ALIGN == 0:
        return gate, gate.shape[1], gate.stride(0)
    return contiguous_aligned(gate.reshape(m, d)), 1, d


def _launch(
    op: str,
    form: tl.constexpr,
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    out: torch.Tensor | None,
    dtypes: tuple[torch.dtype, ...],
    residual: torch.Tensor | SplitSums | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Check every tensor (messages name it), make the inputs contiguous and aligned, launch one
    program per row. With a residual: normalise x + residual and return (the sum, the norm); a
    SplitSums residual is finished in the kernel."""
    check_operand(op, "x", x, "[M, D]", dtypes, hint=" (reshape [rows, heads, d] to [rows * heads, d])")
    check_launchable(op, "x", x)
    m, d = x.shape
    if d == 0:
        raise ValueError(f"{op}: x has no columns (shape {list(x.shape)})")
    gate_group, gate_group_stride = 1, d
    if gate is not None and gate.dim() == 3:
        gate, gate_group, gate_group_stride = _grouped_gate(op, gate, x)
    elif gate is not None:
        check_tensor(op, "gate", gate, (m, d), x.dtype, ("x", x))
        gate = contiguous_aligned(gate)
    if weight is not None:
        check_tensor(op, "weight", weight, (d,), x.dtype, ("x", x))
        weight = contiguous_aligned(weight)
    out_dtype = torch.float32 if form.value in (L2_RSQRT.value, L2_DIV.value) else x.dtype
    if out is None:
        out = torch.empty((m, d), dtype=out_dtype, device=x.device)
    else:
        check_tensor(op, "out", out, (m, d), out_dtype, ("x", x), contiguous=True)
        if out.data_ptr() % ALIGN:
            raise ValueError(f"{op}: out must start {ALIGN}-byte aligned (see checks.contiguous_aligned), got address {out.data_ptr():#x}")
    x = contiguous_aligned(x)
    total, split, pending = None, None, None
    if isinstance(residual, SplitSums):
        split = _checked_split(op, residual, x)
        total = torch.empty_like(x)
    elif isinstance(residual, PendingCombine):
        pending = _checked_pending(op, residual, x)
        total = torch.empty_like(x)
    elif residual is not None:
        check_tensor(op, "residual", residual, (m, d), x.dtype, ("x", x))
        residual = contiguous_aligned(residual)
        total = torch.empty_like(x)
    if m == 0:
        return out if residual is None else (total, out)
    block_d, n_blocks, num_warps = norm_config(d)
    slots = pending.ids.shape[1] if pending is not None else 0
    e_all = pending.counts.shape[0] if pending is not None else 1
    _row_norm_kernel[(m,)](
        x, gate if gate is not None else x, weight if weight is not None else x, out,
        residual if isinstance(residual, torch.Tensor) else x, total if total is not None else out,
        split.partial if split is not None else x, split.bias if split is not None and split.bias is not None else x,
        *((pending.expert_out, pending.ids, pending.weights, pending.counts) if pending is not None else (x, x, x, x)),
        d, eps, gate_group, gate_group_stride, m * d,
        FORM=form.value,
        HAS_RESIDUAL=residual is not None,
        SPLIT_K=split.partial.shape[0] if split is not None else 1,
        HAS_SPLIT_BIAS=split is not None and split.bias is not None,
        COMBINE_T=slots,
        BLOCK_T=triton.next_power_of_2(max(slots, 1)),
        E_ALL=e_all,
        BLOCK_E=triton.next_power_of_2(e_all),
        BLOCK_D=block_d,
        N_BLOCKS=n_blocks,
        EMULATE_BF16_RTNE=interpreting(),
        # no contraction: with it the compiler fuses a square into whichever add of the sum it meets
        # first, and which one differs between compiled variants of this kernel (a split-K residual
        # or a plain one, at 16 warps: PTX for sm_90), so the norm of finished split sums would not
        # be the norm of the reduced ones; every product and sum here is rounded on its own
        num_warps=num_warps, enable_fp_fusion=False, **launch_options(x.device),
    )
    return out if residual is None else (total, out)


def _checked_split(op: str, split: SplitSums, x: torch.Tensor) -> SplitSums:
    """A SplitSums residual for rows x [M, D]: partial [SPLIT_K >= 2, M, D] fp32, contiguous and
    aligned (as linear() allocates it), bias [D] or None, both finishing to x's dtype."""
    m, d = x.shape
    if split.partial.dim() != 3 or split.partial.shape[0] < 2:
        raise ValueError(f"{op}: residual split sums must be [SPLIT_K >= 2, M, D], got shape {list(split.partial.shape)}")
    check_tensor(op, "residual split sums", split.partial, (split.partial.shape[0], m, d), torch.float32, ("x", x),
                 layout="[SPLIT_K, M, D]", contiguous=True)
    if split.dtype != x.dtype:
        raise ValueError(f"{op}: residual split sums finish to {split.dtype}, x is {x.dtype}")
    if split.bias is not None:
        check_tensor(op, "residual split bias", split.bias, (d,), x.dtype, ("x", x), layout="[D]")
    return SplitSums(contiguous_aligned(split.partial), None if split.bias is None else contiguous_aligned(split.bias), split.dtype)


def _checked_pending(op: str, pending: PendingCombine, x: torch.Tensor) -> PendingCombine:
    """A PendingCombine residual for rows x [M, D]: pair outputs [M * S, D] fp32, ids [M, S] int64,
    weights [M, S] fp32, counts [E] int32, all contiguous (as grouped_experts leaves them), finishing to x's dtype."""
    m, d = x.shape
    if pending.ids.dim() != 2 or pending.ids.shape[0] != m:
        raise ValueError(f"{op}: residual pending combine must have ids [M, S] with M = {m}, got shape {list(pending.ids.shape)}")
    slots = pending.ids.shape[1]
    on_x = ("x", x)
    check_tensor(op, "residual pair outputs", pending.expert_out, (m * slots, d), torch.float32, on_x, layout="[M * S, D]",
                 contiguous=True)
    check_tensor(op, "residual ids", pending.ids, (m, slots), torch.int64, on_x, layout="[M, S]", contiguous=True)
    check_tensor(op, "residual weights", pending.weights, (m, slots), torch.float32, on_x, layout="[M, S]", contiguous=True)
    check_tensor(op, "residual counts", pending.counts, pending.counts.shape, torch.int32, on_x, layout="[E]", contiguous=True)
    if pending.dtype != x.dtype:
        raise ValueError(f"{op}: residual pending combine finishes to {pending.dtype}, x is {x.dtype}")
    return pending


def _into(out: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """The references' `out=`: fill the buffer and return it, as the launchers do."""
    if out is None:
        return y
    return out.copy_(y)


# --- RMSNorm (attention q/k norms, layer norms, MLA latent norms) ---


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, D], weight [D] -> [M, D] in x's dtype: zero-centred cast(norm(x32) * (1 + w32)), or
    plain w * cast(norm(x32)). out: an optional contiguous [M, D] buffer, filled and returned."""
    form = RMS_ZERO_CENTRED if zero_centred else RMS_PLAIN
    return _launch("rms_norm", form, x, None, weight, eps, out, DTYPES)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centred:
        return _into(out, (normed * (1.0 + weight.float())).to(dtype))
    return _into(out, weight * normed.to(dtype))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | SplitSums | PendingCombine, weight: torch.Tensor, eps: float,
                 zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's add and the next pre-norm in one pass: x, residual [M, D], weight [D] ->
    (x + residual rounded to x's dtype, rms_norm of that sum), both [M, D] in x's dtype. residual
    may be a split-K projection's unfinished sums (linear(..., defer_split=True)) or grouped
    experts before their combine (moe_experts_routed(..., defer_combine=True)): the kernel
    finishes them as the reduce or the combine would (the same bits), a launch fewer each."""
    form = RMS_ZERO_CENTRED if zero_centred else RMS_PLAIN
    try:
        return _launch("add_rms_norm", form, x, None, weight, eps, None, DTYPES, residual=residual)
    except BaseException:
        if isinstance(residual, PendingCombine):  # never finished: the layer's next routing must start from zero counts
            residual.counts.zero_()
        raise


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return total, rms_norm_ref(total, weight, eps, zero_centred)


# --- GDN output norm ---


def silu_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, D], gate [M, D] (or [M / G, G, D] with strided groups: _grouped_gate), weight [D] -> [M, D]
    in x's dtype: cast(w * cast(norm(x32)) * silu(gate32))."""
    return _launch("silu_gated_rms_norm", RMS_SILU_GATED, x, gate, weight, eps, out, DTYPES)


def silu_gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    gate = gate.reshape(x.shape)  # a grouped gate [M / G, G, D] as its M rows
    return _into(out, ((weight * normed) * F.silu(gate.float())).to(dtype))


# --- KDA output norm ---


def sigmoid_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, D], gate [M, D], weight [D] -> [M, D] in x's dtype: cast(w32 * norm(x32) * sigmoid(gate32))."""
    return _launch("sigmoid_gated_rms_norm", RMS_SIGMOID_GATED, x, gate, weight, eps, out, DTYPES)


def sigmoid_gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return _into(out, (weight.float() * normed * torch.sigmoid(gate.float())).to(dtype))


# --- l2norm of GDN / KDA queries and keys ---


def l2norm(x: torch.Tensor, form: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 x [M, D] -> fp32 [M, D]: form "rsqrt" x * rsqrt(sum(x^2) + 1e-6) (GDN), "div"
    x / sqrt(sum(x^2) + 1e-6) (KDA)."""
    if form not in L2_FORMS:
        raise ValueError(f"l2norm: form must be one of {sorted(L2_FORMS)}, got {form!r}")
    return _launch("l2norm", L2_FORMS[form], x, None, None, 0.0, out, (torch.float32,))


def l2norm_ref(x: torch.Tensor, form: str, out: torch.Tensor | None = None) -> torch.Tensor:
    if form == "rsqrt":
        return _into(out, x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS.value))
    if form == "div":
        return _into(out, x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS.value))
    raise ValueError(f"l2norm: form must be one of {sorted(L2_FORMS)}, got {form!r}")
