"""The short causal conv of GDN and KDA over a ragged batch, and its window update (rollback, commit).

    window     [n_slots, C, W-1]  inputs' dtype: per slot, the raw inputs before the slot's next row
    inputs     [R, C]             fp32 or bf16: raw conv inputs, the rows of all sequences stacked;
                                  each row's channels dense, rows at any stride (a column slice of
                                  the layer's input projection is read in place, not copied)
    weight     [C, W]             inputs' dtype: depthwise taps, weight[:, W-1] multiplies the current row
    seq_slots  [S]                int32: each sequence's slot in the pool (distinct slots, but
                                  padding sequences with no rows / nothing consumed may share one)
    cu_rows    [S+1]              int32: sequence s owns rows cu_rows[s] .. cu_rows[s+1]-1; cu_rows[0] = 0
    consumed   [S]                int32: next_window only, 0 <= consumed[s] <= rows of s
    out        [R, C]             inputs' dtype

conv_rows: row t of sequence s (seq = window[slot] as rows, then the sequence's inputs):
    out = silu(sum_{j=0..W-1} weight[:, j] * seq[t + j])
with the sum taken left to right (j = 0 first), every product and partial sum rounded to the
inputs' dtype, then SiLU computed in fp32 and rounded once: what `causal_conv_row` computes with
torch's elementwise ops (each op on bf16 runs in fp32 and rounds to bf16). It never writes the
window: verify only reads it. Rows outside [0, cu_rows[S]) are not written.

next_window: window[slot] = the last W-1 of (window[slot] ++ the first consumed[s] input rows of s),
in place: rollback to the accepted prefix, and prefill's commit with consumed = all rows.
consumed[s] = 0 leaves the window alone (it is not even rewritten): graph buckets pad a step with
sequences that keep nothing (verifier/model/padding.py). conv_rows walks no row of a sequence with
none, so padding sequences cost a program that loads two ints.

Row invariance: one program per (sequence, channel block) takes its rows in tiles of
ROWS_PER_TILE (all rows of a verify at K <= 15 in one tile, so one memory round trip rather than
one per row; a sequence of one row, a decode's, takes a one-row tile); every element of a tile is computed on its own, its W taps read from the window or
the inputs by position and combined in the same order whatever the number of rows or the tile
shape. fp32 contraction into FMA is turned off
(enable_fp_fusion=False) so the GPU rounds the product and the sum separately, as torch does. The
bf16 rounding (`_round_to`) is the GPU's fp32 -> bf16 cast, which rounds to nearest even; under the
interpreter, which truncates on that cast, it is done with integer ops (`round_to_bf16`), which give
the same bf16 value. The kernel is bound by instructions, not memory (a verify's tile is a few
hundred KB), so each tap is one load, from the window or the inputs by a per-element pointer, and
each rounding one cast rather than the integer ops' seven.

The SiLU is x / (1 + exp(-x)) in fp32, as torch computes it; exp differs by an ulp or so between
torch (CPU SIMD or scalar), numpy (the interpreter) and the GPU, so outputs match the reference
exactly where SiLU saturates (x > ~17: SiLU(x) = x in fp32) and within a few fp32 ulps (one bf16
ulp after rounding) elsewhere. Within one backend the bits never depend on the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .checks import check_launchable, check_operand, check_ragged, check_tensor
from .dependent_launch import after_previous, launch_options
from .rounding import round_to_bf16
from .runtime import interpreting

DTYPES = (torch.float32, torch.bfloat16)
NUM_WARPS = 4


def _block_c(channels: int) -> int:
    """Channels per program of the window updates: at most 256 (a conv_dim of 8192 gives 32 programs
    per sequence)."""
    return min(256, triton.next_power_of_2(channels))


# conv_rows' tile: at most 128 channels, and for a sequence of more than one row (a verify)
# ROWS_PER_TILE rows (K <= 15 in one pass); a sequence of one row (a decode) takes one-row tiles, a
# branch on the device (its row count lives there), since a 16-row tile would compute 15 masked
# rows. Which branch a sequence takes changes no bit: every element is computed on its own (module
# docstring), which the row-invariance tests check.
ROWS_PER_TILE = 16


def _conv_block_c(channels: int) -> int:
    return min(128, triton.next_power_of_2(channels))


def _row_strided(inputs: torch.Tensor) -> torch.Tensor:
    """inputs [R, C] with each row's channels dense and rows at any stride, as they are (a column
    slice of a projection's output), else a dense copy: the kernels take the row stride."""
    return inputs if inputs.shape[1] <= 1 or inputs.stride(1) == 1 else inputs.contiguous()


@triton.jit
def _round_to(b_x, IS_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 b_x -> the nearest bf16 value (ties to even), held in fp32, where the inputs are bf16."""
    if IS_BF16:
        if INTERPRET:
            b_x = round_to_bf16(b_x)
        else:
            b_x = b_x.to(tl.bfloat16).to(tl.float32)
    return b_x


@triton.jit
def _program_sequence(seq_slots, cu_rows, C: tl.constexpr, BLOCK_C: tl.constexpr):
    """What a program of grid (S, cdiv(C, BLOCK_C)) owns: its sequence i_s, that sequence's slot
    (int64) and first row (int32, as cu_rows holds it), and its channels o_c [BLOCK_C] with mask m_c."""
    i_s = tl.program_id(0)
    i_c = tl.program_id(1)
    i_slot = tl.load(seq_slots + i_s).to(tl.int64)
    i_bos = tl.load(cu_rows + i_s)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C] channels
    return i_s, i_slot, i_bos, o_c, o_c < C


@triton.jit
def _conv_silu(p_window, inputs, weight, i_row_stride, i_bos, o_pos, o_c, m_c, m_row, W: tl.constexpr,
               IS_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """conv + SiLU of the elements at sequence positions o_pos (each element's row t: seq[t .. t+W-1]
    is its window) and channels o_c, o_pos and o_c broadcasting to the tile's shape (a row of
    [BLOCK_C], or [BLOCK_T, 1] against [1, BLOCK_C]); m_c masks the channels, m_row the tile. Tap j
    of row t is seq[t + j]: window column t + j while t + j < W-1, else input row t + j - (W-1)."""
    b_acc = None
    p_inputs = inputs + (i_bos + o_pos - (W - 1)) * i_row_stride + o_c  # input row t - (W-1): tap 0's, if it is an input
    for j in tl.static_range(W):
        o_tap = o_pos + j
        p_tap = tl.where(o_tap < W - 1, p_window + o_tap, p_inputs + j * i_row_stride)
        b_x = tl.load(p_tap, mask=m_row, other=0.0).to(tl.float32)
        b_w = tl.load(weight + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)
        b_prod = _round_to(b_x * b_w, IS_BF16, INTERPRET)
        if j == 0:
            b_acc = b_prod
        else:
            b_acc = _round_to(b_acc + b_prod, IS_BF16, INTERPRET)
    return _round_to(b_acc / (1.0 + tl.exp(-b_acc)), IS_BF16, INTERPRET)  # SiLU in fp32


@triton.jit
def _conv_rows_kernel(
    window, inputs, weight, seq_slots, cu_rows, out, i_row_stride,
    C: tl.constexpr,
    W: tl.constexpr,
    IS_BF16: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_s, i_slot, i_bos, o_c, m_c = _program_sequence(seq_slots, cu_rows, C, BLOCK_C)
    i_rows = tl.load(cu_rows + i_s + 1) - i_bos
    i_bos = i_bos.to(tl.int64)
    p_window = window + i_slot * C * (W - 1) + o_c * (W - 1)  # [BLOCK_C]: this slot's window, tap 0
    if i_rows == 1:
        # a decode's row: one row of channels
        o_pos = tl.zeros([BLOCK_C], dtype=tl.int32)  # [BLOCK_C] (a tensor, also in the interpreter)
        b_out = _conv_silu(p_window, inputs, weight, i_row_stride, i_bos, o_pos, o_c, m_c, m_c, W, IS_BF16, INTERPRET)
        tl.store(out + i_bos * C + o_c, b_out.to(out.dtype.element_ty), mask=m_c)
    else:
        # BLOCK_T rows at a time, each element on its own (module docstring): one memory round trip
        # for the taps of all the tile's rows rather than one per row
        o_t = tl.arange(0, BLOCK_T)  # [BLOCK_T]
        for i_t0 in range(0, i_rows, BLOCK_T):
            o_row = i_t0 + o_t  # [BLOCK_T] rows within the sequence
            m_row = (o_row < i_rows)[:, None] & m_c[None, :]  # [BLOCK_T, BLOCK_C]
            b_out = _conv_silu(p_window[None, :], inputs, weight, i_row_stride, i_bos, o_row[:, None], o_c[None, :],
                               m_c[None, :], m_row, W, IS_BF16, INTERPRET)
            tl.store(out + (i_bos + o_row[:, None]) * C + o_c[None, :], b_out.to(out.dtype.element_ty), mask=m_row)


@triton.jit
def _shift_window(window, inputs, i_row_stride, i_slot, i_bos, i_n, o_c, m_c, C: tl.constexpr, W: tl.constexpr,
                  BLOCK_W: tl.constexpr):
    """In place, channels o_c [BLOCK_C] (mask m_c) of window[i_slot] <- the last W-1 of (window ++
    inputs rows i_bos .. i_bos + i_n - 1), i_n >= 1 (int64); an input row is i_row_stride elements
    after the one before it, its channels contiguous."""
    o_w = tl.arange(0, BLOCK_W)  # [BLOCK_W] new window columns
    m_w = o_w < W - 1
    # new column w is seq[n + w] of seq = old window ++ inputs
    o_pos = i_n + o_w
    m_old = m_c[:, None] & (m_w & (o_pos < W - 1))[None, :]
    m_new = m_c[:, None] & (m_w & (o_pos >= W - 1))[None, :]
    p_window = window + i_slot * C * (W - 1) + o_c[:, None] * (W - 1)  # [BLOCK_C, 1]
    b_old = tl.load(p_window + o_pos[None, :], mask=m_old, other=0.0)
    b_new = tl.load(inputs + (i_bos + o_pos - (W - 1))[None, :] * i_row_stride + o_c[:, None], mask=m_new, other=0.0)
    b_win = tl.where(m_old, b_old, b_new)  # [BLOCK_C, BLOCK_W]
    # in place: every thread's reads of the old window land before any thread overwrites it
    tl.debug_barrier()
    tl.store(p_window + o_w[None, :], b_win, mask=m_c[:, None] & m_w[None, :])


@triton.jit
def _next_window_kernel(
    window, inputs, seq_slots, cu_rows, consumed, i_row_stride,
    C: tl.constexpr,
    W: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_s, i_slot, i_bos, o_c, m_c = _program_sequence(seq_slots, cu_rows, C, BLOCK_C)
    i_bos = i_bos.to(tl.int64)
    i_n = tl.load(consumed + i_s).to(tl.int64)
    if i_n == 0:
        # a padding sequence (graph buckets): its window is neither read nor written
        return
    _shift_window(window, inputs, i_row_stride, i_slot, i_bos, i_n, o_c, m_c, C, W, BLOCK_W)


def _check(op: str, window: torch.Tensor, inputs: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor) -> None:
    check_operand(op, "inputs", inputs, "[R, C]", DTYPES)
    check_launchable(op, "inputs", inputs)
    channels = inputs.shape[1]
    if window.dim() != 3 or window.shape[1] != channels or window.shape[2] < 1:
        raise ValueError(f"{op}: window must be [n_slots, C={channels}, W-1 >= 1], got shape {list(window.shape)}")
    # contiguous: the kernels read it (and next_window writes it) in place
    check_tensor(op, "window", window, window.shape, inputs.dtype, ("inputs", inputs), contiguous=True)
    check_ragged(op, seq_slots, cu_rows, ("inputs", inputs))


def conv_rows(window: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, seq_slots: torch.Tensor,
              cu_rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Short conv + SiLU of every row of a ragged batch -> out [R, C] (inputs' dtype); window is only read.

    out: an optional contiguous [R, C] buffer to write into; it is returned."""
    op = "conv_rows"
    _check(op, window, inputs, seq_slots, cu_rows)
    rows, channels = inputs.shape
    check_tensor(op, "weight", weight, (channels, window.shape[2] + 1), inputs.dtype, ("inputs", inputs), layout="[C, W]")
    if out is None:
        out = torch.empty_like(inputs, memory_format=torch.contiguous_format)
    else:
        check_tensor(op, "out", out, inputs.shape, inputs.dtype, ("inputs", inputs), layout="[R, C]", contiguous=True)
    n_seqs = seq_slots.shape[0]
    if n_seqs == 0 or rows == 0:
        return out
    block_c = _conv_block_c(channels)
    inputs = _row_strided(inputs)
    _conv_rows_kernel[(n_seqs, triton.cdiv(channels, block_c))](
        window, inputs, weight.contiguous(), seq_slots, cu_rows, out, inputs.stride(0),
        C=channels, W=weight.shape[1], IS_BF16=inputs.dtype == torch.bfloat16, INTERPRET=interpreting(), BLOCK_T=ROWS_PER_TILE,
        BLOCK_C=block_c,
        num_warps=NUM_WARPS, num_stages=1, enable_fp_fusion=False, **launch_options(inputs.device),
    )
    return out


def next_window(window: torch.Tensor, inputs: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor,
                consumed: torch.Tensor) -> None:
    """In place: window[slot] = last W-1 of (window[slot] ++ the first consumed[s] input rows of s).

    consumed[s] = 0 leaves window[slot] untouched; consumed[s] in 0 .. rows of s is not checked
    (that would sync the device)."""
    op = "next_window"
    _check(op, window, inputs, seq_slots, cu_rows)
    check_tensor(op, "consumed", consumed, seq_slots.shape, torch.int32, ("inputs", inputs), layout="[S]")
    n_seqs, channels, keep = seq_slots.shape[0], inputs.shape[1], window.shape[2]
    if n_seqs == 0:
        return
    block_c = _block_c(channels)
    inputs = _row_strided(inputs)
    _next_window_kernel[(n_seqs, triton.cdiv(channels, block_c))](
        window, inputs, seq_slots, cu_rows, consumed, inputs.stride(0),
        C=channels, W=keep + 1, BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(keep),
        num_warps=NUM_WARPS, num_stages=1, **launch_options(inputs.device),
    )


def causal_conv_row(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """window [W, C] raw inputs ending at this row, weight [C, W] -> [1, C]: a left-to-right sum of
    W products, then SiLU, on one row (a [1, C] tensor, so torch's SIMD/tail split never depends on
    the batch). The CPU reference backend's conv of one row (through conv_rows_ref)."""
    out = window[0:1] * weight[:, 0]
    for j in range(1, weight.shape[1]):
        out = out + window[j : j + 1] * weight[:, j]
    return F.silu(out)


def conv_rows_ref(window: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, seq_slots: torch.Tensor,
                  cu_rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """conv_rows in torch, each sequence's rows one at a time: what the CPU reference backend runs
    (verifier.model.layers.linear_attention)."""
    width = weight.shape[1]
    if out is None:
        out = torch.empty_like(inputs, memory_format=torch.contiguous_format)
    bounds = cu_rows.tolist()
    for s, slot in enumerate(seq_slots.tolist()):
        seq = torch.cat((window[slot].t().to(inputs.dtype), inputs[bounds[s] : bounds[s + 1]]), dim=0)  # [W-1+n, C]
        for t in range(bounds[s + 1] - bounds[s]):
            out[bounds[s] + t] = causal_conv_row(seq[t : t + width], weight)[0]
    return out


def next_window_ref(window: torch.Tensor, inputs: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor,
                    consumed: torch.Tensor) -> None:
    """next_window in torch: the CPU reference backend's rollback and commit (verifier.model.rollback)."""
    keep = window.shape[2]
    bounds = cu_rows.tolist()
    for s, (slot, n) in enumerate(zip(seq_slots.tolist(), consumed.tolist())):
        if n == 0:  # a padding sequence: its slot is not touched
            continue
        seq = torch.cat((window[slot], inputs[bounds[s] : bounds[s] + n].t().to(window.dtype)), dim=1)  # [C, W-1+n]
        window[slot] = seq[:, seq.shape[1] - keep :]
