"""Causal attention of rows over their slot's KV cache: gated attention (GQA) and MLA (D_K != D_V).
The design in full: DESIGN.md section 6, "Attention".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_launchable, check_operand
from .dependent_launch import after_previous, launch_options
from .rounding import cast_rtne, round_to_bf16
from .runtime import interpreting

BLOCK_N = 64  # KV positions per step of the walk: pinned, never chosen from a length or row count
MIN_DOT = 16  # tl.dot needs every tile side >= 16 on the GPU
NUM_WARPS = 4
# Two stages: the next block's keys and values load while this block is multiplied. The same
# operations in the same order, so the same bits as one stage; on the H200 at the 2B model's shape
# (16 query heads, 2 kv heads, d 256) at every batch and position measured; three stages, 32 or
# 128 positions a block and 8 warps were slower or gave other bits. `python -m bench.gpu` times the
# steps this kernel is part of.
NUM_STAGES = 2
DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _walk_start(p_k, p_v, i_slot, i_kv_head, s_k_slot, s_k_head, s_v_slot, s_v_head, ROWS: tl.constexpr, BLOCK_DV: tl.constexpr):
    """A walk's kv head in its slot, and its online softmax's start for ROWS query rows:
    (keys' and values' head pointers, running max -inf, sum 0, accumulator 0)."""
    p_k_head = p_k + i_slot * s_k_slot + i_kv_head * s_k_head
    p_v_head = p_v + i_slot * s_v_slot + i_kv_head * s_v_head
    return (p_k_head, p_v_head, tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32),
            tl.zeros([ROWS, BLOCK_DV], tl.float32))


@triton.jit
def _walk_block(b_q, b_max, b_sum, b_acc, p_k_head, p_v_head, s_k_pos, s_v_pos, o_pos, m_load, m_seen, o_dk, o_dv, m_dk, m_dv,
                scale, IS_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """One block of a walk's online softmax: the BLOCK_N positions o_pos of one kv head (m_load: the
    positions loaded; the rest read 0, never the cache, which past them may hold anything, NaN),
    each query row seeing m_seen [rows, BLOCK_N] of them -> the running max, sum and accumulator."""
    p_k_tile = p_k_head + o_pos[:, None].to(tl.int64) * s_k_pos + o_dk[None, :]
    b_k = tl.load(p_k_tile, mask=m_load[:, None] & m_dk[None, :], other=0.0)  # [BLOCK_N, BLOCK_DK]
    if IS_BF16 and not INTERPRET:
        b_s = tl.dot(b_q, tl.trans(b_k))  # bf16 MMA, fp32 accumulate
    else:
        b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee")
    b_s = b_s * scale  # [rows, BLOCK_N] fp32
    b_s = tl.where(m_seen, b_s, float("-inf"))
    b_max_new = tl.maximum(b_max, tl.max(b_s, axis=1))
    b_rescale = tl.exp(b_max - b_max_new)  # [rows]
    b_p = tl.exp(b_s - b_max_new[:, None])  # [rows, BLOCK_N], 0 where hidden
    b_sum = b_sum * b_rescale + tl.sum(b_p, axis=1)
    p_v_tile = p_v_head + o_pos[:, None].to(tl.int64) * s_v_pos + o_dv[None, :]
    b_v = tl.load(p_v_tile, mask=m_load[:, None] & m_dv[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
    if not IS_BF16:
        b_pv = tl.dot(b_p, b_v, input_precision="ieee")
    elif INTERPRET:
        b_pv = tl.dot(round_to_bf16(b_p), b_v.to(tl.float32), input_precision="ieee")
    else:
        b_pv = tl.dot(b_p.to(tl.bfloat16), b_v)  # bf16 MMA, fp32 accumulate
    b_acc = b_acc * b_rescale[:, None] + b_pv
    return b_max_new, b_sum, b_acc


@triton.jit
def _finish(b_acc, b_sum, p_o_tile, p_g_tile, m_out, HAS_GATE: tl.constexpr, INTERPRET: tl.constexpr):
    """Store the walk's output acc / sum (times sigmoid(gate) with HAS_GATE) where m_out says."""
    b_out = b_acc / b_sum[:, None]
    DTYPE: tl.constexpr = p_o_tile.dtype.element_ty
    if HAS_GATE:  # out * sigmoid(gate), each rounded to the dtype as torch's two ops round
        b_out = cast_rtne(b_out, DTYPE, INTERPRET).to(tl.float32)
        b_g = tl.load(p_g_tile, mask=m_out, other=0.0).to(tl.float32)
        b_sigmoid = cast_rtne(tl.math.div_rn(1.0, 1.0 + tl.exp(-b_g)), DTYPE, INTERPRET).to(tl.float32)
        b_out = b_out * b_sigmoid
    tl.store(p_o_tile, cast_rtne(b_out, DTYPE, INTERPRET) if HAS_GATE else b_out.to(DTYPE), mask=m_out)


# A tensor of one row may carry any stride on its row dim (torch ignores it for size-1 dims), so
# the row strides must not select a specialisation: decode and verify compile the same kernel.
@triton.jit(do_not_specialize=["s_q_row", "s_o_row"])
def _attend_rows_kernel(
    p_q, p_k, p_v, p_slot, p_pos, p_o, p_g,
    s_q_row, s_q_head,  # query strides (last dim contiguous)
    s_k_slot, s_k_pos, s_k_head,
    s_v_slot, s_v_pos, s_v_head,
    s_o_row, s_o_head,
    s_g_row, s_g_head,
    scale,
    IS_BF16: tl.constexpr, INTERPRET: tl.constexpr, HAS_GATE: tl.constexpr,
    GROUP: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_row = tl.program_id(0).to(tl.int64)
    i_kv_head = tl.program_id(1)
    i_slot = tl.load(p_slot + i_row).to(tl.int64)
    i_pos = tl.load(p_pos + i_row)

    o_g = tl.arange(0, BLOCK_G)
    o_dk = tl.arange(0, BLOCK_DK)
    o_dv = tl.arange(0, BLOCK_DV)
    o_n = tl.arange(0, BLOCK_N)
    m_g = o_g < GROUP
    m_dk = o_dk < D_K
    m_dv = o_dv < D_V
    o_q_head = i_kv_head * GROUP + o_g  # [BLOCK_G] the query heads reading this kv head

    p_q_tile = p_q + i_row * s_q_row + o_q_head[:, None] * s_q_head + o_dk[None, :]
    b_q = tl.load(p_q_tile, mask=m_g[:, None] & m_dk[None, :], other=0.0)  # [BLOCK_G, BLOCK_DK] input dtype
    p_k_head, p_v_head, b_max, b_sum, b_acc = _walk_start(p_k, p_v, i_slot, i_kv_head, s_k_slot, s_k_head, s_v_slot, s_v_head,
                                                          BLOCK_G, BLOCK_DV)
    # Every block walked holds at least one visible position (block 0 holds position 0), so the
    # running max is finite after each step and exp never sees -inf - -inf.
    for i_block in range(0, i_pos // BLOCK_N + 1):
        o_pos = i_block * BLOCK_N + o_n  # [BLOCK_N]
        m_pos = o_pos <= i_pos
        b_max, b_sum, b_acc = _walk_block(b_q, b_max, b_sum, b_acc, p_k_head, p_v_head, s_k_pos, s_v_pos, o_pos, m_pos,
                                          m_pos[None, :], o_dk, o_dv, m_dk, m_dv, scale, IS_BF16, INTERPRET)
    m_out = m_g[:, None] & m_dv[None, :]
    p_o_tile = p_o + i_row * s_o_row + o_q_head[:, None] * s_o_head + o_dv[None, :]
    p_g_tile = p_g + i_row * s_g_row + o_q_head[:, None] * s_g_head + o_dv[None, :]
    _finish(b_acc, b_sum, p_o_tile, p_g_tile, m_out, HAS_GATE, INTERPRET)


def attend_rows(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row_slots: torch.Tensor,
                row_positions: torch.Tensor, scale: float, *, out: torch.Tensor | None = None,
                gate: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's query over positions 0 .. row_positions[i] of slot row_slots[i] -> [R, HQ, D_V]
    (times sigmoid(gate) with a gate)."""
    out = _check(query, keys, values, row_slots, row_positions, out, gate)
    check_launchable("attend_rows", "query", query)
    n_rows, n_heads, d_k = query.shape
    kv_heads, d_v = keys.shape[2], values.shape[3]
    if n_rows == 0:
        return out
    group = n_heads // kv_heads
    _attend_rows_kernel[(n_rows, kv_heads)](
        query, keys, values, row_slots, row_positions, out, gate if gate is not None else out,
        *_strides(query, keys, values, out, gate), float(scale),
        IS_BF16=query.dtype == torch.bfloat16, INTERPRET=interpreting(), HAS_GATE=gate is not None,
        GROUP=group, D_K=d_k, D_V=d_v,
        BLOCK_G=_block(group), BLOCK_DK=_block(d_k), BLOCK_DV=_block(d_v), BLOCK_N=BLOCK_N,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, **launch_options(query.device),
    )
    return out


# Prefill's tiles: TILE_M query-head rows (TILE_M // BLOCK_G rows of a sequence at consecutive
# positions, each with its BLOCK_G query heads of one kv head) walk the KV blocks together, so a
# block's keys and values are loaded once for all of them. Pinned, never chosen from a length.
TILE_M = 64
PREFILL_NUM_WARPS = 8  # a [64, 256] fp32 accumulator needs 8 warps' registers on a 256-wide head
PREFILL_NUM_STAGES = 2


def prefill_tile_rows(n_heads: int, kv_heads: int) -> int:
    """Query rows of one prefill tile for this head layout: the chunk of the tile table
    (verifier/model/rows.py RowBatch.chunk_table) that attend_prefill is given."""
    return max(1, TILE_M // triton.next_power_of_2(n_heads // kv_heads))


@triton.jit(do_not_specialize=["s_q_row", "s_o_row"])
def _attend_prefill_kernel(
    p_q, p_k, p_v, p_slot, p_pos, p_table, p_o, p_g,
    s_q_row, s_q_head,
    s_k_slot, s_k_pos, s_k_head,
    s_v_slot, s_v_pos, s_v_head,
    s_o_row, s_o_head,
    s_g_row, s_g_head,
    scale,
    IS_BF16: tl.constexpr, INTERPRET: tl.constexpr, HAS_GATE: tl.constexpr,
    GROUP: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
    BLOCK_G: tl.constexpr, ROWS: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_tile = tl.program_id(0)
    i_kv_head = tl.program_id(1)
    # the tile: rows i_first .. i_first + n_rows - 1 of one sequence, at consecutive positions
    i_first = tl.load(p_table + i_tile * 3 + 1).to(tl.int64)
    n_rows = tl.load(p_table + i_tile * 3 + 2)
    i_slot = tl.load(p_slot + i_first).to(tl.int64)
    i_pos0 = tl.load(p_pos + i_first)
    i_last = i_pos0 + n_rows - 1  # the tile's last visible position

    BLOCK_M: tl.constexpr = ROWS * BLOCK_G
    o_m = tl.arange(0, BLOCK_M)
    o_r = o_m // BLOCK_G  # the row of the tile
    o_g = o_m % BLOCK_G  # its query head within the group
    o_dk = tl.arange(0, BLOCK_DK)
    o_dv = tl.arange(0, BLOCK_DV)
    o_n = tl.arange(0, BLOCK_N)
    m_m = (o_r < n_rows) & (o_g < GROUP)
    m_dk = o_dk < D_K
    m_dv = o_dv < D_V
    b_row_pos = i_pos0 + o_r  # [BLOCK_M] each row's own position (past i_last for padding rows)
    o_row = i_first + o_r.to(tl.int64)
    o_q_head = i_kv_head * GROUP + o_g

    p_q_tile = p_q + o_row[:, None] * s_q_row + o_q_head[:, None] * s_q_head + o_dk[None, :]
    b_q = tl.load(p_q_tile, mask=m_m[:, None] & m_dk[None, :], other=0.0)  # [BLOCK_M, BLOCK_DK]
    p_k_head, p_v_head, b_max, b_sum, b_acc = _walk_start(p_k, p_v, i_slot, i_kv_head, s_k_slot, s_k_head, s_v_slot, s_v_head,
                                                          BLOCK_M, BLOCK_DV)
    # A row's walk is attend_rows' walk, blocks of BLOCK_N from position 0, continued to the tile's
    # last block: a block past the row's position holds no visible position for it, so its step
    # leaves the row's max (rescale exp(0) = 1), sum (+ 0) and accumulator (+ 0 v) unchanged. A
    # row's bits thus follow from its own position, whatever tile or batch it sits in.
    for i_block in range(0, i_last // BLOCK_N + 1):
        o_pos = i_block * BLOCK_N + o_n  # [BLOCK_N]
        b_max, b_sum, b_acc = _walk_block(b_q, b_max, b_sum, b_acc, p_k_head, p_v_head, s_k_pos, s_v_pos, o_pos, o_pos <= i_last,
                                          o_pos[None, :] <= b_row_pos[:, None], o_dk, o_dv, m_dk, m_dv, scale, IS_BF16, INTERPRET)
    m_out = m_m[:, None] & m_dv[None, :]
    p_o_tile = p_o + o_row[:, None] * s_o_row + o_q_head[:, None] * s_o_head + o_dv[None, :]
    p_g_tile = p_g + o_row[:, None] * s_g_row + o_q_head[:, None] * s_g_head + o_dv[None, :]
    _finish(b_acc, b_sum, p_o_tile, p_g_tile, m_out, HAS_GATE, INTERPRET)


def attend_prefill(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row_slots: torch.Tensor,
                   row_positions: torch.Tensor, table: torch.Tensor, scale: float, *, out: torch.Tensor | None = None,
                   gate: torch.Tensor | None = None) -> torch.Tensor:
    """attend_rows' result for prefill's rows, a tile of rows at a time: `table` [n_tiles, 3] int32
    (sequence, first row, rows) cuts each sequence's rows into tiles that end at absolute multiples
    of prefill_tile_rows(HQ, HKV) (kernels/delta_rule_chunked.py's chunk_table, whose tiles hold
    one sequence's rows at consecutive positions). Other bits than attend_rows' (another tile shape
    multiplies), the same bits for a row whatever tile, batch or chunk of its prompt it sits in."""
    out = _check(query, keys, values, row_slots, row_positions, out, gate, launcher="attend_prefill")
    check_launchable("attend_prefill", "query", query)
    n_rows, n_heads, d_k = query.shape
    kv_heads, d_v = keys.shape[2], values.shape[3]
    if table.dim() != 2 or table.shape[1] != 3 or table.dtype != torch.int32 or table.device != query.device \
            or not table.is_contiguous():
        raise ValueError(f"attend_prefill: table must be a contiguous int32 [n_tiles, 3] on {query.device}, got "
                         f"{list(table.shape)} {table.dtype} on {table.device}")
    if n_rows == 0 or table.shape[0] == 0:
        return out
    group = n_heads // kv_heads
    _attend_prefill_kernel[(table.shape[0], kv_heads)](
        query, keys, values, row_slots, row_positions, table, out, gate if gate is not None else out,
        *_strides(query, keys, values, out, gate), float(scale),
        IS_BF16=query.dtype == torch.bfloat16, INTERPRET=interpreting(), HAS_GATE=gate is not None,
        GROUP=group, D_K=d_k, D_V=d_v, BLOCK_G=triton.next_power_of_2(group), ROWS=prefill_tile_rows(n_heads, kv_heads),
        BLOCK_DK=_block(d_k), BLOCK_DV=_block(d_v), BLOCK_N=BLOCK_N,
        num_warps=PREFILL_NUM_WARPS, num_stages=PREFILL_NUM_STAGES, **launch_options(query.device),
    )
    return out


def attend_rows_ref(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row_slots: torch.Tensor,
                    row_positions: torch.Tensor, scale: float, *, out: torch.Tensor | None = None,
                    gate: torch.Tensor | None = None) -> torch.Tensor:
    """What the CPU reference backend computes in row-invariant mode: each row alone over its prefix
    (then GatedAttention's output gate, out * sigmoid(gate), with a gate)."""
    out = _check(query, keys, values, row_slots, row_positions, out, gate)
    for i, (slot, pos) in enumerate(zip(row_slots.tolist(), row_positions.tolist())):
        out[i : i + 1] = _causal_one_row(query[i : i + 1].clone(), keys[slot, : pos + 1], values[slot, : pos + 1], scale)
    if gate is not None:
        out.copy_(out * torch.sigmoid(gate))
    return out


def _causal_one_row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [1, HQ, D_K]; keys [n, HKV, D_K]; values [n, HKV, D_V] -> [1, HQ, D_V]: every position visible.

    The same operations, shapes and casts as the reference backend's causal attention for one row.
    """
    _, n_heads, d_k = q.shape
    kv_heads = keys.shape[1]
    group = n_heads // kv_heads
    qh = q.reshape(1, kv_heads, group, d_k).permute(1, 0, 2, 3).reshape(kv_heads, group, d_k)
    scores = torch.matmul(qh, keys.permute(1, 2, 0)) * scale  # [HKV, group, n] in the input dtype
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    o = torch.matmul(probs, values.permute(1, 0, 2))  # [HKV, group, D_V]
    return o.reshape(kv_heads, 1, group, -1).permute(1, 0, 2, 3).reshape(1, n_heads, -1)


def _strides(query, keys, values, out, gate) -> tuple[int, ...]:
    """The kernels' stride arguments, in their order (the gate's 0, 0 without one)."""
    return (query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1),
            values.stride(2), out.stride(0), out.stride(1), *((gate.stride(0), gate.stride(1)) if gate is not None else (0, 0)))


def _block(size: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(size))


def _check(query, keys, values, row_slots, row_positions, out, gate=None, launcher="attend_rows") -> torch.Tensor:
    """Validate shapes, dtypes, strides and devices; return out (allocated when None). launcher: whose messages."""
    check_operand(launcher, "query", query, "[rows, heads, d_k]", DTYPES)
    n_rows, n_heads, d_k = query.shape
    if keys.dim() != 4 or values.dim() != 4:
        raise ValueError(f"{launcher}: keys and values must be [slots, length, kv_heads, d], "
                         f"got keys {list(keys.shape)}, values {list(values.shape)}")
    kv_heads = keys.shape[2]
    if keys.shape[3] != d_k:
        raise ValueError(f"{launcher}: keys d_k {keys.shape[3]} != query d_k {d_k}")
    if values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"{launcher}: values shape {list(values.shape)} does not match keys {list(keys.shape)} "
                         "in slots, length, kv_heads")
    if kv_heads < 1 or n_heads % kv_heads != 0:
        raise ValueError(f"{launcher}: query heads {n_heads} are not a multiple of keys kv_heads {kv_heads}")
    if d_k < 1 or values.shape[3] < 1:
        raise ValueError(f"{launcher}: empty head size: query d_k {d_k}, values d_v {values.shape[3]}")
    for name, t in (("keys", keys), ("values", values)):
        if t.dtype != query.dtype:
            raise ValueError(f"{launcher}: {name} dtype {t.dtype} != query dtype {query.dtype}")
    for name, t in (("row_slots", row_slots), ("row_positions", row_positions)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{launcher}: {name} dtype {t.dtype} is not int32 or int64")
        if t.shape != (n_rows,):
            raise ValueError(f"{launcher}: {name} shape {list(t.shape)} != [{n_rows}] (one per query row)")
        if not t.is_contiguous():
            raise ValueError(f"{launcher}: {name} must be contiguous")
    if out is None:
        out = torch.empty(n_rows, n_heads, values.shape[3], dtype=query.dtype, device=query.device)
    else:
        if out.shape != (n_rows, n_heads, values.shape[3]):
            raise ValueError(f"{launcher}: out shape {list(out.shape)} != {[n_rows, n_heads, values.shape[3]]}")
        if out.dtype != query.dtype:
            raise ValueError(f"{launcher}: out dtype {out.dtype} != query dtype {query.dtype}")
    if gate is not None:
        if tuple(gate.shape) != tuple(out.shape) or gate.dtype != query.dtype or gate.device != query.device:
            raise ValueError(f"{launcher}: gate must be {list(out.shape)} {query.dtype} on {query.device}, "
                             f"got {list(gate.shape)} {gate.dtype} on {gate.device}")
    for name, t in (("query", query), ("keys", keys), ("values", values), ("out", out), ("gate", gate)):
        if t is not None and t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{launcher}: {name} must be contiguous in its last dim, got strides {t.stride()}")
    for name, t in (("keys", keys), ("values", values), ("row_slots", row_slots), ("row_positions", row_positions), ("out", out)):
        if t.device != query.device:
            raise ValueError(f"{launcher}: {name} is on {t.device}, query on {query.device}")
    return out
