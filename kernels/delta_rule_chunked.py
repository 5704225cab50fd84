"""Prefill's gated delta rule for GDN (one decay per head and row) in chunked (WY) form: each
sequence's rows in sub-chunks of CHUNK rows at absolute multiples of CHUNK, committing each
sequence's state after its last row as `delta_rule_verify(..., commit=True)` does. Two launches:
`_chunk_prep_kernel` computes what does not depend on the incoming state, for every sub-chunk of
the batch at once; `_chunk_walk_kernel` then walks each sequence's sub-chunks in order, three
matrix products each. KDA (a decay per key channel) is not handled: its prefill walks rows.
The serial rule and its conventions: DESIGN.md section 6, "The gated delta rule".
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .checks import check_ragged, check_tensor
from .delta_rule import check_state_rows, state_tile
from .dependent_launch import after_previous, launch_options
from .rounding import cast_rtne
from .runtime import interpreting

CHUNK = 64  # rows of a sub-chunk: the prep kernel's [CHUNK, CHUNK] tiles (A, T, the decay ratios) live in registers
MIN_DOT = 16  # tl.dot needs every dimension >= 16: D_K, D_V and the chunk are padded up to it
# The prep kernel holds [CHUNK, CHUNK] and [CHUNK, D_K] fp32 tiles in one program's registers, and
# each of its [CHUNK, CHUNK] products is CHUNK^3 fused multiply-adds unrolled over its threads.
MAX_CHUNK = 64
_MAX_LEVELS = tl.constexpr(MAX_CHUNK.bit_length() - 1)  # _invert_unit_lower's doublings cover MAX_CHUNK rows
MAX_BLOCK_V = 32  # default value columns a walk program: a [D_K, 32] fp32 state tile, as the serial kernel's wide tile
NUM_WARPS = 4  # the walk's default; neither kernel's bits depend on num_warps
PREP_NUM_WARPS = 8  # the prep kernel's default: it holds five [CHUNK, D_K] tiles (keys, queries, values, W, U) at once

# The products' precision, the same in both kernels: "ieee" (fp32 sums, one ordered sum an element:
# no bit depends on BLOCK_V or num_warps; compiled for sm_90 they are multiply-add loops that spill
# to local memory), or "tf32x3" (three tf32 MMAs a product, near fp32; the MMA instruction follows
# the launch's warps, so which launches agree bitwise is not shown). Either way a prefill's bits
# follow from its rows alone under the pinned launch. `python -m bench.prefill --chunked-delta-rule
# --chunked-precision tf32x3` times the other.
DOT_PRECISION = "ieee"

# No pointer is specialised on its alignment (as the serial kernel's): the same compiled kernels for any view.
_NO_ALIGNMENT = ["state", "query", "key", "value", "decay", "beta", "table", "w", "u", "q0", "o0", "scales", "out"]


def chunk_table(starts: Sequence[int], counts: Sequence[int], chunk: int) -> torch.Tensor:
    """The sub-chunks of a ragged batch, on the host: int32 [n_sub, 3] on the CPU, one row a
    sub-chunk (sequence index, its first row's index in the batch, its rows), sequence by sequence
    in order. starts: each sequence's absolute position of its first row; counts: its rows (0: a
    padding sequence, which has no sub-chunk). Sub-chunks end at absolute multiples of `chunk`, the
    chunk the launch is given. The prep kernel's grid is this table's length, so the table must be
    known on the host: a caller builds it once a batch from the host's starts and counts and moves
    it to the device once, for every layer's launch."""
    if len(starts) != len(counts):
        raise ValueError(f"chunk_table: {len(starts)} starts for {len(counts)} sequences")
    subs, first = [], 0
    for s, (start, n) in enumerate(zip(starts, counts)):
        if start < 0 or n < 0:
            raise ValueError(f"chunk_table: sequence {s} has start {start}, {n} rows: both must be >= 0")
        r = 0
        while r < n:
            m = min(n - r, chunk - (start + r) % chunk)  # up to the next multiple of chunk, absolute
            subs.append((s, first + r, m))
            r += m
        first += n
    return torch.tensor(subs, dtype=torch.int32).reshape(-1, 3)


@triton.jit
def _log_decays(b_decay, o_c, CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """[CHUNK] decays -> L [CHUNK]: the sum of log(decay) over the sub-chunk's rows up to each row,
    a decay of 0 counted as 1; and Z [CHUNK]: how many decays of exactly 0 up to each row (0., 1.,
    ... in fp32, exact). A zero decay resets the state, which log space cannot say (-inf - -inf is
    NaN): it is carried by Z instead, and a row's products reach back only to rows of the same Z.
    Both cumulative sums are one tl.dot with a lower-triangular matrix of ones: an ordered sum
    (row 0's term first), whatever the register layout."""
    b_zero = b_decay == 0.0
    b_log = tl.where(b_zero, 0.0, tl.log(tl.where(b_zero, 1.0, b_decay)))
    o_2 = tl.arange(0, 16)  # two used columns, padded to tl.dot's 16
    b_x = tl.where(o_2[None, :] == 0, b_log[:, None], tl.where(o_2[None, :] == 1, b_zero.to(tl.float32)[:, None], 0.0))
    b_ones = tl.where(o_c[:, None] >= o_c[None, :], 1.0, 0.0)  # [CHUNK, CHUNK]: row i sums rows 0 .. i
    b_cum = tl.dot(b_ones, b_x, input_precision=PRECISION)  # [CHUNK, 16]
    # one column each: a sum of one value and zeros, exact in any order
    b_l = tl.sum(tl.where(o_2[None, :] == 0, b_cum, 0.0), axis=1)
    b_z = tl.sum(tl.where(o_2[None, :] == 1, b_cum, 0.0), axis=1)
    return b_l, b_z


@triton.jit
def _invert_unit_lower(b_a, o_c, CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """T = (I + A)^-1 of a strictly lower-triangular [CHUNK, CHUNK] A, in blocks: T_s, the inverse
    of I + A's diagonal blocks of s rows, gives T_2s = T_s - (T_s A_s) T_s, where A_s holds A's
    entries in the lower-left quarter of each diagonal block of 2s rows (the block inverse
    [[T11, 0], [-T22 A21 T11, T22]]); T_1 = I, so T_2 = I - A_1. This is forward substitution by
    blocks, each new block solved from the finished ones, not a power series of A: no intermediate
    grows past the products of T's and A's own entries. log2(CHUNK) - 1 doublings of two tl.dots
    (ordered sums); outside the new quarters the product is exactly 0, so those entries of T_s
    carry over unchanged. Rows and columns of A that are 0 (a sub-chunk's padded rows) leave e_i
    in T."""
    b_t = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0) - tl.where(o_c[:, None] // 2 == o_c[None, :] // 2, b_a, 0.0)
    for i in tl.static_range(1, _MAX_LEVELS):  # the finished blocks have 1 << i rows, the new ones 2 << i
        if (2 << i) <= CHUNK:
            m_quarter = (o_c[:, None] // (2 << i) == o_c[None, :] // (2 << i)) & ((o_c[:, None] >> i) % 2 == 1) \
                & ((o_c[None, :] >> i) % 2 == 0)
            b_ta = tl.dot(b_t, tl.where(m_quarter, b_a, 0.0), input_precision=PRECISION)  # T_s A_s
            b_t = b_t - tl.dot(b_ta, b_t, input_precision=PRECISION)
    return b_t


# No row count is a kernel argument (the table and cu_rows are read on the device, as starts are),
# so no integer argument needs do_not_specialize: every batch runs the one kernel of its head shape.
@triton.jit(do_not_specialize_on_alignment=_NO_ALIGNMENT)
def _chunk_prep_kernel(
    query, key, value, decay, beta, table, w, u, q0, o0, scales,
    H: tl.constexpr,
    D_K: tl.constexpr,
    D_V: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PDL: tl.constexpr,
    PRECISION: tl.constexpr = "ieee",
):
    """One program per (sub-chunk, head): table row i_c's n <= CHUNK rows. With L_i the sum of the
    log decays of its rows up to i (_log_decays), g_i = exp(L_i) (0 from a zero decay on) and
    P[i, j] = exp(L_i - L_j) for j <= i (0 above the diagonal and across a zero decay), a
    sub-chunk applied to a state S0 gives
        A = strictly lower (beta_i P[i, j] k_i . k_j),  T = (I + A)^-1
        Delta = T diag(beta) (V - diag(g) K S0) = U - W S0,  W = T diag(beta g) K,  U = T diag(beta) V
        out = diag(g) Q S0 + M Delta = Q0 S0 + O0,  M = P o (Q K^T),  Q0 = diag(g) Q - M W,  O0 = M U
        S_end = g_{n-1} S0 + K^T diag(p) Delta,  p = P[n - 1, :]
    This kernel stores per row W, U, Q0, O0 (all value columns) and (g, p), everything but the
    products with S0, which the walk does. Every sum over D_K or over the sub-chunk's rows is a
    tl.dot (fp32, ieee: one ordered sum an element): no value's bits depend on num_warps, the grid
    or the other sub-chunks. Rows past n load as zero (key, query, value, beta; decay 1): their
    rows and columns of A are 0, their rows of T are e_i, so they add exact zeros to the valid rows."""
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_first = tl.load(table + i_c * 3 + 1)
    i_n = tl.load(table + i_c * 3 + 2)
    o_c = tl.arange(0, CHUNK)  # a row's place in its sub-chunk
    o_k = tl.arange(0, BLOCK_K)
    o_dv = tl.arange(0, BLOCK_DV)  # every value column: U and O0 are the walk's for any BLOCK_V
    m_c = o_c < i_n
    m_ck = m_c[:, None] & (o_k < D_K)[None, :]
    m_cv = m_c[:, None] & (o_dv < D_V)[None, :]
    i_rh = (i_first.to(tl.int64) + o_c) * H + i_h  # [CHUNK] each row's head
    p_ck = i_rh[:, None] * D_K + o_k[None, :]
    p_cv = i_rh[:, None] * D_V + o_dv[None, :]
    b_k = tl.load(key + p_ck, mask=m_ck, other=0.0)  # [CHUNK, BLOCK_K]
    b_q = tl.load(query + p_ck, mask=m_ck, other=0.0)
    b_v = tl.load(value + p_cv, mask=m_cv, other=0.0)  # [CHUNK, BLOCK_DV]
    b_decay = tl.load(decay + i_rh, mask=m_c, other=1.0)  # [CHUNK] (GDN: one a head)
    b_beta = tl.load(beta + i_rh, mask=m_c, other=0.0)

    b_l, b_z = _log_decays(b_decay, o_c, CHUNK, PRECISION)
    # the mask before exp: above the diagonal L_i - L_j > 0 may overflow, and across a zero decay
    # the ratio is 0 (the state was reset between j and i)
    m_p = (o_c[:, None] >= o_c[None, :]) & (b_z[:, None] == b_z[None, :])
    b_p = tl.where(m_p, tl.exp(tl.where(m_p, b_l[:, None] - b_l[None, :], 0.0)), 0.0)  # [CHUNK, CHUNK]
    b_g = tl.where(b_z == 0.0, tl.exp(b_l), 0.0)  # [CHUNK] S0's share at each row: 0 after a zero decay

    b_kk = tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)  # [CHUNK, CHUNK] k_i . k_j
    b_a = tl.where(o_c[:, None] > o_c[None, :], b_beta[:, None] * b_p * b_kk, 0.0)
    b_t = _invert_unit_lower(b_a, o_c, CHUNK, PRECISION)
    b_w = tl.dot(b_t, (b_beta * b_g)[:, None] * b_k, input_precision=PRECISION)  # [CHUNK, BLOCK_K]
    b_u = tl.dot(b_t, b_beta[:, None] * b_v, input_precision=PRECISION)  # [CHUNK, BLOCK_DV]
    b_m = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * b_p  # [CHUNK, CHUNK], 0 above the diagonal
    b_q0 = b_g[:, None] * b_q - tl.dot(b_m, b_w, input_precision=PRECISION)
    b_o0 = tl.dot(b_m, b_u, input_precision=PRECISION)
    # padded rows have log decay 0 and no zero, so row CHUNK - 1 of P is row n - 1's on the valid
    # columns; picking it is a sum of one value and zeros
    b_p_end = tl.sum(tl.where(o_c[:, None] == CHUNK - 1, b_p, 0.0), axis=0)  # [CHUNK] P[n - 1, j]

    tl.store(w + p_ck, b_w, mask=m_ck)
    tl.store(q0 + p_ck, b_q0, mask=m_ck)
    tl.store(u + p_cv, b_u, mask=m_cv)
    tl.store(o0 + p_cv, b_o0, mask=m_cv)
    tl.store(scales + i_rh * 2, b_g, mask=m_c)
    tl.store(scales + i_rh * 2 + 1, b_p_end, mask=m_c)


@triton.jit(do_not_specialize_on_alignment=_NO_ALIGNMENT)
def _chunk_walk_kernel(
    state, key, seq_slots, cu_rows, starts, w, u, q0, o0, scales, out,
    H: tl.constexpr,
    D_K: tl.constexpr,
    D_V: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    INTERPRET: tl.constexpr,  # the interpreter truncates fp32 -> bf16: out is rounded on the bits first there
    PDL: tl.constexpr,
    PRECISION: tl.constexpr = "ieee",
):
    """One program per (sequence, head, BLOCK_V value columns): the slot's [D_K, BLOCK_V] state tile
    in registers, the sequence's sub-chunks in order, each from the prep kernel's rows (its
    docstring has the formulas):
        Delta = U - W S0,  out = Q0 S0 + O0,  S = g_{n-1} S0 + K^T diag(p) Delta
    three tl.dots, two of them of S0 alone: the state's chain is two dependent products a
    sub-chunk. The sub-chunks are derived from starts and cu_rows as chunk_table derives them (the
    same rows the prep kernel wrote). The sums over D_K and over the sub-chunk's rows are whole
    tl.dots (fp32, ieee): none is cut by BLOCK_V, so no value's bits depend on BLOCK_V or num_warps.
    Rows past n load as zero (W, U, Q0, O0, key, p): they add exact zeros to the state."""
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_s = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    i_bos = tl.load(cu_rows + i_s)
    i_rows = tl.load(cu_rows + i_s + 1) - i_bos
    if i_rows == 0:
        # a padding sequence: no state tile is read, nothing is stored
        return
    i_slot = tl.load(seq_slots + i_s).to(tl.int64)
    i_off = tl.load(starts + i_s) % CHUNK  # row 0's place in its sub-chunk: its first sub-chunk is CHUNK - i_off rows

    o_k, o_v, m_k, m_v, m_s, o_s = state_tile(i_v, D_K, D_V, BLOCK_K, BLOCK_V)
    p_state = state + (i_slot * H + i_h) * (D_K * D_V) + o_s
    b_s = tl.load(p_state, mask=m_s, other=0.0)  # padded lanes are 0 and stay 0
    o_c = tl.arange(0, CHUNK)  # a row's place in its sub-chunk

    for i_c in range(0, (i_off + i_rows + CHUNK - 1) // CHUNK):
        i_lo = tl.maximum(i_c * CHUNK - i_off, 0)  # the sub-chunk's rows i_lo .. i_lo + i_n - 1 of the sequence
        i_n = tl.minimum((i_c + 1) * CHUNK - i_off, i_rows) - i_lo
        m_c = o_c < i_n
        i_first = (i_bos + i_lo).to(tl.int64)
        i_rh = (i_first + o_c) * H + i_h  # [CHUNK] each row's head
        m_ck = m_c[:, None] & m_k[None, :]
        m_cv = m_c[:, None] & m_v[None, :]
        p_ck = i_rh[:, None] * D_K + o_k[None, :]
        p_cv = i_rh[:, None] * D_V + o_v[None, :]
        b_w = tl.load(w + p_ck, mask=m_ck, other=0.0)  # [CHUNK, BLOCK_K]
        b_q0 = tl.load(q0 + p_ck, mask=m_ck, other=0.0)
        b_k = tl.load(key + p_ck, mask=m_ck, other=0.0)
        b_u = tl.load(u + p_cv, mask=m_cv, other=0.0)  # [CHUNK, BLOCK_V]
        b_o0 = tl.load(o0 + p_cv, mask=m_cv, other=0.0)
        b_p_end = tl.load(scales + i_rh * 2 + 1, mask=m_c, other=0.0)  # [CHUNK] P[n - 1, j]
        b_g_end = tl.load(scales + ((i_first + i_n - 1) * H + i_h) * 2)  # g_{n-1}

        b_delta = b_u - tl.dot(b_w, b_s, input_precision=PRECISION)  # [CHUNK, BLOCK_V]
        b_o = tl.dot(b_q0, b_s, input_precision=PRECISION) + b_o0
        tl.store(out + p_cv, cast_rtne(b_o, out.dtype.element_ty, INTERPRET), mask=m_cv)
        b_s = b_g_end * b_s + tl.dot(tl.trans(b_k), b_delta * b_p_end[:, None], input_precision=PRECISION)

    tl.store(p_state, b_s, mask=m_s)  # prefill commits: the state after the sequence's last row


def _check(op: str, state: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           decay: torch.Tensor, beta: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor,
           starts: torch.Tensor, out: torch.Tensor | None, chunk: int, block_v: int | None,
           table: torch.Tensor | None, launch: bool) -> None:
    """Shapes, dtypes and devices of what the launcher and the reference take (launch: the Triton
    kernels', which also need a launchable state). Row bounds, slots, starts and the table's rows
    live on the device and are not checked (that would sync)."""
    rows, heads, d_k, d_v = check_state_rows(op, state, key, value, launch=launch)
    f32, on_state = torch.float32, ("state", state)
    check_tensor(op, "query", query, (rows, heads, d_k), f32, on_state, layout="[R, H, D_K]")
    if decay.dim() == 3 and decay.shape[:2] == key.shape[:2] and decay.shape[2] == d_k != 1:
        raise ValueError(f"{op}: decay [R, H, D_K={d_k}] is KDA's per-channel decay; the chunked form is GDN's "
                         f"(decay [R, H, 1]): KDA prefill walks rows (delta_rule_verify, commit=True)")
    check_tensor(op, "decay", decay, (rows, heads, 1), f32, on_state, layout="[R, H, 1]")
    check_tensor(op, "beta", beta, (rows, heads), f32, on_state, layout="[R, H]")
    check_ragged(op, seq_slots, cu_rows, on_state)
    check_tensor(op, "starts", starts, seq_slots.shape, torch.int32, on_state, layout="[S]")
    if out is not None:
        out_dtype = torch.bfloat16 if out.dtype == torch.bfloat16 else torch.float32
        check_tensor(op, "out", out, (rows, heads, d_v), out_dtype, on_state, layout="[R, H, D_V]", contiguous=True)
    if table is not None:
        if table.dim() != 2 or table.shape[1] != 3:
            raise ValueError(f"{op}: table must be 2-D [n_sub, 3] (chunk_table's), got shape {list(table.shape)}")
        check_tensor(op, "table", table, table.shape, torch.int32, on_state, layout="[n_sub, 3]", contiguous=True)
    if not (MIN_DOT <= chunk <= MAX_CHUNK and chunk & (chunk - 1) == 0):
        raise ValueError(f"{op}: chunk {chunk} must be a power of two in {MIN_DOT} .. {MAX_CHUNK} "
                         f"(tl.dot's least dimension; [chunk, chunk] tiles in registers)")
    if block_v is not None and not (block_v >= MIN_DOT and block_v & (block_v - 1) == 0):
        raise ValueError(f"{op}: block_v {block_v} must be a power of two >= {MIN_DOT} (tl.dot's least dimension)")


def delta_rule_chunked(state: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       decay: torch.Tensor, beta: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor,
                       starts: torch.Tensor, out: torch.Tensor | None = None, *, chunk: int = CHUNK,
                       block_v: int | None = None, num_warps: int | None = None,
                       table: torch.Tensor | None = None) -> torch.Tensor:
    """Every row of a ragged batch through the GDN delta rule from its slot's state, in sub-chunks
    of `chunk` rows -> out [R, H, D_V]; each sequence with rows stores its state after its last row
    into state[seq_slots[s]] (prefill's commit). Arguments as delta_rule_verify's, with decay
    [R, H, 1] only (GDN) and starts int32 [S]: the absolute position (>= 0) of each sequence's first
    row, which places the sub-chunk boundaries at multiples of `chunk`. A zero-row sequence is
    padding: nothing is read or stored. out: an optional contiguous [R, H, D_V] fp32 or bf16 buffer
    (bf16: each value rounded once to nearest even); it is returned. block_v (value columns a walk
    program, a power of two >= 16) and num_warps (both kernels') change no bit of the result.
    table: chunk_table(starts, counts, chunk) of this batch, on the state's device (not checked
    against starts and cu_rows: that would sync); None builds it here from starts and cu_rows with
    .tolist(), a host sync a call. Scratch of R x H x (2 D_K + 2 D_V + 2) fp32 is allocated a call."""
    op = "delta_rule_chunked"
    _check(op, state, query, key, value, decay, beta, seq_slots, cu_rows, starts, out, chunk, block_v, table,
           launch=True)
    rows, heads, d_k = key.shape
    d_v = state.shape[3]
    if out is None:
        out = torch.empty(rows, heads, d_v, dtype=torch.float32, device=state.device)
    n_seqs = seq_slots.shape[0]
    if n_seqs == 0 or rows == 0:
        return out
    if table is None:
        bounds = cu_rows.tolist()
        counts = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
        table = chunk_table(starts.tolist(), counts, chunk).to(state.device)
    query, key, value, decay, beta = (x.contiguous() for x in (query, key, value, decay, beta))
    f32 = dict(dtype=torch.float32, device=state.device)
    w, q0 = torch.empty(rows, heads, d_k, **f32), torch.empty(rows, heads, d_k, **f32)
    u, o0 = torch.empty(rows, heads, d_v, **f32), torch.empty(rows, heads, d_v, **f32)
    scales = torch.empty(rows, heads, 2, **f32)  # per row: g, and its decay to its sub-chunk's last row
    block_k = max(MIN_DOT, triton.next_power_of_2(d_k))
    if table.shape[0]:
        _chunk_prep_kernel[(table.shape[0], heads)](
            query, key, value, decay, beta, table, w, u, q0, o0, scales,
            H=heads, D_K=d_k, D_V=d_v, CHUNK=chunk, BLOCK_K=block_k, BLOCK_DV=max(MIN_DOT, triton.next_power_of_2(d_v)),
            PRECISION=DOT_PRECISION, num_warps=num_warps or PREP_NUM_WARPS, num_stages=1, enable_fp_fusion=False,
            **launch_options(state.device),
        )
    block_v = block_v or min(MAX_BLOCK_V, max(MIN_DOT, triton.next_power_of_2(d_v)))
    _chunk_walk_kernel[(n_seqs, heads, triton.cdiv(d_v, block_v))](
        state, key, seq_slots, cu_rows, starts, w, u, q0, o0, scales, out,
        H=heads, D_K=d_k, D_V=d_v, CHUNK=chunk, BLOCK_K=block_k, BLOCK_V=block_v, INTERPRET=interpreting(),
        PRECISION=DOT_PRECISION, num_warps=num_warps or NUM_WARPS, num_stages=1, enable_fp_fusion=False, **launch_options(state.device),
    )
    return out


def _chunk_ref(s0: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
               beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sub-chunk of n rows, all heads: s0 [H, D_K, D_V]; q, k [H, n, D_K]; v [H, n, D_V]; decay,
    beta [H, n] -> (out [H, n, D_V], the state after row n - 1): the prep kernel's formulas in
    torch, in one pass (Delta from S0 first)."""
    n = k.shape[1]
    zero = decay == 0
    log_decay = torch.where(zero, 0.0, torch.log(torch.where(zero, 1.0, decay)))
    l, z = log_decay.cumsum(-1), zero.cumsum(-1)  # a zero decay: counted in z, not in l (see _log_decays)
    i = torch.arange(n, device=k.device)
    mask = (i[:, None] >= i[None, :]) & (z[..., :, None] == z[..., None, :])
    p = torch.where(mask, torch.exp(torch.where(mask, l[..., :, None] - l[..., None, :], 0.0)), 0.0)  # [H, n, n]
    g = torch.where(z == 0, l.exp(), 0.0)  # [H, n]
    a = torch.where(i[:, None] > i[None, :], beta[..., :, None] * p * (k @ k.mT), 0.0)
    eye = torch.eye(n, dtype=k.dtype, device=k.device).expand_as(a)
    t = torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)  # (I + A)^-1
    delta = t @ (beta[..., None] * (v - g[..., None] * (k @ s0)))  # [H, n, D_V]
    out = g[..., None] * (q @ s0) + ((q @ k.mT) * p) @ delta
    return out, g[:, -1, None, None] * s0 + k.mT @ (delta * p[:, -1, :, None])


def delta_rule_chunked_ref(state: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           decay: torch.Tensor, beta: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor,
                           starts: torch.Tensor, out: torch.Tensor | None = None, *, chunk: int = CHUNK,
                           block_v: int | None = None, num_warps: int | None = None,
                           table: torch.Tensor | None = None) -> torch.Tensor:
    """delta_rule_chunked in torch (the CPU backend's): the same sub-chunks and formulas in one pass
    a sub-chunk, each sum in torch's order, so it agrees with the kernels to fp32 rounding, not
    bitwise. block_v, num_warps and table: taken for the launcher's signature (the sub-chunks are
    derived from starts and cu_rows here; none of them changes a value)."""
    _check("delta_rule_chunked", state, query, key, value, decay, beta, seq_slots, cu_rows, starts, out, chunk,
           block_v, table, launch=False)
    rows, heads, d_v = value.shape
    if out is None:
        out = torch.empty(rows, heads, d_v, dtype=torch.float32, device=state.device)
    bounds = cu_rows.tolist()
    for s, (slot, start) in enumerate(zip(seq_slots.tolist(), starts.tolist())):
        lo, hi = bounds[s], bounds[s + 1]
        if hi == lo:
            continue  # padding: nothing read, nothing stored
        s_state, r = state[slot], lo
        while r < hi:
            end = min(hi, r + chunk - (start + r - lo) % chunk)  # the next multiple of chunk, absolute
            o, s_state = _chunk_ref(s_state, *(x[r:end].transpose(0, 1) for x in (query, key, value)),
                                    decay[r:end, :, 0].T, beta[r:end].T)
            out[r:end] = o.transpose(0, 1).to(out.dtype)
            r = end
        state[slot] = s_state
    return out
