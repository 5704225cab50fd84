"""The short causal conv of GDN and KDA over a ragged batch, and its window update (rollback, commit).
The design in full: DESIGN.md section 6, "The short conv".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .checks import check_launchable, check_operand, check_ragged, check_tensor
from .dependent_launch import after_previous, launch_options
from .one_row_commit import commits, rows_to_roll
from .rounding import cast_rtne
from .runtime import interpreting

DTYPES = (torch.float32, torch.bfloat16)
NUM_WARPS = 4


def _block_c(channels: int) -> int:
    """Channels per program of the window updates: at most 256 (a conv_dim of 8192 gives 32 programs
    per sequence)."""
    return min(256, triton.next_power_of_2(channels))


# conv_rows: channels per program, and its warps (a 128-channel row is 4 channels a thread). Each
# program walks a run of its sequence's rows in order, so every input row is read once, plus the
# W-1 before a run. A batch of few sequences splits each sequence's rows into runs, up to
# CONV_MAX_RUNS and about CONV_TARGET_PROGRAMS programs in all (`conv_runs`): one sequence's walk
# of K + 1 rows was the conv's whole latency at batch 1 on 64 programs. H200, 2B GDN conv (8192
# channels, bf16): several runs make one sequence's walk faster, but with several runs at more
# sequences (8 or 64 x 9 rows) it is slower, so a batch whose sequences fill the GPU walks each in one run, as a decode always does.
CONV_BLOCK_C, CONV_NUM_WARPS = 128, 1
CONV_MAX_RUNS, CONV_TARGET_PROGRAMS = 4, 256
MAX_WIDTH = 4  # conv_rows keeps the W-1 inputs before a row in registers: at most three


def conv_runs(rows: int, sequences: int, channels: int) -> int:
    """Runs a sequence of conv_rows' grid for a batch of `rows` rows in `sequences` sequences of
    `channels` channels (graph buckets: their shape): at most the mean rows a sequence and
    CONV_MAX_RUNS, and no more than keep the grid near CONV_TARGET_PROGRAMS. Which program
    computes a row never changes its bits (DESIGN.md section 6, "The short conv")."""
    programs = max(1, sequences) * triton.cdiv(channels, _conv_block_c(channels))
    return max(1, min(CONV_MAX_RUNS, triton.cdiv(rows, max(1, sequences)), CONV_TARGET_PROGRAMS // programs))


def prefill_runs(rows: int, sequences: int, run_rows: int) -> int:
    """Runs a sequence of conv_rows' grid for a prefill of `rows` rows in `sequences` prompts, about
    `run_rows` rows a run: a power of two (a few compiled grids), at most PREFILL_MAX_RUNS. A long
    prompt walked in conv_runs' few runs is a walk of hundreds of rows a program; in runs of tens
    of rows every program is short and the grid fills the GPU, each run reading W-1 rows more."""
    if run_rows < 1:
        raise ValueError(f"prefill_runs: run_rows must be at least 1, got {run_rows}")
    per = triton.cdiv(rows, max(1, sequences))
    return min(PREFILL_MAX_RUNS, triton.next_power_of_2(max(1, triton.cdiv(per, run_rows))))


PREFILL_MAX_RUNS = 128


def _conv_block_c(channels: int) -> int:
    return min(CONV_BLOCK_C, triton.next_power_of_2(channels))


def _row_strided(inputs: torch.Tensor) -> torch.Tensor:
    """inputs [R, C] with each row's channels dense and rows at any stride, as they are (a column
    slice of a projection's output), else a dense copy: the kernels take the row stride."""
    return inputs if inputs.shape[1] <= 1 or inputs.stride(1) == 1 else inputs.contiguous()


@triton.jit
def _round_to(b_x, IS_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 b_x -> the nearest bf16 value (ties to even), held in fp32, where the inputs are bf16."""
    if IS_BF16:
        b_x = cast_rtne(b_x, tl.bfloat16, INTERPRET).to(tl.float32)
    return b_x


@triton.jit
def _program_sequence(seq_slots, cu_rows, C: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """A conv kernel's opening: what a program of grid (S, cdiv(C, BLOCK_C)) owns: its sequence i_s,
    that sequence's slot (int64) and first row (int32, as cu_rows holds it), and its channels o_c
    [BLOCK_C] with mask m_c. It first waits for the kernel before (after_previous, before any global
    memory is touched: kernels/dependent_launch.py)."""
    after_previous(PDL)
    i_s = tl.program_id(0)
    i_c = tl.program_id(1)
    i_slot = tl.load(seq_slots + i_s).to(tl.int64)
    i_bos = tl.load(cu_rows + i_s)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C] channels
    return i_s, i_slot, i_bos, o_c, o_c < C


@triton.jit
def _earlier(BACK: tl.constexpr, b_x3, b_x2, b_x1, b_x0):
    """Of a row's inputs seq[t-3], seq[t-2], seq[t-1], seq[t], the one BACK rows before t."""
    if BACK == 3:
        return b_x3
    elif BACK == 2:
        return b_x2
    elif BACK == 1:
        return b_x1
    else:
        return b_x0


@triton.jit
def _input_before(inputs, p_window, i_bos, i_row_stride, i_t0, o_c, m_c, BACK: tl.constexpr, W: tl.constexpr):
    """seq[t0 - BACK] [BLOCK_C] fp32 of seq = window ++ inputs (t0 >= 0 a row of the sequence, whose
    first row is i_bos): an earlier input row, or the window's column W-1-BACK+t0; 0 past W (unused)."""
    if BACK <= W - 1:
        i_j = i_t0 - BACK  # >= -(W-1)
        p_x = tl.where(i_j >= 0, inputs + (i_bos + i_j) * i_row_stride + o_c, p_window + (W - 1 + i_j))
        return tl.load(p_x, mask=m_c, other=0.0).to(tl.float32)
    else:
        return tl.zeros(o_c.shape, dtype=tl.float32)


@triton.jit
def _tap_weight(weight, o_c, m_c, BACK: tl.constexpr, W: tl.constexpr):
    """weight[:, W-1-BACK] [BLOCK_C] fp32: the tap that multiplies the input BACK rows back; 0 past W."""
    if BACK <= W - 1:
        return tl.load(weight + o_c * W + (W - 1 - BACK), mask=m_c, other=0.0).to(tl.float32)
    else:
        return tl.zeros(o_c.shape, dtype=tl.float32)


@triton.jit(do_not_specialize=["scratch_slot"])  # its value (the pool's size, or -1) must not pick another compiled kernel
def _conv_rows_kernel(
    window, inputs, weight, seq_slots, cu_rows, out, i_row_stride, scratch_slot,
    C: tl.constexpr,
    W: tl.constexpr,
    IS_BF16: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_C: tl.constexpr,
    RUNS: tl.constexpr,
    PDL: tl.constexpr,
):
    # first (it calls after_previous: kernels/dependent_launch.py)
    i_s, i_slot, i_bos, o_c, m_c = _program_sequence(seq_slots, cu_rows, C, BLOCK_C, PDL)
    i_rows = tl.load(cu_rows + i_s + 1) - i_bos
    # this program's run of the sequence's rows: t0 .. t1 - 1, run program_id(2) of RUNS equal ones
    i_run_rows = tl.cdiv(i_rows, RUNS)
    i_t0 = tl.program_id(2) * i_run_rows
    i_t1 = tl.minimum(i_t0 + i_run_rows, i_rows)
    if i_t0 >= i_t1:
        # a padding sequence with no rows (graph buckets), or a run past the sequence's last row
        return
    i_bos = i_bos.to(tl.int64)
    p_window = window + i_slot * C * (W - 1) + o_c * (W - 1)  # [BLOCK_C]: this slot's window, column 0
    # seq[t0-3], seq[t0-2], seq[t0-1] (seq = window ++ inputs): the window's columns for row 0
    b_x3 = _input_before(inputs, p_window, i_bos, i_row_stride, i_t0, o_c, m_c, 3, W)
    b_x2 = _input_before(inputs, p_window, i_bos, i_row_stride, i_t0, o_c, m_c, 2, W)
    b_x1 = _input_before(inputs, p_window, i_bos, i_row_stride, i_t0, o_c, m_c, 1, W)
    b_w3 = _tap_weight(weight, o_c, m_c, 3, W)
    b_w2 = _tap_weight(weight, o_c, m_c, 2, W)
    b_w1 = _tap_weight(weight, o_c, m_c, 1, W)
    b_w0 = _tap_weight(weight, o_c, m_c, 0, W)
    p_row = inputs + (i_bos + i_t0) * i_row_stride + o_c  # [BLOCK_C]: row t's channels
    b_x0 = tl.load(p_row, mask=m_c, other=0.0).to(tl.float32)
    for i_t in range(i_t0, i_t1):
        # row t + 1 is loaded while row t is computed (the run's last row loads itself again, unused)
        b_next = tl.load(p_row + tl.where(i_t + 1 < i_t1, i_row_stride, 0), mask=m_c, other=0.0).to(tl.float32)
        # taps left to right (j = 0 first: the input W-1 rows back), each product and sum rounded
        b_acc = _round_to(_earlier(W - 1, b_x3, b_x2, b_x1, b_x0) * _earlier(W - 1, b_w3, b_w2, b_w1, b_w0), IS_BF16, INTERPRET)
        for j in tl.static_range(1, W):
            b_prod = _earlier(W - 1 - j, b_x3, b_x2, b_x1, b_x0) * _earlier(W - 1 - j, b_w3, b_w2, b_w1, b_w0)
            b_acc = _round_to(b_acc + _round_to(b_prod, IS_BF16, INTERPRET), IS_BF16, INTERPRET)
        b_out = _round_to(b_acc / (1.0 + tl.exp(-b_acc)), IS_BF16, INTERPRET)  # SiLU in fp32
        tl.store(out + (i_bos + i_t) * C + o_c, b_out.to(out.dtype.element_ty), mask=m_c)
        b_x3, b_x2, b_x1, b_x0 = b_x2, b_x1, b_x0, b_next
        p_row += i_row_stride  # past the last row it is never read
    if commits(i_rows, i_slot, scratch_slot):
        # a one-row verify commits its row (kernels/one_row_commit.py; its one run is run 0): the
        # window becomes the W-1 inputs before the next row, column W-2 the newest (the values as
        # loaded: exact)
        tl.debug_barrier()  # every read of the old window lands before it is overwritten
        for c in tl.static_range(W - 1):
            b_col = _earlier(W - 1 - c, b_x3, b_x2, b_x1, b_x0)
            tl.store(p_window + c, b_col.to(window.dtype.element_ty), mask=m_c)


@triton.jit
def shift_window(window, inputs, i_row_stride, i_slot, i_bos, i_n, o_c, m_c, C: tl.constexpr, W: tl.constexpr,
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
    # first (it calls after_previous: kernels/dependent_launch.py)
    i_s, i_slot, i_bos, o_c, m_c = _program_sequence(seq_slots, cu_rows, C, BLOCK_C, PDL)
    i_bos = i_bos.to(tl.int64)
    i_n = rows_to_roll(cu_rows, consumed, i_s).to(tl.int64)
    if i_n == 0:
        # a padding sequence (graph buckets), or one row, which conv_rows committed: not read nor written
        return
    shift_window(window, inputs, i_row_stride, i_slot, i_bos, i_n, o_c, m_c, C, W, BLOCK_W)


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
              cu_rows: torch.Tensor, out: torch.Tensor | None = None, scratch_slot: int | None = None,
              runs: int | None = None) -> torch.Tensor:
    """Short conv + SiLU of every row of a ragged batch -> out [R, C] (inputs' dtype). window is
    written only for one-row sequences (their row is committed), except in scratch_slot (None: no
    slot is exempt).

    out: an optional contiguous [R, C] buffer to write into; it is returned.
    runs: programs a sequence's rows are split between (None: `conv_runs` of the batch's shape);
    the same bits for any."""
    op = "conv_rows"
    _check(op, window, inputs, seq_slots, cu_rows)
    rows, channels = inputs.shape
    check_tensor(op, "weight", weight, (channels, window.shape[2] + 1), inputs.dtype, ("inputs", inputs), layout="[C, W]")
    if weight.shape[1] > MAX_WIDTH:
        raise ValueError(f"{op}: a conv of width {weight.shape[1]}; the kernel holds at most {MAX_WIDTH - 1} earlier rows")
    if out is None:
        out = torch.empty_like(inputs, memory_format=torch.contiguous_format)
    else:
        check_tensor(op, "out", out, inputs.shape, inputs.dtype, ("inputs", inputs), layout="[R, C]", contiguous=True)
    n_seqs = seq_slots.shape[0]
    if n_seqs == 0 or rows == 0:
        return out
    block_c = _conv_block_c(channels)
    inputs = _row_strided(inputs)
    runs = conv_runs(rows, n_seqs, channels) if runs is None else runs
    if runs < 1:
        raise ValueError(f"{op}: runs must be at least 1, got {runs}")
    _conv_rows_kernel[(n_seqs, triton.cdiv(channels, block_c), runs)](
        window, inputs, weight.contiguous(), seq_slots, cu_rows, out, inputs.stride(0), -1 if scratch_slot is None else scratch_slot,
        C=channels, W=weight.shape[1], IS_BF16=inputs.dtype == torch.bfloat16, INTERPRET=interpreting(), BLOCK_C=block_c,
        RUNS=runs, num_warps=CONV_NUM_WARPS, num_stages=1, enable_fp_fusion=False, **launch_options(inputs.device),
    )
    return out


def next_window(window: torch.Tensor, inputs: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor,
                consumed: torch.Tensor) -> None:
    """In place: window[slot] = last W-1 of (window[slot] ++ the first consumed[s] input rows of s).

    consumed[s] = 0, or s of one row (conv_rows committed it), leaves window[slot] untouched;
    consumed[s] in 0 .. rows of s is not checked (that would sync the device)."""
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
                  cu_rows: torch.Tensor, out: torch.Tensor | None = None, scratch_slot: int | None = None,
                  runs: int | None = None) -> torch.Tensor:
    """conv_rows in torch, each sequence's rows one at a time: what the CPU reference backend runs
    (verifier.model.layers.linear_attention). A one-row sequence outside scratch_slot commits its row.
    runs: conv_rows' split of a sequence's rows, taken for its signature (a split changes no value;
    the reference walks each sequence whole)."""
    width = weight.shape[1]
    if out is None:
        out = torch.empty_like(inputs, memory_format=torch.contiguous_format)
    bounds = cu_rows.tolist()
    for s, slot in enumerate(seq_slots.tolist()):
        seq = torch.cat((window[slot].t().to(inputs.dtype), inputs[bounds[s] : bounds[s + 1]]), dim=0)  # [W-1+n, C]
        for t in range(bounds[s + 1] - bounds[s]):
            out[bounds[s] + t] = causal_conv_row(seq[t : t + width], weight)[0]
        if bounds[s + 1] - bounds[s] == 1 and slot != scratch_slot:
            window[slot] = seq[1:].t().to(window.dtype)
    return out


def next_window_ref(window: torch.Tensor, inputs: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor,
                    consumed: torch.Tensor) -> None:
    """next_window in torch: the CPU reference backend's rollback and commit (verifier.model.rollback)."""
    keep = window.shape[2]
    bounds = cu_rows.tolist()
    for s, (slot, n) in enumerate(zip(seq_slots.tolist(), consumed.tolist())):
        if n == 0 or bounds[s + 1] - bounds[s] == 1:  # padding, or one row, which conv_rows_ref committed
            continue
        seq = torch.cat((window[slot], inputs[bounds[s] : bounds[s] + n].t().to(window.dtype)), dim=1)  # [C, W-1+n]
        window[slot] = seq[:, seq.shape[1] - keep :]
