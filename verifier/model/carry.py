"""Carried rows: write-on-accept rollback without a fold (DESIGN.md section 4, "carried state").

A verify of K + 1 rows reads a slot's recurrent state and writes nothing; its rollback kept the
first a + 1 rows by folding them into the state, which read and wrote the whole state again. At
64 sequences of the 2B model that is 2.4 GB read and written per step: the fold took 1.44 ms of a
12 ms K = 8 step on the H200. With carried rows the rollback copies the kept rows' stash (key,
value, decay, beta: a few hundred KB a sequence) into the slot's CarriedRows
(verifier/model/state.py) and notes how many (`SlotPool.carried`); the slot's next verify applies
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

import torch

from hybrid_kernels import delta_rule
from hybrid_kernels.runtime import pick

from .rows import RowBatch
from .state import RecurrentState, SlotPool


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
