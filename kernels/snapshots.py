"""Snapshot-mode rollback of the recurrent state: each sequence's slot takes the snapshot of its
last kept row.

    state      [n_slots, H, D_K, D_V]  fp32: the committed recurrent state of each slot (written)
    snapshots  [R, H, D_K, D_V]        fp32: verify's state after each row, rows stacked by sequence
    seq_slots  [S]                     int32: each sequence's slot in the pool
    cu_rows    [S+1]                   int32: sequence s owns rows cu_rows[s] .. cu_rows[s+1]-1
    kept       [S]                     int32: 0 <= kept[s] <= rows of s

state[seq_slots[s]] = snapshots[cu_rows[s] + kept[s] - 1] for every s with kept[s] > 0 and more
than one row; a sequence with kept[s] = 0 (a padding sequence of a graph bucket,
verifier/model/padding.py) neither reads nor writes anything, so padding sequences may share one
slot and cost nothing; nor does one of one row, whose verify committed that row, bitwise its
snapshot (kernels/delta_rule.py). A copy: the bits are the snapshot's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_contiguous, check_launchable, check_ragged, check_tensor
from .dependent_launch import after_previous, launch_options
from .one_row_commit import rows_to_roll

BLOCK = 1024  # fp32 values per program: a 128 x 128 head is 16 programs
NUM_WARPS = 4


@triton.jit
def _copy_head_block(src, dst, i_b, HEAD: tl.constexpr, BLOCK: tl.constexpr):
    """Block i_b of one head's HEAD = D_K * D_V values from src to dst (both at the head's first value)."""
    o_x = i_b * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] within the head
    m_x = o_x < HEAD
    tl.store(dst + o_x, tl.load(src + o_x, mask=m_x), mask=m_x)


@triton.jit
def _keep_snapshots_kernel(state, snapshots, seq_slots, cu_rows, kept, HEAD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_s = tl.program_id(0)
    i_h = tl.program_id(1)  # a head of the slot
    i_b = tl.program_id(2)  # a block of that head's D_K * D_V values
    i_kept = rows_to_roll(cu_rows, kept, i_s)
    if i_kept == 0:  # padding, or one row, which its verify committed
        return
    i_slot = tl.load(seq_slots + i_s).to(tl.int64)
    i_row = (tl.load(cu_rows + i_s) + i_kept - 1).to(tl.int64)
    n_heads = tl.num_programs(1)
    _copy_head_block(snapshots + (i_row * n_heads + i_h) * HEAD, state + (i_slot * n_heads + i_h) * HEAD, i_b, HEAD, BLOCK)


def _check(op: str, state: torch.Tensor, snapshots: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor,
           kept: torch.Tensor) -> None:
    if state.dim() != 4 or state.dtype != torch.float32:
        raise ValueError(f"{op}: state must be fp32 [n_slots, H, D_K, D_V], got {state.dtype} {list(state.shape)}")
    on_state = ("state", state)
    if snapshots.dim() != 4:
        raise ValueError(f"{op}: snapshots must be 4-D [R, H, D_K, D_V], got shape {list(snapshots.shape)}")
    check_tensor(op, "snapshots", snapshots, (snapshots.shape[0], *state.shape[1:]), torch.float32, on_state,
                 layout="[R, H, D_K, D_V]", contiguous=True)
    check_ragged(op, seq_slots, cu_rows, on_state)
    check_tensor(op, "kept", kept, seq_slots.shape, torch.int32, on_state, layout="[S]")


def keep_snapshots(state: torch.Tensor, snapshots: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor,
                   kept: torch.Tensor) -> None:
    """In place: state[seq_slots[s]] = snapshots[cu_rows[s] + kept[s] - 1] where kept[s] > 0 and s
    has more than one row. kept[s] in 0 .. rows of s is not checked (that would sync)."""
    op = "keep_snapshots"
    _check(op, state, snapshots, seq_slots, cu_rows, kept)
    check_launchable(op, "state", state)
    check_contiguous(op, "state", state)
    n_seqs, heads = seq_slots.shape[0], state.shape[1]
    head = state.shape[2] * state.shape[3]
    if n_seqs == 0 or snapshots.shape[0] == 0:
        return
    _keep_snapshots_kernel[(n_seqs, heads, triton.cdiv(head, BLOCK))](
        state, snapshots, seq_slots, cu_rows, kept, HEAD=head, BLOCK=BLOCK, num_warps=NUM_WARPS, **launch_options(state.device),
    )


def keep_snapshots_ref(state: torch.Tensor, snapshots: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor,
                       kept: torch.Tensor) -> None:
    """keep_snapshots in torch, one sequence at a time: the CPU reference backend's snapshot rollback."""
    _check("keep_snapshots_ref", state, snapshots, seq_slots, cu_rows, kept)
    bounds = cu_rows.tolist()
    for s, (slot, n) in enumerate(zip(seq_slots.tolist(), kept.tolist())):
        if n > 0 and bounds[s + 1] - bounds[s] > 1:
            state[slot] = snapshots[bounds[s] + n - 1]
