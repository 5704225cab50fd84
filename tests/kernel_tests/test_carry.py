"""Carried rows (verifier/model/rollback.py) at the kernel level: a rollback that copies the kept stash
rows into the slot's carry (kernels/fused_rollback.py keep_carry), then a verify that applies them
first (kernels/delta_rule.py), give bitwise what a fold then a plain verify give: the outputs,
the snapshots and the committed state. keep_carry copies exactly the rows the fold would apply,
and nothing for one-row or padding sequences; the torch references do the same, to fp32 rounding."""

import pytest
import torch

from hybrid_kernels.delta_rule import delta_rule_fold, delta_rule_verify, delta_rule_verify_ref
from hybrid_kernels import fused_rollback
from hybrid_kernels.fused_rollback import RecurrentLayers, keep_carry, keep_carry_ref

from . import test_delta_rule as delta
from . import test_fused_rollback as fused
from .conftest import ROW_COUNTS, assert_close

C = 6  # carried rows a slot: max_k + 1


def empty_carry(heads, d_k, d_v, decay_k, device, n_slots=delta.N_SLOTS):
    """(keys, values, decays, betas) of C rows a slot, NaN: a row the kernel reads but should not poisons its output."""
    return tuple(torch.full((n_slots, C, heads, *dims), float("nan"), device=device) for dims in ((d_k,), (d_v,), (decay_k,), ()))


@pytest.mark.parametrize("kind", delta.KINDS)
@pytest.mark.parametrize("shape", delta.SHAPES[:2], ids=delta.shape_id)
def test_carried_rows_equal_a_fold_then_a_verify(kind, shape, device):
    """Step 1 (a verify of several sequences) keeps some rows; its kept rows either fold into the
    state (today's rollback) or are carried. Step 2's verify (a one-row sequence, a multi-row
    one, one that carries nothing) from the carried state equals step 2 from the folded state:
    outputs, snapshots, and the committed state after it (the multi-row sequence commits through
    its carried rows; the one-row one commits its row as well)."""
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
    layers = RecurrentLayers([torch.zeros(delta.N_SLOTS, 3, 1, device=device)], [state], [torch.zeros(sum(counts1), 3, device=device)],
                             [t1["key"]], [t1["value"]], [t1["decay"]], [t1["beta"]], carries=[carry])
    keep_carry(layers, s1, cu1, torch.tensor(kept1, dtype=torch.int32, device=device))
    carried = torch.tensor(kept1, dtype=torch.int32, device=device)
    got_snapshots = torch.empty_like(want_snapshots)
    got = delta_rule_verify(state, t2["query"], t2["key"], t2["value"], t2["decay"], t2["beta"], s2, cu2, got_snapshots,
                            carried=carried, carry=carry)
    assert torch.equal(got, want) and torch.equal(got_snapshots, want_snapshots)
    assert torch.equal(state, folded), "the committed state differs from the fold's (slot 0 also committed its one row)"
    assert torch.equal(state[2], t1["state"][2]) and torch.equal(state[4], t1["state"][4]), "a slot outside the step was written"

    ref_state = t1["state"].clone()
    ref_snapshots = torch.empty_like(want_snapshots)
    ref = delta_rule_verify_ref(ref_state, t2["query"], t2["key"], t2["value"], t2["decay"], t2["beta"], s2, cu2, ref_snapshots,
                                carried=carried, carry=carry)
    assert_close(f"carried verify ref {kind}", ref, got, delta.RTOL, delta.ATOL)
    assert_close(f"carried state ref {kind}", ref_state, state, delta.RTOL, delta.ATOL)


# CARRY_SEQUENCE_PROGRAMS for the test's 6 sequences: each sequence's rows in one program (a
# strided walk), dealt between two programs (rows 0, 2 and row 1 of the sequence keeping 3), a program a row
ROW_DEALS = {"rows-in-one-program": 1, "two-row-programs": 12, "a-program-a-row": 128}


@pytest.mark.parametrize("sequence_programs", ROW_DEALS.values(), ids=ROW_DEALS.keys())
@pytest.mark.parametrize("carry_block", [None, 8], ids=["one-chunk", "chunks-of-8"])
@pytest.mark.parametrize("kind", delta.KINDS)
def test_keep_carry_copies_the_kept_rows_only(kind, carry_block, sequence_programs, device, monkeypatch):
    """Per layer, a multi-row sequence's kept rows land in its slot's first carried rows exactly;
    a one-row sequence (its verify committed it), a sequence keeping nothing and padding leave
    their slots' carries alone; the reference copies the same. With the copy's chunk cut to 8, a
    row (3 heads x 10 values at most) takes four programs a layer, and the shorter tensors (keys
    of 3 x 6, GDN's decays and the betas of 3) end inside the first chunks, as the model's do.
    However a sequence's rows are dealt to programs (fused_rollback.carry_row_programs), the same rows land."""
    if carry_block is not None:
        monkeypatch.setattr(fused_rollback, "CARRY_BLOCK", carry_block)
    monkeypatch.setattr(fused_rollback, "CARRY_SEQUENCE_PROGRAMS", sequence_programs)
    t = fused.make_layers(kind, fused.SHAPES[0], torch.float32, device, with_snapshots=False)
    heads, d_k, d_v = fused.SHAPES[0]
    decay_k = t["decays"][0].shape[2]
    carries = [empty_carry(heads, d_k, d_v, decay_k, device, fused.N_SLOTS) for _ in range(fused.N_LAYERS)]
    ref_carries = [tuple(x.clone() for x in c) for c in carries]
    seq_slots, cu_rows = delta.ragged(fused.COUNTS, fused.SLOTS, device)
    kept = fused.kept_counts(3, device)  # the first sequence (slot 3, 5 rows) keeps 3; slot 0 has one row; slot 2 keeps 2
    layers = RecurrentLayers(t["windows"], t["states"], t["conv_inputs"], t["keys"], t["values"], t["decays"], t["betas"],
                             carries=carries)
    keep_carry(layers, seq_slots, cu_rows, kept)
    ref_layers = RecurrentLayers(t["windows"], t["states"], t["conv_inputs"], t["keys"], t["values"], t["decays"], t["betas"],
                                 carries=ref_carries)
    keep_carry_ref(ref_layers, seq_slots, cu_rows, kept)
    starts = cu_rows.tolist()
    for l in range(fused.N_LAYERS):
        stash = (t["keys"][l], t["values"][l], t["decays"][l], t["betas"][l])
        for got, ref, rows in zip(carries[l], ref_carries[l], stash):
            assert torch.equal(got.nan_to_num(7.0), ref.nan_to_num(7.0)), f"layer {l}: kernel and reference carry differ"
            assert torch.equal(got[3, :3], rows[starts[0] : starts[0] + 3]), f"layer {l}: slot 3's kept rows"
            assert torch.equal(got[2, :2], rows[starts[2] : starts[2] + 2]), f"layer {l}: slot 2's kept rows"
            assert got[3, 3:].isnan().all() and got[2, 2:].isnan().all(), f"layer {l}: rows past the kept ones were written"
            for slot in (0, 1, fused.SCRATCH):
                assert got[slot].isnan().all(), f"layer {l}: slot {slot} (one row, outside, or padding) was written"


@pytest.mark.parametrize("kind", delta.KINDS)
def test_carried_verify_row_invariant(kind, device):
    """With carried rows, op(x[:r]) == op(x)[:r] bitwise for r in ROW_COUNTS (one sequence), and every
    r > 1 commits the same state (the carried rows applied): the carry does not depend on the rows."""
    heads, d_k, d_v = delta.SHAPES[1]
    n = max(ROW_COUNTS)
    t = delta.make(n + 3, heads, d_k, d_v, kind, device, seed=13)
    decay_k = t["decay"].shape[2]
    carry = empty_carry(heads, d_k, d_v, decay_k, device)
    slot, kept = 2, 3
    for c, rows in zip(carry, (t["key"], t["value"], t["decay"], t["beta"])):
        c[slot, :kept] = rows[n : n + kept]
    carried = torch.tensor([kept], dtype=torch.int32, device=device)

    def run(r):
        state = t["state"].clone()
        s, cu = delta.ragged([r], [slot], device)
        out = delta_rule_verify(state, t["query"][:r], t["key"][:r], t["value"][:r], t["decay"][:r], t["beta"][:r], s, cu,
                                carried=carried, carry=carry)
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
    with pytest.raises(ValueError, match="carry and carried come together"):
        delta_rule_verify(t["state"], t["query"], t["key"], t["value"], t["decay"], t["beta"], s, cu, carry=carry)
    with pytest.raises(ValueError, match="carried"):
        delta_rule_verify(t["state"], t["query"], t["key"], t["value"], t["decay"], t["beta"], s, cu, carry=carry,
                          carried=torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="carry decays"):
        bad = carry[:2] + (torch.zeros(delta.N_SLOTS, C, 2, 16, device=device),) + carry[3:]
        delta_rule_verify(t["state"], t["query"], t["key"], t["value"], t["decay"], t["beta"], s, cu, carry=bad,
                          carried=torch.zeros(1, dtype=torch.int32, device=device))
