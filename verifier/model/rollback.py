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
              next verify applies them: Carried rows, below).
Rollback runs for every sequence of the batch and every recurrent layer at once, through the
record's RollbackPlan: per group of alike layers (one group per recurrent kind), one launch for all
conv windows and one for all recurrent states (kernels/fused_rollback.py), whose pointer table the
plan builds; a CUDA graph bucket builds its plan once, and a graph that chains steps (the draft
chain: verifier/model/step.py StepGraph) writes its tables after the capture. It is the one
rollback: the CPU backend runs the same plan through the launchers' torch references (the one-layer
torch ops, layer by layer), the GPU through the fused kernels. The per-layer rollback (one launch per
layer and state) is no product path: tests/test_rollback_plan.py keeps it as the reference the plan
is held to, torch.equal. Prefill's COMMIT mode commits every row in the layer's own forward
(`commit`: the one-layer fold), since the next chunk reads the state it leaves.
Attention needs no record: its cursor is the committed position, and KV rows past it are
overwritten before anything reads them.

Per sequence, recurrent layer and verify of K+1 >= 2 rows (S = heads * d_k * d_v * 4 bytes of
state; g = 1 for GDN, d_k for KDA; a decode, K = 0, reads S and writes S, in both modes):
  snapshot: verify reads S and writes (K+1) * S; rollback reads S and writes S.
  WOA:      verify reads S and writes (K+1) * heads * (d_k + d_v + g + 1) * 4 bytes of stash;
            the fold reads (a+1) stash rows, reads S and writes S; carried (below), the
            rollback copies the (a+1) stash rows and the next verify, which reads S anyway,
            reads them and writes S: S less per step.
At Qwen3-Next sizes (32 heads of 128 x 128: S = 2 MiB) and K = 8 that is ~22 MiB per layer
for snapshot against ~6.3 MiB for WOA with a fold. bench/rollback measures the fold and the snapshot.

Carried rows (write-on-accept rollback without a fold; DESIGN.md section 4, "carried state").
A verify of K + 1 rows reads a slot's recurrent state and writes nothing; its rollback kept the
first a + 1 rows by folding them into the state, which read and wrote the whole state again. At
64 sequences of the 2B model that is 2.4 GB read and written per step (~0.6 ms at 4 TB/s), a
large share of a K = 8 step (`python -m bench.gpu` times the steps and the rollback, and
`python -m bench.rollback` the fold against the snapshot). With carried rows the rollback copies the kept rows' stash (key,
value, decay, beta: a few hundred KB a sequence) into the slot's CarriedRows
(verifier/model/state.py) and notes how many (`SlotPool.carried`, `note_kept`); the slot's next verify applies
them to the state it loads anyway, writes the state once (it is then committed through them), and
walks its new rows from there. A step then moves the state twice (read, write), never three
times, and a rollback moves kilobytes.

Bits. The carried rows are the stash's values, copied, and the verify applies them with the fold's
function in the fold's order (kernels/delta_rule.py `_update_state`, in the walk that then takes
the step's rows), so the state it commits, and
every row after, is bitwise what the fold would have given.

Who carries. A write-on-accept engine with max_k > 0 (verifier/engine.py) makes its pool with
C = max_k + 1 carried rows a slot; other pools (snapshot mode, the model drafter's engine of
max_k 0, prefill-only pools) fold as before. Prefill runs on a fresh slot (carried 0) and commits
at once. A one-row verify (a decode) applies its slot's carried rows and its row and commits both
(kernels/one_row_commit.py), so it carries nothing after. Reading a slot's state from outside a
step (`committed_state`: the serial oracle of `python -m verifier check`, tests) applies its
carried rows to a copy.
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
    """Prefill (COMMIT): advance each sequence's conv window and recurrent state past its first
    kept[s] rows (int32 [sequences], every row of each), in the layer's forward, with the one-layer
    window update and fold."""
    device = state.recurrent.device
    seq_slots, cu_rows = batch.seq_slots(device), batch.cu_rows(device)
    pick(short_conv.next_window, short_conv.next_window_ref, state.conv)(state.conv, record.conv_inputs, seq_slots, cu_rows, kept)
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


def note_kept(pool: SlotPool, batch: RowBatch, consumed: list[int], carried: bool) -> None:
    """After a rollback of `batch` (the caller's sequences) keeping consumed[s] rows: the rows each
    slot now carries (consumed[s] where the rollback carried them, a sequence of more than one row;
    0 where the verify or the rollback committed everything)."""
    if not pool.carry_rows:
        return
    for slot, count, kept in zip(batch.slots, batch.counts, consumed):
        pool.carried[slot] = kept if carried and count > 1 else 0


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
