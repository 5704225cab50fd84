"""What a verify forward leaves behind for rollback, and the rollback itself (DESIGN.md section 4).

Verify never writes the committed conv window or recurrent state of a sequence of more than one
row; a one-row sequence (a decode) commits its row's window and state in the verify itself, since
every step consumes a sequence's first row, and rollback leaves that slot alone
(kernels/one_row_commit.py); a step of decodes only has no rollback at all. Per recurrent
layer it records a LayerRecord over all rows of the batch (each sequence's rows 0..K in order):
  both modes: the raw conv inputs [rows, conv_dim] (rollback re-slices the window);
  snapshot:   the recurrent state after each row [rows, heads, d_k, d_v] (rollback copies row a's);
  write-on-accept (WOA): the stash of what each row's update consumes: key [rows, heads, d_k],
              value [rows, heads, d_v], decay [rows, heads, 1 or d_k], beta [rows, heads]
              (rollback folds rows 0..a into the committed state with the one update function;
              in a pool that carries rows, it copies them to the slot's carried rows and the
              next verify applies them: carry.py).
Rollback runs for every sequence of the batch at once. With the record's RollbackPlan it runs for
every recurrent layer at once too: per group of alike layers (one group per recurrent kind), one
launch for all conv windows and one for all recurrent states (kernels/fused_rollback.py), whose
pointer table the plan builds; a CUDA graph bucket builds its plan once, and a caller that captures
its verify and rollback in one graph (the draft chain) writes the table after the capture. Without
a plan it is one conv-window and one fold (or snapshot copy) launch per layer. Both give the same bits.
Attention needs no record: its cursor is the committed position, and KV rows past it are
overwritten before anything reads them.

Per sequence, recurrent layer and verify of K+1 >= 2 rows (S = heads * d_k * d_v * 4 bytes of
state; g = 1 for GDN, d_k for KDA; a decode, K = 0, reads S and writes S, in both modes):
  snapshot: verify reads S and writes (K+1) * S; rollback reads S and writes S.
  WOA:      verify reads S and writes (K+1) * heads * (d_k + d_v + g + 1) * 4 bytes of stash;
            the fold reads (a+1) stash rows, reads S and writes S; carried (carry.py), the
            rollback copies the (a+1) stash rows and the next verify, which reads S anyway,
            reads them and writes S: S less per step.
At Qwen3-Next sizes (32 heads of 128 x 128: S = 2 MiB) and K = 8 that is ~22 MiB per layer
for snapshot against ~6.3 MiB for WOA with a fold. bench/rollback measures the fold and the snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_kernels import delta_rule, short_conv, snapshots
from hybrid_kernels.fused_rollback import (RecurrentLayers, TableStore, fold_states, fold_states_ref, keep_carry, keep_carry_ref,
                                    keep_state_snapshots, keep_state_snapshots_ref, next_windows, next_windows_ref)
from hybrid_kernels.runtime import pick

from .carry import note_kept
from .rows import RowBatch
from .state import RecurrentState, SlotPool

COMMIT = "commit"  # prefill: write the state as rows are consumed
SNAPSHOT = "snapshot"
WOA = "woa"
ROLLBACK_MODES = (WOA, SNAPSHOT)


@dataclass
class LayerRecord:
    """All rows of one verify through one recurrent layer (rows stacked as in the RowBatch)."""

    conv_inputs: torch.Tensor  # [rows, conv_dim] raw conv inputs
    keys: torch.Tensor  # [rows, heads, d_k] fp32: the WOA stash is keys, values, decays, betas
    values: torch.Tensor  # [rows, heads, d_v] fp32
    decays: torch.Tensor  # [rows, heads, 1 (GDN) or d_k (KDA)] fp32, exp(g)
    betas: torch.Tensor  # [rows, heads] fp32
    snapshots: torch.Tensor | None = None  # snapshot mode: [rows, heads, d_k, d_v] fp32 state after each row


class VerifyRecord:
    """What one verify forward leaves for rollback: its batch and, per recurrent layer, a LayerRecord."""

    def __init__(self, mode: str, batch: RowBatch):
        if mode not in ROLLBACK_MODES:
            raise ValueError(f"rollback mode must be one of {ROLLBACK_MODES}, got {mode!r}")
        self.mode = mode
        self.batch = batch
        self.layers: dict[int, LayerRecord] = {}


def commit(state: RecurrentState, record: LayerRecord, batch: RowBatch, kept: torch.Tensor) -> None:
    """Advance each sequence's conv window and recurrent state past its first kept[s] rows (int32
    [sequences]); a sequence with kept[s] = 0 (padding) leaves its slot untouched."""
    device = state.recurrent.device
    seq_slots, cu_rows = batch.seq_slots(device), batch.cu_rows(device)
    pick(short_conv.next_window, short_conv.next_window_ref, state.conv)(state.conv, record.conv_inputs, seq_slots, cu_rows, kept)
    if record.snapshots is not None:
        keep = pick(snapshots.keep_snapshots, snapshots.keep_snapshots_ref, state.recurrent)
        keep(state.recurrent, record.snapshots, seq_slots, cu_rows, kept)
    else:
        fold = pick(delta_rule.delta_rule_fold, delta_rule.delta_rule_fold_ref, state.recurrent)
        fold(state.recurrent, record.keys, record.values, record.decays, record.betas, seq_slots, cu_rows, kept)


def recurrent_groups(pool: SlotPool, record: VerifyRecord, store: TableStore | None = None) -> list[RecurrentLayers]:
    """The record's recurrent layers with their slot state, in layer order, grouped by shape: one
    group per recurrent kind (the layers of a kind share one config). store: see RollbackPlan."""
    groups: dict[tuple, list[tuple[RecurrentState, LayerRecord]]] = {}
    for index, layer_record in record.layers.items():
        state = pool.layers[index]
        shape = (tuple(state.conv.shape), state.conv.dtype, tuple(state.recurrent.shape), tuple(layer_record.decays.shape),
                 layer_record.snapshots is None, state.carry is None)
        groups.setdefault(shape, []).append((state, layer_record))
    return [
        RecurrentLayers([s.conv for s, _ in layers], [s.recurrent for s, _ in layers], [r.conv_inputs for _, r in layers],
                        [r.keys for _, r in layers], [r.values for _, r in layers], [r.decays for _, r in layers],
                        [r.betas for _, r in layers], None if layers[0][1].snapshots is None else [r.snapshots for _, r in layers],
                        store=store,
                        # write-on-accept in a carrying pool: the kept rows are carried, not folded (carry.py)
                        carries=[s.carry.tensors for s, _ in layers] if _carries(*layers[0]) else None)
        for layers in groups.values()
    ]


def _carries(state: RecurrentState, layer_record: LayerRecord) -> bool:
    """Whether a rollback of this layer carries its kept rows (verifier/model/carry.py) rather than folding them."""
    return state.carry is not None and layer_record.snapshots is None


class RollbackPlan:
    """The rollback of one verify record over all its recurrent layers: per group of alike layers,
    one launch for their conv windows and one for their recurrent states (a fold in WOA mode, a
    snapshot copy in snapshot mode). Making it builds the groups' pointer tables (a host to device
    copy): outside any CUDA graph capture, once per record (a graph bucket: once). Inside a capture
    whose graph holds the verify and its rollback (the draft chain's), make it with a TableStore
    allocated before the capture, and call fill_tables() once the capture has ended."""

    def __init__(self, pool: SlotPool, record: VerifyRecord, store: TableStore | None = None):
        self.batch = record.batch
        self.groups = recurrent_groups(pool, record, store)
        self.device = self.groups[0].states[0].device if self.groups else None

    def fill_tables(self) -> None:
        """Write the tables of a plan made with a TableStore (after the capture that made it)."""
        for group in self.groups:
            group.fill_table()

    @property
    def tables(self) -> list[torch.Tensor]:
        """The groups' pointer tables: a graph that replays this plan reads them; whoever keeps the graph keeps them."""
        return [group.table for group in self.groups]

    def apply(self, kept: torch.Tensor) -> None:
        """kept: int32 [sequences] on the state's device; no host syncs."""
        if not self.groups:
            return
        seq_slots, cu_rows = self.batch.seq_slots(self.device), self.batch.cu_rows(self.device)
        for group in self.groups:
            state = group.states[0]
            pick(next_windows, next_windows_ref, state)(group, seq_slots, cu_rows, kept)
            if group.carries is not None:
                pick(keep_carry, keep_carry_ref, state)(group, seq_slots, cu_rows, kept)
            elif group.snapshots is None:
                pick(fold_states, fold_states_ref, state)(group, seq_slots, cu_rows, kept)
            else:
                pick(keep_state_snapshots, keep_state_snapshots_ref, state)(group, seq_slots, cu_rows, kept)


def rollback(pool: SlotPool, record: VerifyRecord, consumed: list[int]) -> None:
    """Bring every sequence of the verify to 'rows 0 .. consumed[s]-1 consumed' (consumed = accepted + 1)."""
    check_consumed(record.batch, consumed)
    if record.layers and not record.batch.committed_in_verify:
        plan = RollbackPlan(pool, record)
        apply_rollback(pool, record, torch.tensor(consumed, dtype=torch.int32, device=plan.device), plan)
    note_kept(pool, record.batch, consumed, carried=record.mode == WOA)


def check_consumed(batch: RowBatch, consumed: list[int]) -> None:
    if len(consumed) != len(batch.counts):
        raise ValueError(f"rollback: {len(consumed)} counts for {len(batch.counts)} sequences")
    for s, n in enumerate(consumed):
        if not 1 <= n <= batch.counts[s]:
            raise ValueError(f"rollback of slot {batch.slots[s]}: {n} rows consumed, but {batch.counts[s]} were verified")


def apply_rollback(pool: SlotPool, record: VerifyRecord, kept: torch.Tensor, plan: RollbackPlan | None = None) -> None:
    """rollback with checked counts kept (int32 [sequences], on the state's device; 0 for the
    padding sequences of a graph bucket); no host syncs, so a CUDA graph can capture it.
    plan: the record's RollbackPlan (all layers at once); None: one launch per layer and state
    (a carrying pool's rollback always runs as a plan: carry.py)."""
    if plan is None and any(_carries(pool.layers[i], r) for i, r in record.layers.items()):
        plan = RollbackPlan(pool, record)
    if plan is not None:
        if plan.batch is not record.batch:
            raise ValueError("apply_rollback: the plan was made for another verify record")
        plan.apply(kept)
        return
    for index, layer_record in record.layers.items():
        commit(pool.layers[index], layer_record, record.batch, kept)
