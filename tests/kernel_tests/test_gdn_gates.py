"""kernels/gdn_gates.py: decay and beta against the torch reference, softplus's tails, beta's
cast, row invariance, unwritten elements, strided rows, launcher checks.

Tolerances (kernel vs gdn_gates_ref: the same formula and casts; exp and log differ in last bits):
  decay = exp(y), y = -exp(A_log) * softplus(x). Relative errors of a few ulps in exp(A_log) and
        in softplus (exp, then log1p: Goldberg's form is within a few ulps of a correctly rounded
        log1p) become an absolute error in y of a few ulps times |y|, and exp(y) turns that into a
        relative error: |d decay| / decay <= c * 2^-24 * (1 + |y|). Measured in the interpreter:
        c <= 5.4; a GPU's exp (ex2 of x * log2 e) loses up to ~|x| more ulps, |x| < 20 here, so
        c = 32. atol 2^-126: a GPU flushes results below the smallest normal to zero.
  beta  fp32: rtol 2e-6 (~32 ulps; sigmoid's exp as silu's in test_swiglu.py), atol 1e-12.
        bf16: rtol 2^-7: one rounding of the sigmoid to bf16 can go the other way.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_kernels import gdn_gates

from .conftest import ROW_COUNTS, nan_like

DECAY_ULPS = 32  # c above
BETA_TOL = {torch.float32: (2e-6, 1e-12), torch.bfloat16: (2.0**-7, 1e-12)}  # (rtol, atol)
TINY = 2.0**-126
# (activation dtype, A_log / dt_bias dtype): the checkpoint gives the activation dtype; fp32 params also work
DTYPE_PAIRS = [
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16"),
    pytest.param(torch.bfloat16, torch.float32, id="bf16-fp32params"),
]
HV = 6
LEFT = 3  # b starts LEFT columns into the projection row, a right after it, then RIGHT more columns
RIGHT = 5


def make(rows: int, hv: int, dtype, param_dtype, device, seed: int = 0, a_scale: float = 3.0, a_shift: float = 0.0, A_range=(1.0, 16.0)):
    """(b, a [rows, hv] column slices of one projection buffer, A_log [hv], dt_bias [hv]).
    A = exp(A_log) uniform in A_range (GDN's initialisation draws A from [1, 16])."""
    g = torch.Generator().manual_seed(seed)
    proj = 2.0 * torch.randn(rows, LEFT + 2 * hv + RIGHT, generator=g)
    proj[:, LEFT + hv : LEFT + 2 * hv] = a_scale * torch.randn(rows, hv, generator=g) + a_shift
    lo, hi = A_range
    A_log = torch.log(lo + (hi - lo) * torch.rand(hv, generator=g))
    dt_bias = torch.randn(hv, generator=g)
    proj = proj.to(device=device, dtype=dtype)
    return proj[:, LEFT : LEFT + hv], proj[:, LEFT + hv : LEFT + 2 * hv], A_log.to(device, param_dtype), dt_bias.to(device, param_dtype)


def check_decay(name: str, got: torch.Tensor, want: torch.Tensor, y: torch.Tensor) -> None:
    """decay within DECAY_ULPS * 2^-24 * (1 + |y|) relative, y the reference's log decay."""
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)} != {list(want.shape)}"
    assert not torch.isnan(got).any(), f"{name}: NaN in the kernel's decay"
    err = (got.double() - want.double()).abs()
    bound = TINY + want.double().abs() * DECAY_ULPS * 2.0**-24 * (1.0 + y.double().abs())
    rel = (err / want.double().abs().clamp_min(TINY)) / (1.0 + y.double().abs())
    assert (err <= bound).all(), f"{name}: max err {err.max():.3e}, max err / decay / (1 + |y|) {rel.max() / 2**-24:.1f} ulps (allowed {DECAY_ULPS})"


def check_beta(name: str, got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    rtol, atol = BETA_TOL[dtype]
    assert got.shape == want.shape and got.dtype == torch.float32, f"{name}: {got.dtype} {list(got.shape)}"
    assert not torch.isnan(got).any(), f"{name}: NaN in the kernel's beta"
    err = (got - want).abs()
    assert (err <= atol + rtol * want.abs()).all(), f"{name}: max err {err.max():.3e}, mean {err.mean():.3e} (rtol {rtol})"


def log_decay(a, A_log, dt_bias) -> torch.Tensor:
    return -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)


def compare(name, b, a, A_log, dt_bias, dtype):
    got_decay, got_beta = gdn_gates.gdn_gates(b, a, A_log, dt_bias)
    want_decay, want_beta = gdn_gates.gdn_gates_ref(b, a, A_log, dt_bias)
    assert got_decay.dtype == torch.float32 and got_decay.shape == (b.shape[0], b.shape[1], 1)
    check_decay(name, got_decay, want_decay, log_decay(a, A_log, dt_bias)[..., None])
    check_beta(name, got_beta, want_beta, dtype)


@pytest.mark.parametrize("hv", [1, HV, 32], ids=lambda h: f"Hv{h}")
@pytest.mark.parametrize("dtype,param_dtype", DTYPE_PAIRS)
def test_matches_reference(device, dtype, param_dtype, hv):
    compare(f"gdn_gates Hv={hv}", *make(9, hv, dtype, param_dtype, device), dtype)


@pytest.mark.parametrize("dtype,param_dtype", DTYPE_PAIRS)
def test_softplus_tails(device, dtype, param_dtype):
    """x = a + dt_bias from -60 to 100, A small enough that decay stays representable: above the
    threshold softplus is x (exp(x) would overflow past 88: a kernel without the threshold gives
    NaN), far below it log1p(e) = e; around 0 both branches of the log1p form are used."""
    b, a, A_log, dt_bias = make(16, HV, dtype, param_dtype, device, seed=1, a_scale=40.0, a_shift=20.0, A_range=(0.002, 0.01))
    assert (a.float() > 88).any() and (a.float() < -20).any()
    compare("gdn_gates tails", b, a, A_log, dt_bias, dtype)


def test_bf16_beta_cast(device):
    """beta is the sigmoid rounded to bf16, then widened: every value is a bf16 value and >= 99%
    equal the reference bit for bit, while the unrounded sigmoid would differ on >= 90%."""
    b, a, A_log, dt_bias = make(32, HV, torch.bfloat16, torch.bfloat16, device, seed=2)
    _, beta = gdn_gates.gdn_gates(b, a, A_log, dt_bias)
    _, want = gdn_gates.gdn_gates_ref(b, a, A_log, dt_bias)
    assert torch.equal(beta, beta.bfloat16().float()), "beta holds values that are not bf16 values"
    agree = (beta == want).float().mean().item()
    assert agree >= 0.99, f"only {agree:.1%} of beta equals the reference"
    unrounded = torch.sigmoid(b.float())
    assert (unrounded != want).float().mean().item() >= 0.90


@pytest.mark.parametrize("dtype,param_dtype", DTYPE_PAIRS)
def test_row_invariance(device, dtype, param_dtype):
    """op(x[:r]) == op(x)[:r] exactly for every row count; the last row alone, and the same row in
    a one-row buffer of another row stride, equal its row."""
    b, a, A_log, dt_bias = make(max(ROW_COUNTS), HV, dtype, param_dtype, device, seed=3)
    full_decay, full_beta = gdn_gates.gdn_gates(b, a, A_log, dt_bias)
    for r in ROW_COUNTS:
        decay, beta = gdn_gates.gdn_gates(b[:r], a[:r], A_log, dt_bias)
        assert torch.equal(decay, full_decay[:r]) and torch.equal(beta, full_beta[:r]), f"rows={r} differs from the full launch"
    decay, beta = gdn_gates.gdn_gates(b[-1:], a[-1:], A_log, dt_bias)
    assert torch.equal(decay, full_decay[-1:]) and torch.equal(beta, full_beta[-1:]), "the last row alone differs"
    alone = torch.cat((b[-1:], a[-1:], b[-1:, :1]), dim=1)  # row stride 2 * HV + 1
    decay, beta = gdn_gates.gdn_gates(alone[:, :HV], alone[:, HV : 2 * HV], A_log, dt_bias)
    assert torch.equal(decay, full_decay[-1:]) and torch.equal(beta, full_beta[-1:]), "the row in another buffer differs"


@pytest.mark.parametrize("dtype,param_dtype", DTYPE_PAIRS[:2])
def test_nan_poisoned_out(device, dtype, param_dtype):
    """Every element of every row is written: out= buffers pre-filled with NaN keep none."""
    b, a, A_log, dt_bias = make(5, HV, dtype, param_dtype, device, seed=4)
    want = gdn_gates.gdn_gates(b, a, A_log, dt_bias)
    out = (nan_like(want[0]), nan_like(want[1]))
    got = gdn_gates.gdn_gates(b, a, A_log, dt_bias, out=out)
    assert got[0] is out[0] and got[1] is out[1], "the launcher did not return the out= buffers"
    for name, o, w in zip(("decay", "beta"), out, want):
        assert not torch.isnan(o).any(), f"{name}: NaN left in out (unwritten elements)"
        assert torch.equal(o, w), f"{name}: out= result differs from the allocating launch"
    ref_out = (nan_like(want[0]), nan_like(want[1]))
    assert gdn_gates.gdn_gates_ref(b, a, A_log, dt_bias, out=ref_out)[0] is ref_out[0]
    assert not any(torch.isnan(o).any() for o in ref_out)


def test_strided_rows_not_copied(device):
    """b and a as column slices (row stride 2 * HV + 8) give the bits of contiguous copies."""
    b, a, A_log, dt_bias = make(7, HV, torch.bfloat16, torch.bfloat16, device, seed=5)
    assert b.stride(0) == a.stride(0) == LEFT + 2 * HV + RIGHT
    got = gdn_gates.gdn_gates(b, a, A_log, dt_bias)
    want = gdn_gates.gdn_gates(b.contiguous(), a.contiguous(), A_log, dt_bias)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_no_rows(device):
    b, a, A_log, dt_bias = make(0, HV, torch.float32, torch.float32, device)
    decay, beta = gdn_gates.gdn_gates(b, a, A_log, dt_bias)
    assert decay.shape == (0, HV, 1) and beta.shape == (0, HV)


def _raises(match: str, *args, **kwargs) -> None:
    with pytest.raises(ValueError, match=match):
        gdn_gates.gdn_gates(*args, **kwargs)


def test_launcher_errors(device):
    b, a, A_log, dt_bias = make(3, HV, torch.float32, torch.float32, device)
    decay, beta = torch.empty(3, HV, 1, device=device), torch.empty(3, HV, device=device)
    _raises("b must be 2-D", b[0], a, A_log, dt_bias)
    _raises("b dtype", b.double(), a, A_log, dt_bias)
    _raises("a must have shape", b, a[:2], A_log, dt_bias)
    _raises("a dtype", b, a.bfloat16(), A_log, dt_bias)
    _raises("a is on meta", b, a.to("meta"), A_log, dt_bias)
    _raises("A_log must have shape", b, a, A_log[:5], dt_bias)
    _raises("A_log dtype", b, a, A_log.half(), dt_bias)
    _raises("dt_bias must have shape", b, a, A_log, dt_bias[None])
    _raises("dt_bias dtype", b, a, A_log, dt_bias.double())
    _raises("b's heads must be contiguous", torch.empty(HV, 3, device=device).t(), a, A_log, dt_bias)
    _raises("out must be a \\(decay, beta\\) tuple", b, a, A_log, dt_bias, out=[decay, beta])
    _raises("decay must have shape", b, a, A_log, dt_bias, out=(beta, beta))
    _raises("beta dtype", b, a, A_log, dt_bias, out=(decay, beta.bfloat16()))
    _raises("beta must be contiguous", b, a, A_log, dt_bias, out=(decay, torch.empty(HV, 3, device=device).t()))
