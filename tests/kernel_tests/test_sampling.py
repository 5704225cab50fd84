"""kernels/sampling.py: the row argmax equals torch.argmax (ties and NaNs to the first), row by row."""

import pytest
import torch

from kernels.sampling import BLOCK_V, argmax_rows, argmax_rows_ref

from .conftest import ROW_COUNTS

VOCABS = [1, 7, BLOCK_V, BLOCK_V + 3, 2 * BLOCK_V + 517]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_equals_torch_argmax(device, vocab, dtype):
    torch.manual_seed(vocab)
    logits = torch.randn(5, vocab, device=device).to(dtype)
    # ties: plant the row maximum twice, late then early
    for r in range(5):
        top = logits[r].max() + 1
        logits[r, vocab - 1] = top
        logits[r, (r * 131) % vocab] = top
    assert torch.equal(argmax_rows(logits), argmax_rows_ref(logits))


def test_row_invariant_and_strided(device):
    torch.manual_seed(0)
    big = torch.randn(64, 3000 + 8, device=device)
    logits = big[:, :3000]  # rows strided past the vocabulary
    full = argmax_rows(logits)
    for n in ROW_COUNTS:
        assert torch.equal(argmax_rows(logits[:n]), full[:n]), n
    assert torch.equal(full, argmax_rows_ref(logits))


def test_special_values(device):
    rows = torch.full((4, 2100), float("-inf"), device=device)
    rows[1, 1500] = float("nan")
    rows[1, 2000] = float("nan")
    rows[2, 1800] = float("inf")
    rows[2, 40] = float("inf")
    rows[3, 2099] = 0.0
    assert argmax_rows(rows).tolist() == argmax_rows_ref(rows).tolist() == [0, 1500, 40, 2099]


def test_out_buffer_and_checks(device):
    logits = torch.randn(3, 50, device=device)
    out = torch.full((3,), -1, dtype=torch.int64, device=device)
    assert argmax_rows(logits, out=out) is out and torch.equal(out, argmax_rows_ref(logits))
    with pytest.raises(ValueError, match="rows, vocab"):
        argmax_rows(logits[0])
    with pytest.raises(ValueError, match="int64"):
        argmax_rows(logits, out=torch.empty(3, dtype=torch.int32, device=device))
