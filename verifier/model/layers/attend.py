"""Causal attention of rows over their slot's KV: shared by gated attention and MLA.

On CUDA one Triton launch serves every row (kernels/attention.py walks each row's visible prefix
in fixed blocks from position 0); a prefill's rows walk it in tiles of rows where TILED_PREFILL
says so (attend_prefill: each row's bits its own, though not decode's). On the CPU, row-invariant mode computes each row alone over
exactly its visible prefix, so a row's arithmetic is the same whether it is decoded alone or
verified among K others; prefill batches a sequence's rows under a causal mask.
"""

from __future__ import annotations

import torch

from hybrid_kernels.attention import attend_prefill, attend_rows, prefill_tile_rows
from hybrid_kernels.runtime import use_triton

from ..rows import RowBatch
from ..state import AttentionState

# Prefill's attention in tiles of a sequence's rows (one load of a KV block serves every row of the
# tile) instead of a program per row; False: a program per row, as decode (`python -m bench.prefill
# --no-tiled-attention` times that). Decode and verify never take it.
TILED_PREFILL = True


def write_kv(batch: RowBatch, state: AttentionState, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Store row r of each sequence at position start + r of its slot. keys [rows, kv_heads, d_k]."""
    row_slots, positions = batch.row_slots(keys.device), batch.positions(keys.device)
    state.keys[row_slots, positions] = keys
    state.values[row_slots, positions] = values


def attend(batch: RowBatch, state: AttentionState, queries: torch.Tensor, scale: float, *, row_invariant: bool,
           gate: torch.Tensor | None = None, prefill: bool = False) -> torch.Tensor:
    """queries [rows, heads, d_k] over positions 0 .. start + r of the slot -> [rows, heads, d_v].
    gate [rows, heads, d_v] (CUDA only): the output times sigmoid(gate), in the same launch.
    prefill: the rows are a prefill's (every row committed), which may take the tiled kernel."""
    if use_triton(queries):
        device = queries.device
        if prefill and TILED_PREFILL:
            table = batch.chunk_table(prefill_tile_rows(queries.shape[1], state.keys.shape[2]), device)
            return attend_prefill(queries, state.keys, state.values, batch.row_slots(device), batch.positions(device), table,
                                  scale, gate=gate)
        return attend_rows(queries, state.keys, state.values, batch.row_slots(device), batch.positions(device), scale, gate=gate)
    assert gate is None, "the output gate is fused on CUDA only; the CPU reference applies it after attend"
    out = torch.empty(queries.shape[0], queries.shape[1], state.values.shape[-1], dtype=queries.dtype, device=queries.device)
    for slot, start, rows in batch.sequences():
        n = rows.stop - rows.start
        if row_invariant:
            for r in range(n):
                i = rows.start + r
                out[i : i + 1] = _causal(queries[i : i + 1].clone(), state.keys[slot, : start + r + 1], state.values[slot, : start + r + 1], start + r, scale)
        else:
            out[rows] = _causal(queries[rows], state.keys[slot, : start + n], state.values[slot, : start + n], start, scale)
    return out


def _causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [n, heads, d_k] at positions start .. start+n-1; keys [L, kv_heads, d_k]; values [L, kv_heads, d_v]."""
    n, heads, d_k = q.shape
    length, kv_heads, _ = keys.shape
    group = heads // kv_heads  # query heads j*group .. (j+1)*group-1 read kv head j
    qh = q.reshape(n, kv_heads, group, d_k).permute(1, 0, 2, 3).reshape(kv_heads, n * group, d_k)
    scores = torch.matmul(qh, keys.permute(1, 2, 0)) * scale  # [kv_heads, n*group, L]
    if n > 1:
        row_pos = start + torch.arange(n, device=q.device).repeat_interleave(group)  # [n*group]
        hidden = torch.arange(length, device=q.device)[None, :] > row_pos[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values.permute(1, 0, 2))  # [kv_heads, n*group, d_v]
    return out.reshape(kv_heads, n, group, -1).permute(1, 0, 2, 3).reshape(n, heads, -1)
