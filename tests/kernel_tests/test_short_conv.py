"""kernels/short_conv.py: conv_rows and next_window against their torch references, row and batch
invariance, conv_rows' runs (a sequence's rows split between programs: the same bits), the
verify-then-rollback contract of the conv window (a one-row sequence's conv_rows commits its row,
kernels/one_row_commit.py), NaN-poisoned outputs.

Tolerances (conv_rows vs conv_rows_ref, general inputs):
  fp32: rtol 1e-6 (8 ulps). The W-tap sum is bit-identical (same order, product and sum rounded
        separately: test_conv_rows_exact_where_silu_saturates checks it with torch.equal); what
        differs is SiLU's exp (torch's SIMD or scalar exp, numpy's in the interpreter, the GPU's
        ex2-based one) and division, a few ulps at most (measured: 2.5e-7 relative).
  bf16: rtol 2**-7 (one bf16 ulp): the same fp32 ulp differences can flip SiLU's final rounding
        to bf16 (measured: never, in the interpreter).
  atol 1e-12 in both: SiLU's relative error stays bounded down to 0.
"""

import pytest
import torch

from hybrid_kernels.short_conv import (CONV_MAX_RUNS, PREFILL_MAX_RUNS, conv_rows, conv_rows_ref, conv_runs, next_window,
                                       next_window_ref, prefill_runs)
from .conftest import ROW_COUNTS, assert_close, nan_like

TOLERANCES = {torch.float32: (1e-6, 1e-12), torch.bfloat16: (2**-7, 1e-12)}  # (rtol, atol)
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}
N_SLOTS = 6


def ragged(counts: list[int], slots: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_slots [S], cu_rows [S+1]) int32 for sequences of `counts` rows in `slots`."""
    cu = [0]
    for n in counts:
        cu.append(cu[-1] + n)
    return torch.tensor(slots, dtype=torch.int32, device=device), torch.tensor(cu, dtype=torch.int32, device=device)


def shifted(window: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """window [C, W-1] advanced by one input row [C]: what a one-row sequence's conv_rows commits."""
    return torch.cat((window, row[:, None]), dim=1)[:, 1:]


def make(rows: int, channels: int, width: int, dtype, device, seed: int = 0, saturate: bool = False):
    """(window [N_SLOTS, C, W-1], inputs [rows, C], weight [C, W]). saturate: every pre-activation
    above 20, where SiLU(x) = x in fp32, so the output is the tap sum itself."""
    g = torch.Generator().manual_seed(seed)
    window = torch.randn(N_SLOTS, channels, width - 1, generator=g) * 2
    inputs = torch.randn(rows, channels, generator=g) * 2
    weight = torch.randn(channels, width, generator=g)
    if saturate:
        window, inputs, weight = window.abs() * 5 + 20, inputs.abs() * 5 + 20, weight.abs() + 0.5
    return window.to(device, dtype), inputs.to(device, dtype), weight.to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("width", [2, 3, 4], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("channels", [37, 300], ids=lambda c: f"C{c}")
def test_conv_rows_matches_ref(dtype, width, channels, device):
    """The one-row sequence (slot 3) commits its row to its window, as the reference does; no
    other window is written."""
    counts, slots = [1, 5, 2, 9], [3, 0, 5, 1]  # rows fewer and more than W-1, slots out of order
    window, inputs, weight = make(sum(counts), channels, width, dtype, device)
    seq_slots, cu_rows = ragged(counts, slots, device)
    got_window, want_window = window.clone(), window.clone()
    out = nan_like(inputs)
    got = conv_rows(got_window, inputs, weight, seq_slots, cu_rows, out)
    want = conv_rows_ref(want_window, inputs, weight, seq_slots, cu_rows)
    assert got is out and got.dtype == dtype
    assert_close(f"conv_rows {DTYPE_IDS[dtype]}", got, want, *TOLERANCES[dtype])  # also fails on NaN
    assert torch.equal(got_window, want_window)
    assert torch.equal(got_window[3], shifted(window[3], inputs[0])), "the one-row sequence did not commit its row"
    for slot in (0, 1, 2, 4, 5):
        assert torch.equal(got_window[slot], window[slot]), f"conv_rows wrote slot {slot}'s window"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("width", [2, 4], ids=lambda w: f"W{w}")
def test_conv_rows_exact_where_silu_saturates(dtype, width, device):
    """Same tap order, same roundings: bit-identical to the reference once SiLU is the identity."""
    counts, slots = [1, 3, 7], [2, 4, 0]
    window, inputs, weight = make(sum(counts), 37, width, dtype, device, seed=1, saturate=True)
    seq_slots, cu_rows = ragged(counts, slots, device)
    got = conv_rows(window.clone(), inputs, weight, seq_slots, cu_rows)
    want = conv_rows_ref(window.clone(), inputs, weight, seq_slots, cu_rows)
    assert (want.float() > 20).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_conv_rows_row_invariant(dtype, device):
    """op(x[:r]) == op(x)[:r] bitwise for r in ROW_COUNTS (one sequence)."""
    window, inputs, weight = make(max(ROW_COUNTS), 37, 4, dtype, device, seed=2)
    seq_slots, cu_rows = ragged([max(ROW_COUNTS)], [4], device)
    full = conv_rows(window, inputs, weight, seq_slots, cu_rows)
    for r in ROW_COUNTS:
        seq_slots, cu_rows = ragged([r], [4], device)
        part = conv_rows(window.clone(), inputs[:r], weight, seq_slots, cu_rows)  # a clone: one row commits
        assert torch.equal(part, full[:r]), f"rows {r}"


@pytest.mark.parametrize("width", [2, 4], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_conv_rows_runs_give_the_same_bits(dtype, width, device):
    """Each sequence's rows split into 1 .. 5 runs (fewer rows than runs, an empty sequence, a
    one-row sequence that commits, runs starting inside the window's reach and past it): every
    output row and every window torch.equal the one-run launch's, and every row written."""
    counts, slots = [9, 1, 0, 2, 5, 3], [0, 3, 5, 1, 4, 2]
    window, inputs, weight = make(sum(counts), 37, width, dtype, device, seed=7)
    seq_slots, cu_rows = ragged(counts, slots, device)
    want_window = window.clone()
    want = conv_rows(want_window, inputs, weight, seq_slots, cu_rows, runs=1)
    for runs in range(2, 6):
        got_window = window.clone()
        got = conv_rows(got_window, inputs, weight, seq_slots, cu_rows, nan_like(inputs), runs=runs)
        assert torch.equal(got, want), f"{runs} runs"  # a NaN (a row left unwritten) fails too
        assert torch.equal(got_window, want_window), f"{runs} runs: the windows"
    with pytest.raises(ValueError, match="runs must be at least 1"):
        conv_rows(window.clone(), inputs, weight, seq_slots, cu_rows, runs=0)


@pytest.mark.parametrize("run_rows", [4, 16])
def test_a_prefills_runs_give_the_same_bits(run_rows, device):
    """A long prompt (and a short one beside it) walked in prefill_runs' runs of about run_rows rows:
    every row and window torch.equal the one-run walk's."""
    counts, slots = [70, 3], [1, 0]
    window, inputs, weight = make(sum(counts), 37, 4, torch.bfloat16, device, seed=11)
    seq_slots, cu_rows = ragged(counts, slots, device)
    want_window = window.clone()
    want = conv_rows(want_window, inputs, weight, seq_slots, cu_rows, runs=1)
    runs = prefill_runs(sum(counts), len(counts), run_rows)
    assert runs > 1
    got_window = window.clone()
    got = conv_rows(got_window, inputs, weight, seq_slots, cu_rows, nan_like(inputs), runs=runs)
    assert torch.equal(got, want) and torch.equal(got_window, want_window)


def test_prefill_runs_are_powers_of_two_up_to_a_cap():
    assert prefill_runs(2048, 1, 32) == 64 and prefill_runs(2048, 2, 32) == 32 and prefill_runs(100, 1, 32) == 4
    assert prefill_runs(8192 * 8, 1, 1) == PREFILL_MAX_RUNS and prefill_runs(5, 1, 32) == 1 and prefill_runs(0, 0, 8) == 1
    with pytest.raises(ValueError, match="run_rows must be at least 1"):
        prefill_runs(64, 1, 0)


def test_conv_runs_by_batch_shape():
    """One run for a decode (a row a sequence) and for a batch whose sequences fill the grid; a few
    sequences of many rows split up to CONV_MAX_RUNS, within CONV_TARGET_PROGRAMS programs (the 2B
    model's 8192-channel conv: 64 programs a sequence)."""
    assert conv_runs(64, 64, 8192) == 1 and conv_runs(1, 1, 8192) == 1 and conv_runs(0, 0, 8192) == 1
    assert conv_runs(2, 1, 8192) == 2 and conv_runs(10, 1, 8192) == CONV_MAX_RUNS == 4
    assert conv_runs(18, 2, 8192) == 2 and conv_runs(72, 8, 8192) == 1 and conv_runs(576, 72, 8192) == 1
    assert conv_runs(10, 1, 37) == CONV_MAX_RUNS  # one program a sequence: room for every run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_conv_rows_batch_invariant(dtype, device):
    """A sequence's outputs alone equal its outputs among other sequences, bitwise."""
    counts, slots = [4, 1, 6], [5, 2, 3]
    window, inputs, weight = make(sum(counts), 37, 3, dtype, device, seed=3)
    seq_slots, cu_rows = ragged(counts, slots, device)
    batched = conv_rows(window.clone(), inputs, weight, seq_slots, cu_rows)  # clones: the one-row sequence commits
    start = 0
    for n, slot in zip(counts, slots):
        alone_slots, alone_cu = ragged([n], [slot], device)
        alone = conv_rows(window.clone(), inputs[start : start + n], weight, alone_slots, alone_cu)
        assert torch.equal(alone, batched[start : start + n]), f"slot {slot}"
        start += n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_strided_rows_read_in_place(dtype, device):
    """Inputs whose rows are strided (a column slice of a wider projection output, as a layer
    hands them over) give the bits of the same rows made dense, in conv_rows and next_window."""
    counts, slots = [1, 5, 18], [3, 0, 5]  # 18 rows: past one tile
    window, dense, weight = make(sum(counts), 37, 4, dtype, device, seed=6)
    wide = torch.full((sum(counts), 37 + 11), float("nan"), dtype=dtype, device=device)
    wide[:, 3 : 3 + 37] = dense
    strided = wide[:, 3 : 3 + 37]  # rows 48 elements apart, each row's 37 channels dense
    assert strided.stride() == (48, 1) and not strided.is_contiguous()
    seq_slots, cu_rows = ragged(counts, slots, device)
    want_window, got_window = window.clone(), window.clone()  # the one-row sequence commits its row
    want = conv_rows(want_window, dense, weight, seq_slots, cu_rows)
    assert torch.equal(conv_rows(got_window, strided, weight, seq_slots, cu_rows), want)
    assert torch.equal(got_window, want_window)
    consumed = torch.tensor([1, 3, 18], dtype=torch.int32, device=device)
    got, expected = window.clone(), window.clone()
    next_window(got, strided, seq_slots, cu_rows, consumed)
    next_window(expected, dense, seq_slots, cu_rows, consumed)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("width", [2, 3, 4], ids=lambda w: f"W{w}")
def test_next_window_matches_ref(dtype, width, device):
    counts, slots = [1, 5, 2, 9], [3, 0, 5, 1]
    consumed = [1, 2, 2, 9]  # fewer than, as many as and more than W-1 rows; all rows; slot 3: one row, left alone
    window, inputs, _ = make(sum(counts), 37, width, dtype, device, seed=4)
    seq_slots, cu_rows = ragged(counts, slots, device)
    consumed_t = torch.tensor(consumed, dtype=torch.int32, device=device)
    got, want = window.clone(), window.clone()
    next_window(got, inputs, seq_slots, cu_rows, consumed_t)
    next_window_ref(want, inputs, seq_slots, cu_rows, consumed_t)
    assert torch.equal(got, want)
    for slot in set(range(N_SLOTS)) - set(slots) | {3}:
        assert torch.equal(got[slot], window[slot]), f"slot {slot} (outside the batch, or of one row) was written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_conv_recurrent_contract(dtype, device):
    """K rows in one launch == K one-row launches, each committing its row (next_window then leaves
    it) == a split (3 + 5) rolled forward by next_window: outputs and final windows bitwise."""
    k, slot = 8, 2
    window, inputs, weight = make(k, 37, 4, dtype, device, seed=5)
    seq_slots, cu_rows = ragged([k], [slot], device)
    one_launch = conv_rows(window, inputs, weight, seq_slots, cu_rows)
    final = window.clone()
    next_window(final, inputs, seq_slots, cu_rows, torch.tensor([k], dtype=torch.int32, device=device))

    for chunks in ([1] * k, [3, 5]):
        state, outs, start = window.clone(), [], 0
        for n in chunks:
            part_slots, part_cu = ragged([n], [slot], device)
            outs.append(conv_rows(state, inputs[start : start + n], weight, part_slots, part_cu))
            next_window(state, inputs[start : start + n], part_slots, part_cu, torch.tensor([n], dtype=torch.int32, device=device))
            start += n
        assert torch.equal(torch.cat(outs), one_launch), f"outputs, chunks {chunks}"
        assert torch.equal(state, final), f"window, chunks {chunks}"


def test_launchers_reject_bad_tensors(device):
    window, inputs, weight = make(3, 8, 3, torch.float32, device)
    seq_slots, cu_rows = ragged([3], [0], device)
    with pytest.raises(ValueError, match="weight dtype"):
        conv_rows(window, inputs, weight.bfloat16(), seq_slots, cu_rows)
    with pytest.raises(ValueError, match="window must be contiguous"):
        conv_rows(window.transpose(0, 1).contiguous().transpose(0, 1), inputs, weight, seq_slots, cu_rows)
    with pytest.raises(ValueError, match="cu_rows"):
        conv_rows(window, inputs, weight, seq_slots, cu_rows.long())
    with pytest.raises(ValueError, match="consumed"):
        next_window(window, inputs, seq_slots, cu_rows, torch.ones(2, dtype=torch.int32, device=device))
    wide_window, wide_inputs, wide_weight = make(3, 8, 5, torch.float32, device)
    with pytest.raises(ValueError, match="a conv of width 5; the kernel holds at most 3 earlier rows"):
        conv_rows(wide_window, wide_inputs, wide_weight, seq_slots, cu_rows)


def test_one_row_conv_leaves_the_scratch_slot(device):
    """Padding sequences of one row in the scratch slot write nothing there, while a real one-row
    sequence of the same launch commits its row."""
    counts, slots, scratch = [1, 1, 1, 0], [0, 4, 4, 4], 4
    window, inputs, weight = make(sum(counts), 37, 4, torch.float32, device, seed=9)
    got = window.clone()
    conv_rows(got, inputs, weight, *ragged(counts, slots, device), scratch_slot=scratch)
    assert torch.equal(got[scratch], window[scratch]), "a padding sequence wrote the scratch slot"
    assert torch.equal(got[0], shifted(window[0], inputs[0])), "the real one-row sequence did not commit its row"
