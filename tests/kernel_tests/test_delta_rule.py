"""kernels/delta_rule.py: verify and fold against their torch references, and the recurrent contract
of DESIGN.md section 6 (bitwise): row and batch invariance, T=K vs K x T=1 vs a 3 + 5 split,
write-on-accept == snapshot, a bf16-state negative control, NaN-poisoned outputs and snapshots.

Tolerance (kernel vs reference, fp32): rtol 1e-5, atol 1e-6. Both apply the same three-line update
in fp32 with the same products; only the two sums over D_K are associated differently (the
kernel's written-out pairwise order, its first level a fused multiply-add, against torch's
reduction over dim -2), a few ulps of the sum per row. Keys are l2-normalised and beta, decay lie in (0, 1), so each row's update is a contraction
and those ulps do not grow along a sequence: measured <= 2.4e-7 absolute on states and outputs of
size ~1, well inside the bound, while an indexing, masking or decay-layout error is O(0.1-1).
Everything between kernel launches is compared with torch.equal.
"""

import pytest
import torch

from hybrid_kernels.delta_rule import (ONE_SEQUENCE_MIN_ROWS, DeltaRuleConfig, delta_rule_config, delta_rule_fold, delta_rule_fold_ref,
                                delta_rule_verify, delta_rule_verify_ref)

from .conftest import ROW_COUNTS, assert_close, nan_like

RTOL, ATOL = 1e-5, 1e-6
N_SLOTS = 5
SHAPES = [(3, 6, 10), (2, 16, 40), (1, 32, 5)]  # (H, D_K, D_V): odd sizes, two value blocks, D_V < D_K


def shape_id(shape):
    return "H{}-K{}-V{}".format(*shape)


def ragged(counts: list[int], slots: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_slots [S], cu_rows [S+1]) int32 for sequences of `counts` rows in `slots`."""
    cu = [0]
    for n in counts:
        cu.append(cu[-1] + n)
    return torch.tensor(slots, dtype=torch.int32, device=device), torch.tensor(cu, dtype=torch.int32, device=device)


def make(rows: int, heads: int, d_k: int, d_v: int, kind: str, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random inputs shaped like the models': l2-normalised keys and queries (query scaled by
    d_k^-0.5), decay = exp(g) in (0.5, 1), beta in (0, 1), a state of size ~1."""
    g = torch.Generator().manual_seed(seed)

    def l2(x):
        return x / x.norm(dim=-1, keepdim=True)

    decay_k = 1 if kind == "gdn" else d_k
    t = dict(
        state=torch.randn(N_SLOTS, heads, d_k, d_v, generator=g),
        query=l2(torch.randn(rows, heads, d_k, generator=g)) * d_k**-0.5,
        key=l2(torch.randn(rows, heads, d_k, generator=g)),
        value=torch.randn(rows, heads, d_v, generator=g),
        decay=torch.rand(rows, heads, decay_k, generator=g) * 0.5 + 0.5,
        beta=torch.rand(rows, heads, generator=g),
    )
    return {name: x.to(device) for name, x in t.items()}


def verify(t, seq_slots, cu_rows, snapshots=None, out=None, state=None, rows=slice(None), scratch_slot=None):
    """delta_rule_verify on t's rows `rows` from `state`, which its one-row sequences commit to
    (state None: a copy of t's, so t's state stays as made)."""
    return delta_rule_verify(t["state"].clone() if state is None else state, t["query"][rows], t["key"][rows], t["value"][rows],
                             t["decay"][rows], t["beta"][rows], seq_slots, cu_rows, snapshots, out, scratch_slot=scratch_slot)


def fold(t, state, seq_slots, cu_rows, consumed: list[int], rows=slice(None)):
    consumed_t = torch.tensor(consumed, dtype=torch.int32, device=state.device)
    delta_rule_fold(state, t["key"][rows], t["value"][rows], t["decay"][rows], t["beta"][rows], seq_slots, cu_rows, consumed_t)


KINDS = ["gdn", "kda"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_verify_matches_ref(kind, shape, device):
    """Several sequences of different lengths (one empty: a padding sequence) in one launch; the
    one-row sequence (slot 3) commits its row, bitwise its snapshot; no other slot is written."""
    counts, slots = [1, 4, 0, 9, 2], [3, 0, 2, 4, 1]
    heads, d_k, d_v = shape
    t = make(sum(counts), heads, d_k, d_v, kind, device)
    seq_slots, cu_rows = ragged(counts, slots, device)
    state, want_state = t["state"].clone(), t["state"].clone()
    out = nan_like(torch.empty(sum(counts), heads, d_v, device=device))
    snapshots = nan_like(torch.empty(sum(counts), heads, d_k, d_v, device=device))
    got = verify(t, seq_slots, cu_rows, snapshots, out, state=state)
    want_snapshots = torch.empty_like(snapshots)
    want = delta_rule_verify_ref(want_state, t["query"], t["key"], t["value"], t["decay"], t["beta"], seq_slots, cu_rows,
                                 want_snapshots)
    assert got is out
    assert_close(f"verify out {kind}", got, want, RTOL, ATOL)  # fails on NaN: every row written
    assert_close(f"verify snapshots {kind}", snapshots, want_snapshots, RTOL, ATOL)
    assert_close(f"verify state {kind}", state, want_state, RTOL, ATOL)
    assert torch.equal(state[3], snapshots[0]), "the one-row sequence did not commit its row"
    for slot in (0, 1, 2, 4):
        assert torch.equal(state[slot], t["state"][slot]), f"verify wrote slot {slot}, of a sequence of {counts[slots.index(slot)]} rows"


@pytest.mark.parametrize("kind", KINDS)
def test_one_row_verify_leaves_the_scratch_slot(kind, device):
    """Padding sequences in the scratch slot (one row or none) write nothing there, while a real
    one-row sequence in the same launch commits its row; and a one-row sequence is not folded."""
    counts, slots, scratch = [1, 1, 1, 0], [0, 4, 4, 4], 4
    t = make(sum(counts), 2, 16, 40, kind, device, seed=9)
    seq_slots, cu_rows = ragged(counts, slots, device)
    state = t["state"].clone()
    snapshots = torch.empty(sum(counts), 2, 16, 40, device=device)
    verify(t, seq_slots, cu_rows, snapshots, state=state, scratch_slot=scratch)
    assert torch.equal(state[scratch], t["state"][scratch]), "a padding sequence wrote the scratch slot"
    assert torch.equal(state[0], snapshots[0]), "the real one-row sequence did not commit its row"
    committed = state.clone()
    fold(t, state, seq_slots, cu_rows, [1, 1, 1, 0])
    assert torch.equal(state, committed), "a fold applied a one-row sequence's row a second time"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_fold_matches_ref(kind, shape, device):
    counts, slots, consumed = [1, 4, 9, 2], [3, 0, 4, 1], [1, 2, 9, 1]
    heads, d_k, d_v = shape
    t = make(sum(counts), heads, d_k, d_v, kind, device, seed=1)
    seq_slots, cu_rows = ragged(counts, slots, device)
    got, want = t["state"].clone(), t["state"].clone()
    fold(t, got, seq_slots, cu_rows, consumed)
    delta_rule_fold_ref(want, t["key"], t["value"], t["decay"], t["beta"], seq_slots, cu_rows,
                        torch.tensor(consumed, dtype=torch.int32, device=device))
    assert_close(f"fold state {kind}", got, want, RTOL, ATOL)
    assert torch.equal(got[2], t["state"][2]), "a slot outside the batch was written"
    assert torch.equal(got[3], t["state"][3]), "a one-row sequence was folded (its verify commits its row)"
    assert not torch.equal(got[1], t["state"][1]), "a two-row sequence keeping one row was not folded"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_a_committing_verify_stores_the_fold_of_all_its_rows(kind, shape, device):
    """Prefill's verify (commit=True): the outputs of a plain verify, and each sequence's state after
    its last row, bitwise the state a fold of all its rows stores; a padding sequence stores
    nothing. The reference likewise."""
    counts, slots = [1, 4, 0, 9, 2], [3, 0, 2, 4, 1]
    heads, d_k, d_v = shape
    t = make(sum(counts), heads, d_k, d_v, kind, device, seed=4)
    seq_slots, cu_rows = ragged(counts, slots, device)
    all_rows = torch.tensor(counts, dtype=torch.int32, device=device)
    args = (t["query"], t["key"], t["value"], t["decay"], t["beta"], seq_slots, cu_rows)
    for run, run_fold in ((delta_rule_verify, delta_rule_fold), (delta_rule_verify_ref, delta_rule_fold_ref)):
        committed, walked = t["state"].clone(), t["state"].clone()
        got = run(committed, *args, commit=True)
        want = run(walked, *args)
        run_fold(walked, t["key"], t["value"], t["decay"], t["beta"], seq_slots, cu_rows, all_rows)
        assert torch.equal(got, want), f"{run.__name__}: commit changed the outputs"
        assert torch.equal(committed, walked), f"{run.__name__}: the committed state is not the fold of every row"
        assert torch.equal(committed[2], t["state"][2]), "a padding sequence stored a state"
    with pytest.raises(ValueError, match="commit is prefill's"):
        carry = tuple(torch.zeros(N_SLOTS, 1, *x.shape[1:], device=device) for x in (t["key"], t["value"], t["decay"], t["beta"]))
        delta_rule_verify(t["state"].clone(), *args, carried=torch.zeros(len(slots), dtype=torch.int32, device=device),
                          carry=carry, commit=True)


@pytest.mark.parametrize("kind", KINDS)
def test_verify_row_invariant(kind, device):
    """op(x[:r]) == op(x)[:r] bitwise for r in ROW_COUNTS, outputs and snapshots; the fold of r
    rows lands on snapshot r-1."""
    rows, slot = max(ROW_COUNTS), 3
    t = make(rows, 3, 6, 10, kind, device, seed=2)
    seq_slots, cu_rows = ragged([rows], [slot], device)
    snapshots = torch.empty(rows, 3, 6, 10, device=device)
    full = verify(t, seq_slots, cu_rows, snapshots)
    for r in ROW_COUNTS:
        part_slots, part_cu = ragged([r], [slot], device)
        part_snapshots = torch.empty(r, 3, 6, 10, device=device)
        assert torch.equal(verify(t, part_slots, part_cu, part_snapshots, rows=slice(0, r)), full[:r]), f"out, rows {r}"
        assert torch.equal(part_snapshots, snapshots[:r]), f"snapshots, rows {r}"
        state = t["state"].clone()
        fold(t, state, seq_slots, cu_rows, [r])
        assert torch.equal(state[slot], snapshots[r - 1]), f"fold of {r} rows"


@pytest.mark.parametrize("kind", KINDS)
def test_verify_batch_invariant(kind, device):
    """A sequence alone equals the same sequence among others (other slots, other row counts)."""
    counts, slots = [4, 1, 7], [2, 0, 4]
    t = make(sum(counts), 2, 16, 40, kind, device, seed=3)
    seq_slots, cu_rows = ragged(counts, slots, device)
    batched = verify(t, seq_slots, cu_rows)
    start = 0
    for n, slot in zip(counts, slots):
        alone_slots, alone_cu = ragged([n], [slot], device)
        alone = verify(t, alone_slots, alone_cu, rows=slice(start, start + n))
        assert torch.equal(alone, batched[start : start + n]), f"slot {slot}"
        start += n


@pytest.mark.parametrize("kind", KINDS)
def test_every_tile_gives_the_same_bits(kind, device):
    """The sums over D_K are written out in one order (sum_halves), so other value blocks and warp
    counts (other register layouts on the GPU) give bitwise the pinned tile's outputs, snapshots and
    committed state; a config whose BLOCK_K is not the pinned one is refused."""
    counts, slots = [1, 4, 9], [3, 0, 4]
    heads, d_k, d_v = 2, 16, 40
    t = make(sum(counts), heads, d_k, d_v, kind, device, seed=11)
    seq_slots, cu_rows = ragged(counts, slots, device)

    def run(config):
        state, snapshots = t["state"].clone(), torch.empty(sum(counts), heads, d_k, d_v, device=device)
        out = delta_rule_verify(state, t["query"], t["key"], t["value"], t["decay"], t["beta"], seq_slots, cu_rows, snapshots,
                                config=config)
        return out, snapshots, state

    pinned = run(None)
    block_k = delta_rule_config(d_k, d_v).BLOCK_K
    for block_v, warps in ((8, 1), (16, 2), (32, 4), (64, 8)):
        other = run(DeltaRuleConfig(block_k, block_v, warps))
        for name, a, b in zip(("out", "snapshots", "state"), pinned, other):
            assert torch.equal(a, b), f"{name}, BLOCK_V {block_v}, {warps} warps"
    with pytest.raises(ValueError, match="BLOCK_K"):
        run(DeltaRuleConfig(2 * block_k, 16, 2))


def test_one_sequence_of_many_rows_takes_the_narrow_tile():
    """The tile by launch (delta_rule_config): one sequence of ONE_SEQUENCE_MIN_ROWS rows or more
    walks 16 value columns in 2 warps, anything else the 32-column tile in 4; BLOCK_K, which fixes
    the sums' order, is the same in both (test_every_tile_gives_the_same_bits holds them bitwise)."""
    wide, narrow = DeltaRuleConfig(128, 32, 4), DeltaRuleConfig(128, 16, 2)
    assert delta_rule_config(128, 128) == wide
    assert delta_rule_config(128, 128, 1, ONE_SEQUENCE_MIN_ROWS) == narrow
    assert delta_rule_config(128, 128, 1, 17) == narrow
    assert delta_rule_config(128, 128, 1, ONE_SEQUENCE_MIN_ROWS - 1) == wide
    assert delta_rule_config(128, 128, 2, 18) == wide
    assert delta_rule_config(16, 40, 1, 9) == DeltaRuleConfig(16, 16, 1)  # small heads: one warp either way


@pytest.mark.parametrize("kind", KINDS)
def test_snapshot_mode_same_outputs(kind, device):
    """Both rollback modes read the same outputs: storing snapshots changes no output bit."""
    counts, slots = [3, 5], [1, 3]
    t = make(sum(counts), 3, 6, 10, kind, device, seed=4)
    seq_slots, cu_rows = ragged(counts, slots, device)
    with_snapshots = verify(t, seq_slots, cu_rows, torch.empty(sum(counts), 3, 6, 10, device=device))
    assert torch.equal(with_snapshots, verify(t, seq_slots, cu_rows))


def test_gdn_decay_is_a_broadcast(device):
    """GDN's per-head decay [R, H, 1] gives the bits of the same decay repeated over D_K (KDA layout)."""
    counts, slots = [3, 5], [1, 3]
    t = make(sum(counts), 3, 6, 10, "gdn", device, seed=5)
    seq_slots, cu_rows = ragged(counts, slots, device)
    wide = dict(t, decay=t["decay"].expand(-1, -1, 6).contiguous())
    snapshots, wide_snapshots = (torch.empty(sum(counts), 3, 6, 10, device=device) for _ in range(2))
    assert torch.equal(verify(t, seq_slots, cu_rows, snapshots), verify(wide, seq_slots, cu_rows, wide_snapshots))
    assert torch.equal(snapshots, wide_snapshots)


@pytest.mark.parametrize("kind", KINDS)
def test_recurrent_contract(kind, device):
    """T=K rows in one launch == K launches of T=1 with a one-row fold between them == a 3 + 5
    split: outputs, and final states (fold of K rows, snapshot K-1, stepwise folds), bitwise."""
    k, slot = 8, 2
    t = make(k, 2, 16, 40, kind, device, seed=6)
    seq_slots, cu_rows = ragged([k], [slot], device)
    snapshots = torch.empty(k, 2, 16, 40, device=device)
    one_launch = verify(t, seq_slots, cu_rows, snapshots)
    final = t["state"].clone()
    fold(t, final, seq_slots, cu_rows, [k])
    assert torch.equal(final[slot], snapshots[k - 1])

    for chunks in ([1] * k, [3, 5]):
        state, outs, start = t["state"].clone(), [], 0
        for n in chunks:
            part_slots, part_cu = ragged([n], [slot], device)
            rows = slice(start, start + n)
            outs.append(verify(t, part_slots, part_cu, state=state, rows=rows))
            fold(t, state, part_slots, part_cu, [n], rows=rows)
            start += n
        assert torch.equal(torch.cat(outs), one_launch), f"outputs, chunks {chunks}"
        assert torch.equal(state, final), f"final state, chunks {chunks}"


@pytest.mark.parametrize("kind", KINDS)
def test_woa_equals_snapshot(kind, device):
    """Rollback to any accepted prefix: folding rows 0..a-1 into the committed state (WOA) gives
    exactly verify's snapshot of row a-1, per sequence of a mixed batch."""
    counts, slots = [5, 2, 6], [4, 1, 0]
    t = make(sum(counts), 3, 6, 10, kind, device, seed=7)
    seq_slots, cu_rows = ragged(counts, slots, device)
    snapshots = torch.empty(sum(counts), 3, 6, 10, device=device)
    verify(t, seq_slots, cu_rows, snapshots)
    for consumed in ([1, 1, 1], [3, 2, 4], [5, 2, 6]):
        state = t["state"].clone()
        fold(t, state, seq_slots, cu_rows, consumed)
        for s, (slot, n) in enumerate(zip(slots, consumed)):
            assert torch.equal(state[slot], snapshots[cu_rows[s] + n - 1]), f"slot {slot}, {n} rows consumed"


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_state_negative_control(kind, device):
    """A state stored in bf16 between one-row steps must NOT reproduce the fp32 path: the
    contract tests above can see a state that loses bits between launches."""
    k, slot = 8, 2
    t = make(k, 2, 16, 40, kind, device, seed=8)
    seq_slots, cu_rows = ragged([k], [slot], device)
    one_launch = verify(t, seq_slots, cu_rows)
    state, outs = t["state"].clone(), []
    one_slots, one_cu = ragged([1], [slot], device)
    for i in range(k):
        outs.append(verify(t, one_slots, one_cu, state=state, rows=slice(i, i + 1)))
        fold(t, state, one_slots, one_cu, [1], rows=slice(i, i + 1))
        state = state.bfloat16().float()
    assert not torch.equal(torch.cat(outs)[1:], one_launch[1:])


def test_launchers_reject_bad_tensors(device):
    t = make(3, 2, 6, 10, "kda", device)
    seq_slots, cu_rows = ragged([3], [0], device)
    with pytest.raises(ValueError, match="state must be float32"):
        verify(t, seq_slots, cu_rows, state=t["state"].bfloat16())
    with pytest.raises(ValueError, match="state must be contiguous"):
        verify(t, seq_slots, cu_rows, state=t["state"].transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(ValueError, match="decay"):
        verify(dict(t, decay=t["decay"][..., :2]), seq_slots, cu_rows)
    with pytest.raises(ValueError, match="snapshots"):
        verify(t, seq_slots, cu_rows, snapshots=torch.empty(3, 2, 6, 9, device=device))
    with pytest.raises(ValueError, match="consumed"):
        delta_rule_fold(t["state"], t["key"], t["value"], t["decay"], t["beta"], seq_slots, cu_rows,
                        torch.ones(2, dtype=torch.int32, device=device))


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_out_is_the_fp32_out_rounded(kind, device):
    """out in bf16 (the layers' activation dtype) holds each fp32 output rounded to nearest even,
    bitwise what .to(torch.bfloat16) of the fp32 output gives (the interpreter rounds on the bits)."""
    counts, slots = [3, 1, 5], [1, 3, 0]
    t = make(sum(counts), 2, 16, 40, kind, device, seed=10)
    t["value"] = t["value"] * 300  # outputs of many magnitudes, so that truncating would differ from rounding
    seq_slots, cu_rows = ragged(counts, slots, device)
    wide = verify(t, seq_slots, cu_rows)
    narrow = torch.empty(wide.shape, dtype=torch.bfloat16, device=device)
    assert verify(t, seq_slots, cu_rows, out=narrow) is narrow
    assert torch.equal(narrow, wide.to(torch.bfloat16))
    assert not torch.equal(narrow, (wide.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)), \
        "the data does not tell rounding from truncation"
