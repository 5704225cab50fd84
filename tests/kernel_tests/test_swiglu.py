"""kernels/swiglu.py: silu_mul against its torch reference, cast placement, row invariance,
unwritten elements, strided rows, launcher checks.

Tolerances (kernel vs silu_mul_ref; the formula and its casts are the same, only exp differs):
  fp32: rtol 2e-6 (~32 ulps). silu(g) = g / (1 + exp(-g)): an error of k ulps in exp(-g) moves the
        denominator by at most k ulps, so silu by k + 1 (division correctly rounded), the product
        by one more. torch's SIMD exp and numpy's (the interpreter) differ by ~1 ulp (measured:
        2.4e-7 relative overall); a GPU's exp (ex2 of g * log2 e) loses ~|g| ulps, |g| < 16 here.
  bf16: rtol 2 * 2^-7: those fp32 differences can flip either of the two roundings to bf16, each
        by one bf16 step (at most 2^-7 relative); test_bf16_cast_placement checks separately that
        almost every element agrees bit for bit.
  atol 1e-12: silu's relative error stays bounded down to 0.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_kernels import swiglu

from .conftest import ROW_COUNTS, assert_close, nan_like

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
SIZES = [5, 40, 130, 1500]  # odd, a multiple of 8, past a power of two, past MAX_BLOCK_I (a ragged second block)
TOLERANCES = {torch.float32: (2e-6, 1e-12), torch.bfloat16: (2 * 2.0**-7, 1e-12)}  # (rtol, atol)


def make(rows: int, intermediate: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """gate_up [rows, 2I]: gates at scale 3 (both tails of silu), ups at scale 1."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.cat((3.0 * torch.randn(rows, intermediate, generator=g), torch.randn(rows, intermediate, generator=g)), dim=1)
    return gate_up.to(device=device, dtype=dtype)


@pytest.mark.parametrize("intermediate", SIZES, ids=lambda i: f"I{i}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(device, dtype, intermediate):
    gate_up = make(7, intermediate, dtype, device)
    got = swiglu.silu_mul(gate_up, intermediate)
    want = swiglu.silu_mul_ref(gate_up, intermediate)
    assert got.dtype == want.dtype == dtype
    assert_close(f"silu_mul I={intermediate}", got, want, *TOLERANCES[dtype])


def test_reference_is_dense_mlp_math():
    """The reference is DenseMLP's torch code: silu(gate) * up of the split halves, bit for bit."""
    gate_up = make(4, 24, torch.bfloat16, "cpu", seed=1)
    gate, up = gate_up[:, :24], gate_up[:, 24:]
    assert torch.equal(swiglu.silu_mul_ref(gate_up, 24), F.silu(gate) * up)


def test_bf16_cast_placement(device):
    """The silu result is rounded to bf16 before the product, as torch does: >= 99% of elements
    equal the reference bit for bit, while skipping that rounding changes >= 10% of them."""
    gate_up = make(16, 130, torch.bfloat16, device, seed=2)
    got = swiglu.silu_mul(gate_up, 130)
    want = swiglu.silu_mul_ref(gate_up, 130)
    agree = (got == want).float().mean().item()
    assert agree >= 0.99, f"silu_mul: only {agree:.1%} of bf16 elements equal the reference"
    gate, up = gate_up.float()[:, :130], gate_up.float()[:, 130:]
    no_silu_cast = (F.silu(gate) * up).to(torch.bfloat16)
    changed = (no_silu_cast != want).float().mean().item()
    assert changed >= 0.10, f"only {changed:.1%} changed without the silu cast; the 99% check could not see it"


@pytest.mark.parametrize("intermediate", [40, 1500], ids=lambda i: f"I{i}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance(device, dtype, intermediate):
    """op(x[:r]) == op(x)[:r] exactly for every row count, and the last row alone equals its row."""
    row_counts = ROW_COUNTS if intermediate <= 130 else [1, 2, 3, 17, 33]  # the wide rows: a subset, for time
    gate_up = make(max(row_counts), intermediate, dtype, device, seed=3)
    full = swiglu.silu_mul(gate_up, intermediate)
    for r in row_counts:
        assert torch.equal(swiglu.silu_mul(gate_up[:r], intermediate), full[:r]), f"rows={r} differs from the full launch"
    assert torch.equal(swiglu.silu_mul(gate_up[-1:], intermediate), full[-1:]), "the last row alone differs"


@pytest.mark.parametrize("intermediate", [5, 1500], ids=lambda i: f"I{i}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_poisoned_out(device, dtype, intermediate):
    """Every element of every row is written: an out= buffer pre-filled with NaN keeps none."""
    gate_up = make(5, intermediate, dtype, device, seed=4)
    want = swiglu.silu_mul(gate_up, intermediate)
    out = nan_like(want)
    assert swiglu.silu_mul(gate_up, intermediate, out=out) is out
    assert not torch.isnan(out).any(), "NaN left in out (unwritten elements)"
    assert torch.equal(out, want), "out= result differs from the allocating launch"
    ref_out = nan_like(want)
    assert swiglu.silu_mul_ref(gate_up, intermediate, out=ref_out) is ref_out and not torch.isnan(ref_out).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows(device, dtype):
    """gate_up sliced from a wider buffer (rows strided, as a column slice of a projection) gives
    the contiguous input's bits without a copy."""
    wide = make(6, 45, dtype, device, seed=5)  # [6, 90]
    sliced = wide[:, 3:83]  # I = 40, row stride 90
    assert not sliced.is_contiguous()
    got = swiglu.silu_mul(sliced, 40)
    assert torch.equal(got, swiglu.silu_mul(sliced.contiguous(), 40)), "strided rows differ from contiguous ones"
    assert torch.equal(swiglu.silu_mul_ref(sliced, 40), swiglu.silu_mul_ref(sliced.contiguous(), 40))


def test_no_rows(device):
    assert swiglu.silu_mul(make(0, 8, torch.float32, device), 8).shape == (0, 8)


def _raises(match: str, *args, **kwargs) -> None:
    with pytest.raises(ValueError, match=match):
        swiglu.silu_mul(*args, **kwargs)


def test_launcher_errors(device):
    gate_up = make(3, 8, torch.float32, device)
    _raises("gate_up must be 2-D", gate_up.view(3, 2, 8), 8)
    _raises("gate_up must have 2 \\* intermediate = 14 columns", gate_up, 7)
    _raises("gate_up must have 2 \\* intermediate = 0 columns", gate_up, 0)
    _raises("gate_up dtype", gate_up.double(), 8)
    _raises("gate_up dtype", gate_up.half(), 8)
    _raises("gate_up's features must be contiguous", make(16, 1, torch.float32, device).t(), 8)
    _raises("out must have shape", gate_up, 8, out=torch.empty(3, 7, device=device))
    _raises("out dtype", gate_up, 8, out=torch.empty(3, 8, device=device, dtype=torch.bfloat16))
    _raises("out is on meta", gate_up, 8, out=torch.empty(3, 8, device="meta"))
    _raises("out must be contiguous", gate_up, 8, out=torch.empty(8, 3, device=device).t())
