"""Carried rows (verifier/model/carry.py) at the kernel level (kernels/delta_rule.py): a verify with a
carry stashes the rows of each sequence of more than one row into its slot's other bank, and the
slot's next verify, applying the first kept of them, gives bitwise what a fold then a plain verify
give: the outputs, the snapshots and the committed state. Exactly those rows land, and nothing
for one-row or padding sequences or in the bank read; the torch references do the same, to fp32
rounding (the stash itself bitwise)."""

import pytest
import torch

from kernels.delta_rule import carry_shapes, delta_rule_verify, delta_rule_verify_ref

from . import test_delta_rule as delta
from .conftest import ROW_COUNTS, assert_close

C = 6  # carried rows a bank: max_k + 1
SCRATCH = delta.N_SLOTS - 1


def empty_carry(heads, d_k, d_v, decay_k, device, n_slots=delta.N_SLOTS):
    """(keys, values, decays, betas) of two banks of C rows a slot, NaN: a row the kernel reads but
    should not poisons its output, and one it should not write stays NaN."""
    return tuple(torch.full(shape, float("nan"), device=device) for shape in carry_shapes(n_slots, C, heads, d_k, d_v, decay_k))


def int32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def stash_of(t: dict) -> tuple[torch.Tensor, ...]:
    return t["key"], t["value"], t["decay"], t["beta"]


@pytest.mark.parametrize("kind", delta.KINDS)
@pytest.mark.parametrize("shape", delta.SHAPES[:2], ids=delta.shape_id)
def test_carried_rows_equal_a_fold_then_a_verify(kind, shape, device):
    """Step 1 (three sequences of several rows, from bank 0) stashes its rows into bank 1 and keeps
    some; they either fold into the state (a plain rollback) or are carried. Step 2's verify (a
    one-row sequence, a multi-row one, one that carries and stashes again) from bank 1 equals step 2
    from the folded state: outputs, snapshots, and the committed state after it (the multi-row
    sequences commit through their carried rows; the one-row one commits its row as well)."""
    heads, d_k, d_v = shape
    counts1, slots, kept1 = [4, 3, 2], [0, 3, 1], [3, 2, 2]
    counts2 = [1, 3, 2]
    t1 = delta.make(sum(counts1), heads, d_k, d_v, kind, device, seed=11)
    t2 = delta.make(sum(counts2), heads, d_k, d_v, kind, device, seed=12)
    decay_k = t1["decay"].shape[2]
    s1, cu1 = delta.ragged(counts1, slots, device)
    s2, cu2 = delta.ragged(counts2, slots, device)

    folded = t1["state"].clone()
    delta.verify(t1, s1, cu1, state=folded)  # writes nothing: no one-row sequence
    delta.fold(t1, folded, s1, cu1, kept1)
    want_snapshots = torch.empty(sum(counts2), heads, d_k, d_v, device=device)
    want = delta.verify(t2, s2, cu2, want_snapshots, state=folded)

    state = t1["state"].clone()
    carry = empty_carry(heads, d_k, d_v, decay_k, device)
    delta_rule_verify(state, t1["query"], *stash_of(t1), s1, cu1, carried=int32([0, 0, 0], device),
                      banks=int32([0, 0, 0], device), carry=carry)
    assert torch.equal(state, t1["state"]), "a verify of several rows wrote a committed state"
    got_snapshots = torch.empty_like(want_snapshots)
    carried, banks = int32(kept1, device), int32([1, 1, 1], device)
    ref_carry = tuple(c.clone() for c in carry)
    got = delta_rule_verify(state, t2["query"], *stash_of(t2), s2, cu2, got_snapshots, carried=carried, banks=banks, carry=carry)
    assert torch.equal(got, want) and torch.equal(got_snapshots, want_snapshots)
    assert torch.equal(state, folded), "the committed state differs from the fold's (slot 0 also committed its one row)"
    assert torch.equal(state[2], t1["state"][2]) and torch.equal(state[4], t1["state"][4]), "a slot outside the step was written"

    ref_state = t1["state"].clone()
    ref_snapshots = torch.empty_like(want_snapshots)
    ref = delta_rule_verify_ref(ref_state, t2["query"], *stash_of(t2), s2, cu2, ref_snapshots, carried=carried, banks=banks,
                                carry=ref_carry)
    assert_close(f"carried verify ref {kind}", ref, got, delta.RTOL, delta.ATOL)
    assert_close(f"carried state ref {kind}", ref_state, state, delta.RTOL, delta.ATOL)
    for got_rows, ref_rows in zip(carry, ref_carry):
        assert torch.equal(got_rows.nan_to_num(7.0), ref_rows.nan_to_num(7.0)), "kernel and reference stash differ"


@pytest.mark.parametrize("kind", delta.KINDS)
def test_verify_stashes_its_rows_into_the_other_bank(kind, device):
    """Each sequence of more rows writes all its rows (key, value, decay, beta) to rows 0 .. of its
    slot's other bank, bitwise; a one-row sequence (it commits its row), a padding sequence (the
    scratch slot) and every bank a sequence reads are left alone."""
    counts, slots, banks = [5, 1, 3, 2, 0], [3, 0, 2, SCRATCH, SCRATCH], [0, 0, 1, 0, 0]
    heads, d_k, d_v = delta.SHAPES[0]
    t = delta.make(sum(counts), heads, d_k, d_v, kind, device, seed=14)
    carry = empty_carry(heads, d_k, d_v, t["decay"].shape[2], device)
    seq_slots, cu_rows = delta.ragged(counts, slots, device)
    delta_rule_verify(t["state"].clone(), t["query"], *stash_of(t), seq_slots, cu_rows, scratch_slot=SCRATCH,
                      carried=int32([0] * len(counts), device), banks=int32(banks, device), carry=carry)
    starts = cu_rows.tolist()
    for name, got, rows in zip(("keys", "values", "decays", "betas"), carry, stash_of(t)):
        assert torch.equal(got[1, 3, :5], rows[starts[0] : starts[0] + 5]), f"{name}: slot 3's rows in bank 1"
        assert torch.equal(got[0, 2, :3], rows[starts[2] : starts[2] + 3]), f"{name}: slot 2's rows in bank 0"
        assert got[1, 3, 5:].isnan().all() and got[0, 2, 3:].isnan().all(), f"{name}: rows past a sequence's were written"
        for bank, slot in ((0, 3), (1, 2), (0, 0), (1, 0), (0, SCRATCH), (1, SCRATCH), (0, 1), (1, 1)):
            assert got[bank, slot].isnan().all(), f"{name}: bank {bank} of slot {slot} was written"


@pytest.mark.parametrize("kind", delta.KINDS)
def test_carried_verify_row_invariant(kind, device):
    """With carried rows, op(x[:r]) == op(x)[:r] bitwise for r in ROW_COUNTS (one sequence), and every
    r > 1 commits the same state (the carried rows applied): the carry does not depend on the rows."""
    heads, d_k, d_v = delta.SHAPES[1]
    n = max(ROW_COUNTS)
    t = delta.make(n + 3, heads, d_k, d_v, kind, device, seed=13)
    decay_k = t["decay"].shape[2]
    slot, kept, bank = 2, 3, 1
    carry = empty_carry(heads, d_k, d_v, decay_k, device)

    def run(r):
        state = t["state"].clone()
        for c, rows in zip(carry, stash_of(t)):
            c[bank, slot, :kept] = rows[n : n + kept]
        s, cu = delta.ragged([r], [slot], device)
        out = delta_rule_verify(state, t["query"][:r], t["key"][:r], t["value"][:r], t["decay"][:r], t["beta"][:r], s, cu,
                                carried=int32([kept], device), banks=int32([bank], device), carry=carry)
        return out, state

    full, full_state = run(n)
    for r in ROW_COUNTS:
        out, state = run(r)
        assert torch.equal(out, full[:r]), f"rows {r}"
        if r > 1:
            assert torch.equal(state, full_state), f"rows {r}: the committed state differs"


def test_verify_rejects_a_carry_without_counts(device):
    t = delta.make(2, 2, 16, 40, "gdn", device)
    s, cu = delta.ragged([2], [0], device)
    carry = empty_carry(2, 16, 40, 1, device)
    zero = int32([0], device)
    with pytest.raises(ValueError, match="carry, carried and banks come together"):
        delta_rule_verify(t["state"], t["query"], *stash_of(t), s, cu, carry=carry)
    with pytest.raises(ValueError, match="carry, carried and banks come together"):
        delta_rule_verify(t["state"], t["query"], *stash_of(t), s, cu, carry=carry, carried=zero)
    with pytest.raises(ValueError, match="carried"):
        delta_rule_verify(t["state"], t["query"], *stash_of(t), s, cu, carry=carry, carried=int32([0, 0], device), banks=zero)
    with pytest.raises(ValueError, match="banks"):
        delta_rule_verify(t["state"], t["query"], *stash_of(t), s, cu, carry=carry, carried=zero, banks=int32([0, 0], device))
    with pytest.raises(ValueError, match="carry decays"):
        bad = carry[:2] + (torch.zeros(2, delta.N_SLOTS, C, 2, 16, device=device),) + carry[3:]
        delta_rule_verify(t["state"], t["query"], *stash_of(t), s, cu, carry=bad, carried=zero, banks=zero)
