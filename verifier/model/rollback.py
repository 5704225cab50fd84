"""What a verify forward leaves behind for rollback (a LayerRecord per recurrent layer: raw conv
inputs, and snapshots or the write-on-accept stash), and the rollback itself: one RollbackPlan per
group of alike layers, run by kernels/fused_rollback.py on the GPU and by its torch references on
the CPU. What each mode records and moves, carried rows and their bits: DESIGN.md section 4,
"Rollback records and carried rows".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_kernels import delta_rule, short_conv
from hybrid_kernels.fused_rollback import (RecurrentLayers, TableStore, fold_states, fold_states_ref, keep_carry, keep_carry_ref,
                                           keep_state_snapshots, keep_state_snapshots_ref, next_windows, next_windows_ref)
from hybrid_kernels.runtime import pick

from .rows import RowBatch
from .state import RecurrentState, SlotPool


@dataclass
class LayerRecord:
    """All rows of one verify through one recurrent layer (rows stacked as in the RowBatch)."""

    conv_inputs: torch.Tensor  # [rows, conv_dim] raw conv inputs
    keys: torch.Tensor  # [rows, heads, d_k] fp32: the WOA stash is keys, values, decays, betas
    values: torch.Tensor  # [rows, heads, d_v] fp32
    decays: torch.Tensor  # [rows, heads, 1 (GDN) or d_k (KDA)] fp32, exp(g)
    betas: torch.Tensor  # [rows, heads] fp32
    snapshots: torch.Tensor | None = None  # snapshot mode: [rows, heads, d_k, d_v] fp32 state after each row


class Rollback:
    """How a verify's recurrent layers go back to each sequence's accepted prefix, chosen once: the
    engine holds one (DESIGN.md section 4, "Rollback records and carried rows"). It says how many
    rows a slot carries between steps (the pool's buffers), what a verify records
    (`snapshot_buffer`), which rows a forward runs (`rows`), the rollback's plan, the host's
    bookkeeping after it (`kept`) and a slot's committed state. No forward takes it as an
    argument: a VerifyRecord carries it to the recurrent layers, and prefill (no record) commits
    every row."""

    name = ""

    def carry_rows(self, max_k: int) -> int:
        """Rows a slot carries from one step into the next (SlotPool's CarriedRows): none."""
        return 0

    def record(self, batch: RowBatch) -> VerifyRecord:
        """An empty record of a verify of `batch`, which the forward fills."""
        return VerifyRecord(self, batch)

    def snapshot_buffer(self, rows: int, heads: int, d_k: int, d_v: int, device) -> torch.Tensor | None:
        """Where a recurrent layer's verify writes the state after each row (None: it keeps none)."""
        return None

    def rows(self, batch: RowBatch, pool: SlotPool) -> RowBatch:
        """The rows a verify of `batch` runs: `batch` itself."""
        return batch

    def plan(self, pool: SlotPool, record: VerifyRecord, store: TableStore | None = None) -> RollbackPlan:
        """The rollback of `record` (RollbackPlan; store: see there)."""
        return RollbackPlan(pool, record, store)

    def kept(self, pool: SlotPool, batch: RowBatch, consumed: list[int]) -> None:
        """The host's bookkeeping once a rollback of `batch` kept consumed[s] rows: none."""

    def committed_state(self, pool: SlotPool, layer: RecurrentState, slot: int) -> torch.Tensor:
        """A copy of the slot's recurrent state [heads, d_k, d_v]: what its next verify starts from, bitwise."""
        return layer.recurrent[slot].clone()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class WriteOnAccept(Rollback):
    """Write-on-accept: a verify stashes each row's keys, values, decays and betas; the rollback
    folds a sequence's kept rows into its state or, in a pool that carries rows (an engine of
    max_k > 0), keeps them as the slot's carried rows, which its next verify applies first."""

    name = "woa"

    def carry_rows(self, max_k: int) -> int:
        return max_k + 1 if max_k > 0 else 0

    def rows(self, batch: RowBatch, pool: SlotPool) -> RowBatch:
        return with_carried(batch, pool)

    def kept(self, pool: SlotPool, batch: RowBatch, consumed: list[int]) -> None:
        note_kept(pool, batch, consumed)

    def committed_state(self, pool: SlotPool, layer: RecurrentState, slot: int) -> torch.Tensor:
        return committed_state(pool, layer, slot)


class Snapshot(Rollback):
    """Per-row snapshots: a verify writes the state after every row; the rollback copies the
    snapshot after a sequence's last kept row into its slot."""

    name = "snapshot"

    def snapshot_buffer(self, rows: int, heads: int, d_k: int, d_v: int, device) -> torch.Tensor:
        return torch.empty(rows, heads, d_k, d_v, dtype=torch.float32, device=device)


WOA, SNAPSHOT = WriteOnAccept.name, Snapshot.name
ROLLBACKS: dict[str, Rollback] = {r.name: r for r in (WriteOnAccept(), Snapshot())}  # they hold no state: one each
ROLLBACK_MODES = tuple(ROLLBACKS)


def rollback_named(name: str) -> Rollback:
    """The rollback of that name (one of ROLLBACK_MODES); ValueError for another."""
    if name not in ROLLBACKS:
        raise ValueError(f"rollback mode must be one of {ROLLBACK_MODES}, got {name!r}")
    return ROLLBACKS[name]


class VerifyRecord:
    """What one verify forward leaves for rollback: its batch and, per recurrent layer, a
    LayerRecord; `rollback` says what the layers record (Rollback.record makes one)."""

    def __init__(self, rollback: Rollback, batch: RowBatch):
        self.rollback = rollback
        self.batch = batch
        self.layers: dict[int, LayerRecord] = {}


def commit_window(state: RecurrentState, record: LayerRecord, batch: RowBatch, kept: torch.Tensor) -> None:
    """Prefill (COMMIT): advance each sequence's conv window past its first kept[s] rows (int32
    [sequences], every row of each), in the layer's forward; its recurrent state was stored by the
    delta rule's own walk (delta_rule_verify's commit), as a fold of the same rows would store it."""
    seq_slots, cu_rows = batch.seq_slots(state.conv.device), batch.cu_rows(state.conv.device)
    pick(short_conv.next_window, short_conv.next_window_ref, state.conv)(state.conv, record.conv_inputs, seq_slots, cu_rows, kept)


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
                        # write-on-accept in a carrying pool: the kept rows are carried, not folded (Carried rows)
                        carries=[s.carry.tensors for s, _ in layers] if _carries(*layers[0]) else None)
        for layers in groups.values()
    ]


def _carries(state: RecurrentState, layer_record: LayerRecord) -> bool:
    """Whether a rollback of this layer carries its kept rows (Carried rows) rather than folding them."""
    return state.carry is not None and layer_record.snapshots is None


class RollbackPlan:
    """The rollback of one verify record over all its recurrent layers: per group of alike layers,
    one launch for their conv windows and one for their recurrent states (a fold in WOA mode, a
    snapshot copy in snapshot mode). Making it builds the groups' pointer tables (a host to device
    copy): outside any CUDA graph capture, once per record (a graph bucket: once). Inside a capture
    whose graph holds the verify and its rollback (step.py StepGraph), make it with a TableStore
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
        """Bring each sequence to its first kept[s] rows consumed: kept int32 [sequences] on the
        state's device, checked by the caller (check_consumed), 0 for a graph bucket's padding
        sequences; no host syncs, so a CUDA graph can capture it."""
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


def check_consumed(batch: RowBatch, consumed: list[int]) -> None:
    """consumed[s] (accepted + 1) rows of each sequence of the verify's batch: 1 .. its rows."""
    if len(consumed) != len(batch.counts):
        raise ValueError(f"rollback: {len(consumed)} counts for {len(batch.counts)} sequences")
    for s, n in enumerate(consumed):
        if not 1 <= n <= batch.counts[s]:
            raise ValueError(f"rollback of slot {batch.slots[s]}: {n} rows consumed, but {batch.counts[s]} were verified")


def with_carried(batch: RowBatch, pool: SlotPool) -> RowBatch:
    """`batch` with each sequence's carried rows (its slot's), checked to fit: a sequence of more
    rows than the pool carries could not keep them all (the engine caps drafts at max_k). `batch`
    itself when none of its slots carries a row (a batch builds on a step's critical path)."""
    if not pool.carry_rows:
        return batch
    if max(batch.counts, default=0) > pool.carry_rows:
        slot, count = next((s, c) for s, c in zip(batch.slots, batch.counts) if c > pool.carry_rows)
        raise ValueError(f"slot {slot}: a verify of {count} rows in a pool that carries at most {pool.carry_rows} "
                         f"(max_k + 1) rows a slot")
    carried = tuple(pool.carried[slot] for slot in batch.slots)
    if not any(carried):  # no slot carries (decodes after decodes): the batch as it is, carried () meaning none
        return batch
    return RowBatch(slots=batch.slots, starts=batch.starts, counts=batch.counts, scratch_slot=batch.scratch_slot,
                    carried=carried)


def note_kept(pool: SlotPool, batch: RowBatch, consumed: list[int]) -> None:
    """After a write-on-accept rollback of `batch` (the caller's sequences) keeping consumed[s]
    rows: the rows each slot now carries (consumed[s] for a sequence of more than one row; 0 where
    the verify committed everything: a one-row sequence)."""
    if not pool.carry_rows:
        return
    for slot, count, kept in zip(batch.slots, batch.counts, consumed):
        pool.carried[slot] = kept if count > 1 else 0


def committed_state(pool: SlotPool, layer: RecurrentState, slot: int) -> torch.Tensor:
    """A copy of the slot's recurrent state [heads, d_k, d_v] with its carried rows applied: what
    the slot's next verify starts from, bitwise."""
    state = layer.recurrent[slot : slot + 1].clone()
    n = pool.carried[slot]
    if n and layer.carry is not None:
        keys, values, decays, betas = (t[slot] for t in layer.carry.tensors)  # [C, heads, ...]
        device = state.device
        # one sequence of all C rows in slot 0 of the copy, keeping n: a fold (of more than one row)
        seq_slots = torch.zeros(1, dtype=torch.int32, device=device)
        cu_rows = torch.tensor([0, keys.shape[0]], dtype=torch.int32, device=device)
        kept = torch.tensor([n], dtype=torch.int32, device=device)
        fold = pick(delta_rule.delta_rule_fold, delta_rule.delta_rule_fold_ref, state)
        fold(state, keys, values, decays, betas, seq_slots, cu_rows, kept)
    return state[0]
