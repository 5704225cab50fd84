"""The body GDN and KDA share: the short conv, then the gated delta rule, over a ragged batch, and
the layer's forward around it (`DeltaRuleMixer`).

Kernels (kernels/short_conv.py, kernels/delta_rule.py) serve CUDA tensors; their torch
references, which walk each sequence row by row, serve the CPU. Verify (a Rollback given) reads
a slot's committed conv window and recurrent state and leaves a LayerRecord for rollback; it
writes the window and state of a one-row sequence only, whose row every step consumes
(kernels/one_row_commit.py). Prefill (no Rollback) consumes every row: the delta rule stores the
state and the conv window moves past the rows; with CHUNKED_PREFILL, GDN's prefill takes the
chunked form (kernels/delta_rule_chunked.py), whose sub-chunks sit at absolute multiples of its chunk.
"""

from __future__ import annotations

from typing import Callable

import torch

from hybrid_kernels import delta_rule, delta_rule_chunked, short_conv
from hybrid_kernels.runtime import pick

from ..ops import each_row
from ..padding import walk_sequences
from ..rollback import LayerRecord, Rollback, commit_window
from ..rows import RowBatch
from ..state import RecurrentState

# GDN's prefill in chunked form instead of the serial walk: off, many times slower than the serial
# walk in the engine on an H100 (`python -m bench.prefill --chunked-delta-rule`; DESIGN.md section 6)
CHUNKED_PREFILL = False

# Prefill's short conv in runs of about this many rows a program (kernels/short_conv.py
# prefill_runs); 0: conv_runs' few runs, as a step's (`python -m bench.prefill --conv-run-rows N`).
# Which program computes a row never changes its bits.
PREFILL_CONV_RUN_ROWS = 0

# (conv outputs [n, conv_dim], *gate inputs [n, ...]) -> fp32 query, key [n, heads, d_k], value [n, heads, d_v],
# decay [n, heads, 1 or d_k] = exp(g), beta [n, heads]
Heads = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def mix_sequences(batch: RowBatch, state: RecurrentState, conv_inputs: torch.Tensor, conv_weight: torch.Tensor,
                  split_heads: Heads, gate_inputs: tuple[torch.Tensor, ...], *, row_invariant: bool,
                  rollback: Rollback | None = None) -> tuple[torch.Tensor, LayerRecord]:
    """conv_inputs [rows, conv_dim] raw; split_heads maps the conv outputs and the rows' gate_inputs
    (what the layer's projection left for it: GDN's raw gate columns, KDA's finished decay and beta)
    to the heads and gates (Heads) -> (outputs [rows, heads, d_v] in conv_inputs' dtype, the layer's
    record). rollback: the verify's (what it records); None: prefill, which also applies the record."""
    device = conv_inputs.device
    seq_slots, cu_rows = batch.seq_slots(device), batch.cu_rows(device)
    conv = pick(short_conv.conv_rows, short_conv.conv_rows_ref, conv_inputs)
    if rollback is None and PREFILL_CONV_RUN_ROWS:
        runs = short_conv.prefill_runs(conv_inputs.shape[0], len(batch.slots), PREFILL_CONV_RUN_ROWS)
    else:
        runs = short_conv.conv_runs(conv_inputs.shape[0], walk_sequences(batch), conv_inputs.shape[1])
    mixed = conv(state.conv, conv_inputs, conv_weight, seq_slots, cu_rows, scratch_slot=state.scratch_slot, runs=runs)
    query, key, value, decay, beta = each_row(split_heads, mixed, *gate_inputs, row_invariant=row_invariant)
    snapshots = None if rollback is None else rollback.snapshot_buffer(*key.shape, value.shape[2], device)
    verify = pick(delta_rule.delta_rule_verify, delta_rule.delta_rule_verify_ref, state.recurrent)
    # the outputs in the activation dtype, rounded once in the kernel: the layer's output norm takes
    # them so, and a cast after the recurrence would be one more launch per layer
    out = torch.empty(value.shape, dtype=conv_inputs.dtype, device=device)
    carry = {}
    if state.carry is not None and rollback is not None:  # the slot's carried rows go first (verifier/model/rollback.py)
        carry = dict(carried=batch.carried_rows(device), carry=state.carry.tensors)
    if CHUNKED_PREFILL and rollback is None and not row_invariant and decay.shape[2] == 1:
        # GDN's prefill: sub-chunks of matrix products instead of one row at a time. Prefill need
        # not give decode's bits, only its own under any batching and any split of a prompt at its
        # chunk boundaries (the prefix cache's); the sub-chunks sit at absolute multiples of the
        # chunk, so a row's bits follow from the state at the boundary before it (DESIGN.md section 6)
        chunked = pick(delta_rule_chunked.delta_rule_chunked, delta_rule_chunked.delta_rule_chunked_ref, state.recurrent)
        out = chunked(state.recurrent, query, key, value, decay, beta, seq_slots, cu_rows, batch.seq_starts(device), out,
                      table=batch.chunk_table(delta_rule_chunked.CHUNK, device))
    else:
        # prefill (no rollback) consumes every row: the walk that gives the outputs stores the state
        out = verify(state.recurrent, query, key, value, decay, beta, seq_slots, cu_rows, snapshots, out,
                     scratch_slot=state.scratch_slot, commit=rollback is None, **carry)
    record = LayerRecord(conv_inputs, key, value, decay, beta, snapshots)
    if rollback is None:
        commit_window(state, record, batch, cu_rows[1:] - cu_rows[:-1])
    return out, record


class DeltaRuleMixer:
    """A GDN or KDA layer's forward: project every row, mix each sequence's rows (conv and delta
    rule), then the output of every row. A subclass sets `conv_w` [conv_dim, W] and defines
    `_project` (x [n, H] -> raw conv inputs [n, conv_dim], output gate, then its gate inputs),
    `_split_heads` (see Heads) and `_output` (outputs [n, heads, d_v] in the activation dtype, output
    gate -> [n, H])."""

    conv_w: torch.Tensor

    def forward(self, x: torch.Tensor, batch: RowBatch, positions: torch.Tensor, state: RecurrentState, *, row_invariant: bool,
                rollback: Rollback | None = None) -> tuple[torch.Tensor, LayerRecord]:
        conv_inputs, gate, *gate_inputs = each_row(self._project, x, row_invariant=row_invariant)
        out, record = mix_sequences(batch, state, conv_inputs, self.conv_w, self._split_heads, tuple(gate_inputs),
                                    row_invariant=row_invariant, rollback=rollback)
        return each_row(self._output, out, gate, row_invariant=row_invariant), record
