"""Carried rows: write-on-accept rollback that moves no data (DESIGN.md section 4, "carried state").

A verify of K + 1 rows reads a slot's recurrent state and writes nothing there; its rollback kept
the first a + 1 rows by folding them into the state, which read and wrote the whole state again
(at 64 sequences of the 2B model 2.4 GB a step: the fold took 1.44 ms of a 12 ms K = 8 step on the
H200), then by copying their stash into the slot's carried rows, which the next verify applied.
Now the verify itself leaves every row where the next one can apply it, and the rollback is the
host's note of how many to apply: no copy, no launch.

Banks. A carrying pool (verifier/model/state.py) gives each slot two banks of C = max_k + 1 rows:
the delta rule's stash (key, value, decay, beta: CarriedRows.tensors) and the conv's raw inputs
(CarriedRows.inputs), and its conv windows in two banks too (RecurrentState.conv_banks). A slot's
state is the window of its bank p = SlotPool.banks[slot] and its recurrent state, each advanced by
the first c = SlotPool.carried[slot] rows of bank p. A verify of a sequence (kernels/delta_rule.py,
kernels/short_conv.py, both with their carry):
  - applies those c rows first: the delta rule commits the state through them, the conv reads the
    W-1 inputs before its first row from window p and carried inputs p;
  - writes bank 1 - p and only that bank's rows: a decode (one row) the window after its row,
    having committed its row's state (kernels/one_row_commit.py); a verify of more rows the window
    before its rows, and its rows' stash and raw inputs.
The rollback (`note_kept`) then flips the slot's bank and sets c: the rows kept of a verify of more
rows, 0 after a decode. Nothing is read and written in place but a slot's recurrent state, by its
own programs, so a graph bucket's runs and padding need no ordering; the scratch slot's banks are
never written (padding sequences share it, carrying nothing in bank 0).

Bits. The carried rows are the stash's own values, and the verify applies them with the fold's
function in the fold's order (kernels/delta_rule.py `_update_state`, in the walk that then takes
the step's rows), so the state it commits, and every row after, is bitwise what the fold would
have given; the conv's window is the inputs themselves, as the window update kept them.

Who carries. A write-on-accept engine with max_k > 0 (verifier/engine.py) makes its pool with
C = max_k + 1 carried rows a slot; other pools (snapshot mode, the model drafter's engine of
max_k 0, prefill-only pools) fold and update windows as before. Prefill runs on a fresh slot (bank
0, carried 0) and commits at once into bank 0. Reading a slot's state from outside a step
(`committed_state`, `committed_window`: the serial oracle of `python -m verifier check`, tests)
applies its carried rows to a copy.
"""

from __future__ import annotations

import torch

from kernels import delta_rule
from kernels.runtime import pick

from .rows import RowBatch
from .state import RecurrentState, SlotPool


def with_carried(batch: RowBatch, pool: SlotPool) -> RowBatch:
    """`batch` with each sequence's carried rows and their bank (its slot's), checked to fit: a
    sequence of more rows than the pool carries could not keep them all (the engine caps drafts at
    max_k). `batch` itself when every slot carries nothing from bank 0 (a batch builds on a step's
    critical path)."""
    if not pool.carry_rows:
        return batch
    if max(batch.counts, default=0) > pool.carry_rows:
        slot, count = next((s, c) for s, c in zip(batch.slots, batch.counts) if c > pool.carry_rows)
        raise ValueError(f"slot {slot}: a verify of {count} rows in a pool that carries at most {pool.carry_rows} "
                         f"(max_k + 1) rows a slot")
    carried = tuple(pool.carried[slot] for slot in batch.slots)
    banks = tuple(pool.banks[slot] for slot in batch.slots)
    if not any(carried) and not any(banks):  # carried () and banks () mean none, bank 0
        return batch
    return RowBatch(slots=batch.slots, starts=batch.starts, counts=batch.counts, scratch_slot=batch.scratch_slot,
                    carried=carried, banks=banks)


def note_kept(pool: SlotPool, batch: RowBatch, consumed: list[int]) -> None:
    """The rollback of a carrying pool's verify of `batch` (the caller's sequences) keeping
    consumed[s] rows: each slot's bank flips to the one the verify wrote, which carries the rows
    kept of a verify of more rows and nothing after a decode (it committed its row)."""
    if not pool.carry_rows:
        return
    for slot, count, kept in zip(batch.slots, batch.counts, consumed):
        pool.carried[slot] = kept if count > 1 else 0
        pool.banks[slot] ^= 1


def committed_state(pool: SlotPool, layer: RecurrentState, slot: int) -> torch.Tensor:
    """A copy of the slot's recurrent state [heads, d_k, d_v] with its carried rows applied: what
    the slot's next verify starts from, bitwise."""
    state = layer.recurrent[slot : slot + 1].clone()
    n = pool.carried[slot]
    if n and layer.carry is not None:
        bank = pool.banks[slot]
        keys, values, decays, betas = (t[bank, slot] for t in layer.carry.tensors)  # [C, heads, ...]
        device = state.device
        # one sequence of all C rows in slot 0 of the copy, keeping n: a fold (of more than one row)
        seq_slots = torch.zeros(1, dtype=torch.int32, device=device)
        cu_rows = torch.tensor([0, keys.shape[0]], dtype=torch.int32, device=device)
        kept = torch.tensor([n], dtype=torch.int32, device=device)
        fold = pick(delta_rule.delta_rule_fold, delta_rule.delta_rule_fold_ref, state)
        fold(state, keys, values, decays, betas, seq_slots, cu_rows, kept)
    return state[0]


def committed_window(pool: SlotPool, layer: RecurrentState, slot: int) -> torch.Tensor:
    """A copy of the slot's conv window [conv_dim, W-1] with its carried rows applied: the W-1 raw
    inputs before its next row, bitwise what its next verify reads."""
    if layer.carry is None:
        return layer.conv[slot].clone()
    bank, n = pool.banks[slot], pool.carried[slot]
    window = layer.conv_banks[bank, slot]  # [conv_dim, W-1]
    inputs = torch.cat((window, layer.carry.inputs[bank, slot, :n].t()), dim=1)
    return inputs[:, inputs.shape[1] - window.shape[1] :].clone()
