"""kernels/short_conv.py conv_rows with a carry (verifier/model/carry.py's banks): each sequence reads
its slot's window of bank banks[s] and the first carried[s] carried rows of that bank, and writes
its slot's other bank alone: a decode the window after its row, a verify of more rows the window
before its rows and its raw inputs. Checked bitwise: against the reference (outputs too where SiLU
saturates, and every bank written), against the in-place path (a window updated past the kept
rows by next_window, then a plain conv_rows), across runs, and for the scratch slot (never written)."""

import pytest
import torch

from kernels.short_conv import carry_shape, conv_rows, conv_rows_ref, next_window

from .conftest import assert_close, nan_like
from .test_short_conv import DTYPE_IDS, N_SLOTS, TOLERANCES, make, ragged

CARRY_ROWS = 6  # a bank's rows: max_k + 1
SCRATCH = N_SLOTS - 1


def banks_of(window: torch.Tensor, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """(windows [2, N_SLOTS, C, W-1], carried inputs [2, N_SLOTS, CR, C]): bank 0's windows are
    `window`, the rest random, and the scratch slot's window zero (as a pool keeps it)."""
    g = torch.Generator().manual_seed(seed)
    channels, keep = window.shape[1], window.shape[2]
    windows = torch.stack((window.cpu(), torch.randn(N_SLOTS, channels, keep, generator=g))).to(window)
    windows[:, SCRATCH] = 0
    carry = torch.randn(carry_shape(N_SLOTS, CARRY_ROWS, channels), generator=g).to(window)
    return windows, carry


def int32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("runs", [1, 2, 4])
def test_banked_conv_rows_matches_ref(dtype, runs, device):
    """A decode, verifies of more rows, a padding sequence with no rows (scratch slot), each reading
    bank 0 or 1 with 0 to 3 carried rows: outputs to the reference's tolerance; every bank written
    bitwise the reference's, and only the other banks of the slots of real sequences."""
    counts, slots = [1, 4, 0, 6, 2], [3, 0, SCRATCH, 1, 2]
    carried, banks = [2, 3, 0, 1, 0], [1, 0, 0, 1, 1]
    window, inputs, weight = make(sum(counts), 37, 4, dtype, device, seed=3)
    windows, carry = banks_of(window)
    seq_slots, cu_rows = ragged(counts, slots, device)
    args = dict(scratch_slot=SCRATCH, carried=int32(carried, device), banks=int32(banks, device))
    got_windows, got_carry, out = windows.clone(), carry.clone(), nan_like(inputs)
    got = conv_rows(got_windows, inputs, weight, seq_slots, cu_rows, out, runs=runs, carry=got_carry, **args)
    want_windows, want_carry = windows.clone(), carry.clone()
    want = conv_rows_ref(want_windows, inputs, weight, seq_slots, cu_rows, carry=want_carry, **args)
    assert got is out
    assert_close(f"banked conv_rows {DTYPE_IDS[dtype]}", got, want, *TOLERANCES[dtype])
    assert torch.equal(got_windows, want_windows) and torch.equal(got_carry, want_carry)
    written = {(1 - bank, slot) for slot, bank, n in zip(slots, banks, counts) if n and slot != SCRATCH}
    for bank in (0, 1):
        for slot in range(N_SLOTS):
            if (bank, slot) not in written:
                assert torch.equal(got_windows[bank, slot], windows[bank, slot]), f"bank {bank} window of slot {slot} written"
                assert torch.equal(got_carry[bank, slot], carry[bank, slot]), f"bank {bank} carried rows of slot {slot} written"
    # the decode's other bank holds no rows (it carries none): its carried rows are left as they were
    assert torch.equal(got_carry[0, 3], carry[0, 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_banked_conv_equals_window_update_then_conv(dtype, device):
    """Step 1 verifies three sequences from bank 0 and keeps some rows of each; step 2 (a decode, a
    verify of more rows, one that keeps rows again) reads bank 1 with those rows carried. Bitwise
    the same outputs as the in-place path (next_window past the kept rows, then conv_rows), and the
    windows each bank then holds are the in-place windows after the rows every step keeps."""
    counts1, slots, kept1 = [4, 3, 2], [0, 3, 1], [3, 1, 2]
    counts2 = [1, 3, 2]
    window, inputs1, weight = make(sum(counts1), 37, 4, dtype, device, seed=4)
    _, inputs2, _ = make(sum(counts2), 37, 4, dtype, device, seed=5)
    seq_slots, cu1 = ragged(counts1, slots, device)
    _, cu2 = ragged(counts2, slots, device)

    in_place = window.clone()
    want1 = conv_rows(in_place, inputs1, weight, seq_slots, cu1)
    next_window(in_place, inputs1, seq_slots, cu1, int32(kept1, device))
    want2 = conv_rows(in_place, inputs2, weight, seq_slots, cu2)  # slot 0's decode commits its row in place

    windows, carry = banks_of(window)
    got1 = conv_rows(windows, inputs1, weight, seq_slots, cu1, carried=int32([0, 0, 0], device), banks=int32([0, 0, 0], device),
                     carry=carry)
    got2 = conv_rows(windows, inputs2, weight, seq_slots, cu2, carried=int32(kept1, device), banks=int32([1, 1, 1], device),
                     carry=carry)
    assert torch.equal(got1, want1) and torch.equal(got2, want2)
    assert torch.equal(windows[0, 0], in_place[0]), "the decode's window after its row"
    for s, slot in enumerate(slots[1:], start=1):  # verifies of more rows: the window before their rows, then their rows
        assert torch.equal(windows[0, slot], in_place[slot]), f"slot {slot}: bank 0 window"
        assert torch.equal(carry[0, slot, : counts2[s]], inputs2[cu2[s] : cu2[s + 1]]), f"slot {slot}: bank 0 carried rows"


def test_banked_conv_leaves_the_scratch_slot(device):
    """Padding sequences (scratch slot) with one row and with more read its zero bank-0 window and
    write neither bank: they share the slot."""
    counts, slots = [1, 3, 2], [SCRATCH, SCRATCH, 0]
    window, inputs, weight = make(sum(counts), 37, 4, torch.float32, device, seed=6)
    windows, carry = banks_of(window)
    before = windows.clone(), carry.clone()
    seq_slots, cu_rows = ragged(counts, slots, device)
    conv_rows(windows, inputs, weight, seq_slots, cu_rows, scratch_slot=SCRATCH, carried=int32([0, 0, 0], device),
              banks=int32([0, 0, 0], device), carry=carry)
    assert torch.equal(windows[:, SCRATCH], before[0][:, SCRATCH]) and torch.equal(carry[:, SCRATCH], before[1][:, SCRATCH])
    assert not torch.equal(windows[1, 0], before[0][1, 0]), "the real sequence wrote nothing"


def test_banked_conv_rejects_bad_tensors(device):
    window, inputs, weight = make(3, 37, 4, torch.float32, device)
    windows, carry = banks_of(window)
    seq_slots, cu_rows = ragged([3], [0], device)
    ones = int32([1], device)
    with pytest.raises(ValueError, match="carry, carried and banks come together"):
        conv_rows(windows, inputs, weight, seq_slots, cu_rows, carry=carry, carried=ones)
    with pytest.raises(ValueError, match=r"window must be \[2, n_slots, C, W-1\]"):
        conv_rows(window, inputs, weight, seq_slots, cu_rows, carry=carry, carried=ones, banks=ones)
    with pytest.raises(ValueError, match="carry"):
        conv_rows(windows, inputs, weight, seq_slots, cu_rows, carry=carry[:, :, :, :5], carried=ones, banks=ones)
    with pytest.raises(ValueError, match="banks"):
        conv_rows(windows, inputs, weight, seq_slots, cu_rows, carry=carry, carried=ones, banks=int32([1, 0], device))
