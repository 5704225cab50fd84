"""The sequence-walking kernels under a graph bucket's padding (verifier/model/padding.py): the real
sequences, then several padding sequences of rows sharing a scratch slot, then many padding
sequences with no rows in that slot, all of which keep nothing at rollback. Real rows' outputs and
real slots' state are torch.equal to the unpadded launch; the scratch slot's committed state is
never written; outputs are NaN-poisoned so an unwritten real row fails."""

import pytest
import torch

from hybrid_kernels.short_conv import conv_rows, next_window
from hybrid_kernels.fused_rollback import keep_snapshots, keep_snapshots_ref

from . import test_delta_rule as delta, test_short_conv as conv
from .conftest import nan_like

COUNTS, SLOTS, KEPT = [3, 1, 5], [0, 3, 1], [2, 1, 5]  # the real step: rows, slots, kept rows
# padding rows in chunks, as padding.pad_batch lays them out (PAD_CHUNK rows at most; 2 here to
# keep the interpreted launches small), each chunk walking from the scratch slot's own state
PADDING_COUNTS, EMPTY_SEQUENCES = [2, 2, 1], 6


def padded(counts, slots, scratch):
    """The padded layout: the real sequences, the padding sequences' rows, then empty sequences."""
    padding = len(PADDING_COUNTS) + EMPTY_SEQUENCES
    return counts + PADDING_COUNTS + [0] * EMPTY_SEQUENCES, slots + [scratch] * padding


def int32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


REAL_ROWS = sum(COUNTS)
ALL_ROWS = REAL_ROWS + sum(PADDING_COUNTS)
PADDED_KEPT = KEPT + [0] * (len(PADDING_COUNTS) + EMPTY_SEQUENCES)


@pytest.mark.parametrize("kind", delta.KINDS)
@pytest.mark.parametrize("shape", delta.SHAPES, ids=delta.shape_id)
def test_delta_rule_verify_padded(kind, shape, device):
    heads, d_k, d_v = shape
    scratch = delta.N_SLOTS - 1
    t = delta.make(ALL_ROWS, heads, d_k, d_v, kind, device, seed=5)
    before = t["state"].clone()
    real = slice(0, REAL_ROWS)
    want_snapshots = torch.empty(REAL_ROWS, heads, d_k, d_v, device=device)
    want = delta.verify(t, *delta.ragged(COUNTS, SLOTS, device), want_snapshots, rows=real)
    out = nan_like(torch.empty(ALL_ROWS, heads, d_v, device=device))
    snapshots = nan_like(torch.empty(ALL_ROWS, heads, d_k, d_v, device=device))
    delta.verify(t, *delta.ragged(*padded(COUNTS, SLOTS, scratch), device), snapshots, out)
    assert torch.equal(out[real], want), "real rows' outputs changed under padding (or were not written)"
    assert torch.equal(snapshots[real], want_snapshots), "real rows' snapshots changed under padding"
    assert not torch.isnan(out[REAL_ROWS:]).any(), "the padding rows were not computed"
    assert torch.equal(t["state"], before), "verify wrote a committed state"


@pytest.mark.parametrize("kind", delta.KINDS)
def test_delta_rule_fold_padded(kind, device):
    heads, d_k, d_v = delta.SHAPES[0]
    scratch = delta.N_SLOTS - 1
    t = delta.make(ALL_ROWS, heads, d_k, d_v, kind, device, seed=6)
    want, got = t["state"].clone(), t["state"].clone()
    delta.fold(t, want, *delta.ragged(COUNTS, SLOTS, device), KEPT, rows=slice(0, REAL_ROWS))
    delta.fold(t, got, *delta.ragged(*padded(COUNTS, SLOTS, scratch), device), PADDED_KEPT)
    assert torch.equal(got, want), "a slot's state differs from the unpadded fold"
    assert torch.equal(got[scratch], t["state"][scratch]), "the fold wrote the scratch slot"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=conv.DTYPE_IDS.get)
def test_conv_rows_padded(dtype, device):
    scratch = conv.N_SLOTS - 1
    window, inputs, weight = conv.make(ALL_ROWS, 37, 4, dtype, device, seed=7)
    want_window, got_window = window.clone(), window.clone()  # the one-row sequence (slot 3) commits its row
    want = conv_rows(want_window, inputs[:REAL_ROWS], weight, *conv.ragged(COUNTS, SLOTS, device))
    out = nan_like(inputs)
    conv_rows(got_window, inputs, weight, *conv.ragged(*padded(COUNTS, SLOTS, scratch), device), out, scratch_slot=scratch)
    assert torch.equal(out[:REAL_ROWS], want), "real rows' conv outputs changed under padding"
    assert not torch.isnan(out[REAL_ROWS:]).any(), "the padding rows were not computed"
    assert torch.equal(got_window, want_window), "a window differs from the unpadded launch's"
    assert torch.equal(got_window[scratch], window[scratch]), "conv_rows wrote the scratch slot"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=conv.DTYPE_IDS.get)
def test_next_window_padded(dtype, device):
    scratch = conv.N_SLOTS - 1
    window, inputs, _ = conv.make(ALL_ROWS, 300, 4, dtype, device, seed=8)
    want, got = window.clone(), window.clone()
    next_window(want, inputs[:REAL_ROWS], *conv.ragged(COUNTS, SLOTS, device), int32(KEPT, device))
    next_window(got, inputs, *conv.ragged(*padded(COUNTS, SLOTS, scratch), device), int32(PADDED_KEPT, device))
    assert torch.equal(got, want), "a slot's window differs from the unpadded rollback"
    assert torch.equal(got[scratch], window[scratch]), "next_window wrote the scratch slot"


def test_keep_snapshots_padded_and_matches_ref(device):
    """Snapshot-mode rollback: the kernel copies each real sequence's snapshot of its last kept row
    (a sequence of more than one row), bitwise as its reference does, and touches neither the
    scratch slot nor slots outside the batch."""
    heads, d_k, d_v = 3, 6, 10
    scratch = delta.N_SLOTS - 1
    g = torch.Generator().manual_seed(9)
    state = torch.randn(delta.N_SLOTS, heads, d_k, d_v, generator=g).to(device)
    snapshots = torch.randn(ALL_ROWS, heads, d_k, d_v, generator=g).to(device)
    seq_slots, cu_rows = delta.ragged(*padded(COUNTS, SLOTS, scratch), device)
    got, want = state.clone(), state.clone()
    keep_snapshots(got, snapshots, seq_slots, cu_rows, int32(PADDED_KEPT, device))
    keep_snapshots_ref(want, snapshots, seq_slots, cu_rows, int32(PADDED_KEPT, device))
    assert torch.equal(got, want)
    start = 0
    for slot, n, kept in zip(SLOTS, COUNTS, KEPT):
        if n == 1:  # its verify committed its one row (kernels/delta_rule.py): nothing to copy
            assert torch.equal(got[slot], state[slot]), f"slot {slot}, of one row, was written"
        else:
            assert torch.equal(got[slot], snapshots[start + kept - 1]), f"slot {slot} did not take snapshot {kept - 1}"
        start += n
    assert 1 in COUNTS and any(n > 1 for n in COUNTS), "the batch must hold both kinds of sequence"
    assert torch.equal(got[scratch], state[scratch]), "the scratch slot was written"
    assert torch.equal(got[2], state[2]), "a slot outside the batch was written"
