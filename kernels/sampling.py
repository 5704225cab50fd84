"""Greedy choice on the device: the argmax of every logits row, ties to the lowest id.

    logits  [R, V]  fp32 or bf16: R verify rows (any row stride), V the vocabulary
    out     [R]     int64: the id of each row's largest logit

Why a kernel: the engine accepts greedy drafts by comparing them with each row's argmax, and
copying K+1 rows of a 150k vocabulary to the host for that (5.5 MB at K = 8) costs more than
the rest of the step's host work. One program per row walks the row in BLOCK_V blocks from id 0
upward, keeping per lane the largest value and the first id holding it, then reduces the lanes
with ties to the lowest id (DESIGN.md section 6, rule 8). A maximum is exact whatever the order,
so the answer equals torch.argmax's; NaN counts as larger than every number (as in torch) and the
first NaN wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import interpreting

BLOCK_V = 1024  # ids per step of the walk
NUM_WARPS = 4
DTYPES = (torch.float32, torch.bfloat16)


NO_ID = tl.constexpr(2147483647)


@triton.jit
def _argmax_rows_kernel(p_logits, p_out, V, s_row, BLOCK_V: tl.constexpr):
    i_row = tl.program_id(0).to(tl.int64)
    o_v = tl.arange(0, BLOCK_V)
    p_row = p_logits + i_row * s_row
    b_best = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per lane: the largest number seen
    b_id = tl.full([BLOCK_V], NO_ID, tl.int32)  # per lane: the first id holding it
    b_nan = tl.full([BLOCK_V], NO_ID, tl.int32)  # per lane: the first NaN's id
    for v0 in range(0, V, BLOCK_V):
        o_id = v0 + o_v
        m_id = o_id < V
        b_x = tl.load(p_row + o_id, mask=m_id, other=float("-inf")).to(tl.float32)
        m_nan = b_x != b_x
        b_nan = tl.minimum(b_nan, tl.where(m_nan, o_id, NO_ID))
        # ids only grow within a lane: a later id replaces only a strictly larger number, and a
        # lane's first valid id seeds it (so an all -inf row answers 0, as torch does)
        m_take = m_id & ~m_nan & ((b_x > b_best) | (b_id == NO_ID))
        b_best = tl.where(m_take, b_x, b_best)
        b_id = tl.where(m_take, o_id, b_id)
    b_max = tl.max(b_best, axis=0)
    b_first = tl.min(tl.where(b_best == b_max, b_id, NO_ID), axis=0)
    b_first_nan = tl.min(b_nan, axis=0)
    b_choice = tl.where(b_first_nan < NO_ID, b_first_nan, b_first)
    tl.store(p_out + i_row, b_choice.to(tl.int64))


def argmax_rows(logits: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] -> int64 [R]: each row's argmax, ties (and NaNs) to the lowest id."""
    _check(logits, out)
    if not logits.is_cuda and not interpreting():
        raise ValueError(f"argmax_rows: logits are on {logits.device}; the Triton kernel needs CUDA (or TRITON_INTERPRET=1)")
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _argmax_rows_kernel[(rows,)](logits, out, vocab, logits.stride(0), BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)
    return out


def argmax_rows_ref(logits: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.argmax over the last dim (ties and NaNs: the first)."""
    _check(logits, out)
    result = torch.argmax(logits, dim=-1)
    if out is None:
        return result
    out.copy_(result)
    return out


def _check(logits: torch.Tensor, out: torch.Tensor | None) -> None:
    if logits.dim() != 2:
        raise ValueError(f"argmax_rows: logits must be [rows, vocab], got shape {list(logits.shape)}")
    if logits.dtype not in DTYPES:
        raise ValueError(f"argmax_rows: logits dtype {logits.dtype} is not one of {DTYPES}")
    if logits.shape[1] < 1:
        raise ValueError("argmax_rows: empty vocabulary")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"argmax_rows: logits must be contiguous along the vocabulary, got strides {logits.stride()}")
    if out is not None and (out.shape != (logits.shape[0],) or out.dtype != torch.int64 or out.device != logits.device):
        raise ValueError(f"argmax_rows: out must be int64 [{logits.shape[0]}] on {logits.device}, "
                         f"got {out.dtype} {list(out.shape)} on {out.device}")
