"""kernels/norms.py: the row-wise norms against their torch references, row invariance, unwritten
rows, cast placement, launcher checks."""

from __future__ import annotations

from typing import Callable, NamedTuple

import pytest
import torch
import torch.nn.functional as F

from hybrid_kernels import norms
from hybrid_kernels.linear import SplitSums
from hybrid_kernels.moe_grouped import PendingCombine

from .conftest import ROW_COUNTS, assert_close, nan_like

EPS = 1e-6
SIZES = [5, 16, 40, 130]  # odd, a power of two, a multiple of 8, just past a power of two
LONG_SIZES = [5000, 8192]  # past MAX_BLOCK_D: the row is walked in blocks (5000: a ragged last block)
BF16_ULP = 2.0**-7  # one bf16 rounding step, relative to the value, at most


class Case(NamedTuple):
    """One public norm: launcher(*args, out=) and its reference, args built from (x, gate, weight)."""

    launcher: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    args: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]
    dtypes: tuple[torch.dtype, ...]
    casts: int  # how many times the formula rounds to x's dtype (tolerance below)


CASES = {
    "rms_zero_centred": Case(norms.rms_norm, norms.rms_norm_ref, lambda x, g, w: (x, w, EPS, True), (torch.float32, torch.bfloat16), 1),
    "rms_plain": Case(norms.rms_norm, norms.rms_norm_ref, lambda x, g, w: (x, w, EPS, False), (torch.float32, torch.bfloat16), 2),
    "silu_gated": Case(norms.silu_gated_rms_norm, norms.silu_gated_rms_norm_ref, lambda x, g, w: (x, g, w, EPS), (torch.float32, torch.bfloat16), 3),
    "sigmoid_gated": Case(norms.sigmoid_gated_rms_norm, norms.sigmoid_gated_rms_norm_ref, lambda x, g, w: (x, g, w, EPS), (torch.float32, torch.bfloat16), 1),
    "l2_rsqrt": Case(norms.l2norm, norms.l2norm_ref, lambda x, g, w: (x, "rsqrt"), (torch.float32,), 0),
    "l2_div": Case(norms.l2norm, norms.l2norm_ref, lambda x, g, w: (x, "div"), (torch.float32,), 0),
}
CASE_DTYPES = [pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}") for name, case in CASES.items() for dtype in case.dtypes]


def tolerance(case: Case, dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for kernel vs reference.

    The kernel computes the reference's formula with the same casts; the only fp32 differences are
    the association of sum(x^2) (a tree in registers against torch's sequential sum: relative error
    at most D * 2^-24, 7.7e-6 at D = 130, ~1e-7 in practice, halved by the square root) and, in the
    gated norms, exp's last bits on a GPU (a few ulps). fp32: rtol 1e-5 covers that; atol 1e-6
    covers outputs near zero. bf16: such an fp32 difference can make a cast round the other way,
    one bf16 step (at most 2^-7 relative), and a flipped intermediate cast carries into the later
    ones, so rtol is 2^-7 per cast in the formula. test_bf16_cast_placement checks separately that
    almost all bf16 elements agree bit for bit, which the rtol alone could not see.
    """
    if dtype == torch.float32:
        return 1e-5, 1e-6
    return case.casts * BF16_ULP, 1e-6


def make_inputs(rows: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
    """x [rows, d] (scale 3), gate [rows, d], weight [d] around 1 (plain) in dtype."""
    gen = torch.Generator().manual_seed(seed)
    x = 3.0 * torch.randn(rows, d, generator=gen)
    gate = 2.0 * torch.randn(rows, d, generator=gen)
    weight = 1.0 + 0.1 * torch.randn(d, generator=gen)
    return tuple(t.to(device=device, dtype=dtype) for t in (x, gate, weight))


def weight_for(name: str, weight: torch.Tensor) -> torch.Tensor:
    """Zero-centred checkpoints store w - 1 (near 0); the others store w (near 1)."""
    return weight - 1.0 if name == "rms_zero_centred" else weight


def run(name: str, fn: Callable[..., torch.Tensor], x, gate, weight, **kwargs) -> torch.Tensor:
    return fn(*CASES[name].args(x, gate, weight_for(name, weight)), **kwargs)


@pytest.mark.parametrize("d", SIZES, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("name,dtype", CASE_DTYPES)
def test_matches_reference(device, name, dtype, d):
    case = CASES[name]
    x, gate, weight = make_inputs(7, d, dtype, device)
    got = run(name, case.launcher, x, gate, weight)
    want = run(name, case.reference, x, gate, weight)
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != reference {want.dtype}"
    assert_close(f"{name} D={d}", got, want, *tolerance(case, dtype))


@pytest.mark.parametrize("d", LONG_SIZES, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("name,dtype", CASE_DTYPES)
def test_long_rows_match_reference(device, name, dtype, d):
    """Rows longer than MAX_BLOCK_D take the block loop; D * 2^-24 grows to 5e-4 at D = 8192 as a
    worst case, but the sum's error in practice stays ~sqrt(D) * 2^-24 < 1e-5, inside rtol."""
    case = CASES[name]
    x, gate, weight = make_inputs(2, d, dtype, device, seed=1)
    got = run(name, case.launcher, x, gate, weight)
    want = run(name, case.reference, x, gate, weight)
    assert_close(f"{name} D={d}", got, want, *tolerance(case, dtype))


def _misplaced_casts(name: str, x, gate, weight) -> dict[str, torch.Tensor]:
    """Negative controls: each rms norm with one cast to bf16 added or dropped."""
    bf16 = torch.bfloat16
    x32 = x.float()
    n32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    w = weight_for(name, weight)
    w32, silu, sigmoid = w.float(), F.silu(gate.float()), torch.sigmoid(gate.float())
    if name == "rms_zero_centred":
        return {"norm cast first": (n32.to(bf16).float() * (1.0 + w32)).to(bf16)}
    if name == "rms_plain":
        return {"no norm cast": (w32 * n32).to(bf16)}
    if name == "silu_gated":
        return {
            "no norm cast": ((w32 * n32).to(bf16).float() * silu).to(bf16),
            "no w*norm cast": (w32 * n32.to(bf16).float() * silu).to(bf16),
        }
    return {"norm cast first": (w32 * n32.to(bf16).float() * sigmoid).to(bf16)}  # sigmoid_gated


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if torch.bfloat16 in c.dtypes])
def test_bf16_cast_placement(device, name):
    """The casts sit where the reference puts them: the kernel agrees with the reference bit for
    bit on >= 99% of bf16 elements (the rest: fp32 sum-order differences at a rounding boundary),
    while moving any one cast changes >= 10% of the elements (measured: 22% to 40%), so a kernel
    with a misplaced cast could not pass."""
    case = CASES[name]
    x, gate, weight = make_inputs(16, 130, torch.bfloat16, device, seed=2)
    got = run(name, case.launcher, x, gate, weight)
    want = run(name, case.reference, x, gate, weight)
    agree = (got == want).float().mean().item()
    assert agree >= 0.99, f"{name}: only {agree:.1%} of bf16 elements equal the reference"
    for what, wrong in _misplaced_casts(name, x, gate, weight).items():
        changed = (wrong != want).float().mean().item()
        assert changed >= 0.10, f"{name} ({what}): only {changed:.1%} changed; the 99% check could not see this cast"


@pytest.mark.parametrize("d", [40, 5000], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("name,dtype", CASE_DTYPES)
def test_row_invariance(device, name, dtype, d):
    """op(x[:r]) == op(x)[:r] exactly for every row count, and the last row alone equals its row."""
    case = CASES[name]
    row_counts = ROW_COUNTS if d <= norms.MAX_BLOCK_D else [1, 2, 3, 17, 33]  # the long rows: a subset, for time
    x, gate, weight = make_inputs(max(row_counts), d, dtype, device, seed=3)
    full = run(name, case.launcher, x, gate, weight)
    for r in row_counts:
        part = run(name, case.launcher, x[:r], gate[:r], weight)
        assert torch.equal(part, full[:r]), f"{name} D={d}: rows={r} differs from the first {r} rows of the full launch"
    last = run(name, case.launcher, x[-1:], gate[-1:], weight)
    assert torch.equal(last, full[-1:]), f"{name} D={d}: the last row alone differs from the full launch"


@pytest.mark.parametrize("d", [5, 130, 5000], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("name,dtype", CASE_DTYPES)
def test_nan_poisoned_out(device, name, dtype, d):
    """Every element of every row is written: an out= buffer pre-filled with NaN keeps none."""
    case = CASES[name]
    x, gate, weight = make_inputs(5, d, dtype, device, seed=4)
    want = run(name, case.launcher, x, gate, weight)
    out = nan_like(want)
    got = run(name, case.launcher, x, gate, weight, out=out)
    assert got is out, f"{name}: the launcher did not return the out= buffer"
    assert not torch.isnan(out).any(), f"{name} D={d}: NaN left in out (unwritten elements)"
    assert torch.equal(out, want), f"{name} D={d}: out= result differs from the allocating launch"
    ref_out = nan_like(want)
    assert run(name, case.reference, x, gate, weight, out=ref_out) is ref_out and not torch.isnan(ref_out).any()


@pytest.mark.parametrize("name", list(CASES))
def test_strided_inputs(device, name):
    """x and gate sliced from wider buffers (rows strided) give the contiguous inputs' bits."""
    case = CASES[name]
    dtype = case.dtypes[-1]
    x, gate, weight = make_inputs(6, 45, dtype, device, seed=5)
    got = run(name, case.launcher, x[:, 2:42], gate[:, 3:43], weight[:40])
    want = run(name, case.launcher, x[:, 2:42].contiguous(), gate[:, 3:43].contiguous(), weight[:40])
    assert torch.equal(got, want), f"{name}: strided inputs differ from contiguous ones"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("offset", [0, 3], ids=["aligned", "misaligned"])
def test_grouped_gate(device, dtype, offset):
    """A gate [rows, heads, d] sliced from a wider buffer (GDN's z, rows strided) is read where it
    lies (or, off a 16-byte boundary, made dense) and gives the dense gate's bits, for one row and
    for many, and the reference takes the same shape."""
    heads, d = 3, 32
    for rows in (1, 9):
        x, _, weight = make_inputs(rows * heads, d, dtype, device, seed=8)
        wide = 2.0 * torch.randn(rows, 200, generator=torch.Generator().manual_seed(9)).to(device, dtype)
        gate = wide[:, 16 + offset : 16 + offset + heads * d].view(rows, heads, d)  # rows 200 elements apart
        assert not gate.is_contiguous() or rows == 1
        want = norms.silu_gated_rms_norm(x, gate.reshape(rows * heads, d).contiguous(), weight, EPS)
        assert torch.equal(norms.silu_gated_rms_norm(x, gate, weight, EPS), want), f"rows {rows}"
        assert torch.equal(norms.silu_gated_rms_norm_ref(x, gate, weight, EPS),
                           norms.silu_gated_rms_norm_ref(x, gate.reshape(rows * heads, d), weight, EPS))
    _raises("gate must be \\[M / G, G, D\\]", norms.silu_gated_rms_norm, x, gate[:, :2], weight, EPS)


@pytest.mark.parametrize("name", list(CASES))
def test_misaligned_inputs(device, name):
    """Inputs starting off a 16-byte boundary (a one-row slice of a wider buffer, as decode may
    pass) are re-based by the launcher and give the aligned inputs' bits."""
    case = CASES[name]
    dtype = case.dtypes[-1]
    x, gate, weight = make_inputs(4, 32, dtype, device, seed=6)
    x_off = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(4, 32)  # starts one element past an allocation
    gate_off = torch.cat([gate.new_zeros(3), gate.flatten()])[3:].view(4, 32)
    assert x_off.data_ptr() % norms.ALIGN and gate_off.data_ptr() % norms.ALIGN
    got = run(name, case.launcher, x_off, gate_off, weight)
    want = run(name, case.launcher, x, gate, weight)
    assert torch.equal(got, want), f"{name}: misaligned inputs differ from aligned ones"


@pytest.mark.parametrize("name", list(CASES))
def test_no_rows(device, name):
    case = CASES[name]
    x, gate, weight = make_inputs(0, 16, case.dtypes[0], device)
    assert run(name, case.launcher, x, gate, weight).shape == (0, 16)


def _raises(match: str, fn, *args, **kwargs) -> None:
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


def test_launcher_errors(device):
    x, gate, weight = make_inputs(3, 8, torch.float32, device)
    other = "meta"  # a device no launch can reach; the checks must fire first
    _raises("x must be 2-D", norms.rms_norm, x.view(3, 2, 4), weight, EPS, True)
    _raises("x dtype", norms.rms_norm, x.double(), weight.double(), EPS, True)
    _raises("x dtype", norms.silu_gated_rms_norm, x.half(), gate.half(), weight.half(), EPS)
    _raises("weight must have shape", norms.rms_norm, x, weight[:7], EPS, False)
    _raises("weight dtype", norms.rms_norm, x, weight.bfloat16(), EPS, False)
    _raises("weight is on meta", norms.rms_norm, x, weight.to(other), EPS, False)
    _raises("out must have shape", norms.rms_norm, x, weight, EPS, True, out=torch.empty(3, 7, device=device))
    _raises("out dtype", norms.rms_norm, x, weight, EPS, True, out=torch.empty(3, 8, device=device, dtype=torch.bfloat16))
    _raises("out must be contiguous", norms.rms_norm, x, weight, EPS, True, out=torch.empty(8, 3, device=device).t())
    _raises("out must start 16-byte aligned", norms.rms_norm, x, weight, EPS, True, out=torch.empty(25, device=device)[1:].view(3, 8))
    _raises("gate must have shape", norms.silu_gated_rms_norm, x, gate[:2], weight, EPS)
    _raises("gate dtype", norms.sigmoid_gated_rms_norm, x, gate.bfloat16(), weight, EPS)
    _raises("gate is on meta", norms.sigmoid_gated_rms_norm, x, gate.to(other), weight, EPS)
    _raises("x dtype", norms.l2norm, x.bfloat16(), "rsqrt")
    _raises("form must be one of", norms.l2norm, x, "sqrt")
    _raises("form must be one of", norms.l2norm_ref, x, "sqrt")
    _raises("out dtype", norms.l2norm, x, "div", out=torch.empty(3, 8, device=device, dtype=torch.bfloat16))


@pytest.mark.parametrize("d", [40, 130, 5000], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("zero_centred", [True, False], ids=["zero_centred", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_add_rms_norm(device, dtype, zero_centred, d):
    """The residual add fused into the norm: the sum is torch's add bit for bit (one rounding of an
    exact fp32 sum of two values of the dtype), the norm is rms_norm of that sum within rms_norm's
    tolerance, and both are row-invariant."""
    x, residual, weight = make_inputs(17, d, dtype, device, seed=3)
    weight = weight - 1.0 if zero_centred else weight
    total, normed = norms.add_rms_norm(x, residual, weight, EPS, zero_centred)
    want_total, want_normed = norms.add_rms_norm_ref(x, residual, weight, EPS, zero_centred)
    assert torch.equal(total, want_total), "the fused sum differs from torch's x + residual"
    case = CASES["rms_zero_centred" if zero_centred else "rms_plain"]
    assert_close(f"add_rms_norm D={d}", normed, want_normed, *tolerance(case, dtype))
    assert torch.equal(normed, norms.rms_norm(want_total, weight, EPS, zero_centred)), "fused norm != rms_norm of the sum"
    for n in (1, 2, 5, 16):
        t, y = norms.add_rms_norm(x[:n], residual[:n], weight, EPS, zero_centred)
        assert torch.equal(t, total[:n]) and torch.equal(y, normed[:n]), n
    with pytest.raises(ValueError, match="residual"):
        norms.add_rms_norm(x, residual[:, :-1], weight, EPS, zero_centred)


@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("d", [40, 130, 5000], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_add_rms_norm_finishes_split_sums(device, dtype, d, splits):
    """A split-K projection's unfinished sums as the residual (hybrid_kernels.linear.SplitSums): the sum
    and the norm are bitwise those of the finished residual (linear's reduce: splits in ascending
    order, + bias, one rounding), with and without a bias, at every row count."""
    x, _, weight = make_inputs(17, d, dtype, device, seed=4)
    gen = torch.Generator().manual_seed(5)
    partial = (2.0 * torch.randn(splits, 17, d, generator=gen)).to(device)
    bias = torch.randn(d, generator=gen).to(device, dtype)
    for b in (None, bias):
        full_total, full_normed = norms.add_rms_norm(x, SplitSums(partial, b, dtype), weight, EPS, True)
        for n in (1, 5, 17):
            sums = SplitSums(partial[:, :n].contiguous(), b, dtype)
            total, normed = norms.add_rms_norm(x[:n], sums, weight, EPS, True)
            want_total, want_normed = norms.add_rms_norm(x[:n], sums.finish(), weight, EPS, True)
            assert torch.equal(total, want_total) and torch.equal(normed, want_normed), (n, b is not None)
            assert torch.equal(total, full_total[:n]) and torch.equal(normed, full_normed[:n]), f"rows {n} differ in 17"
    with pytest.raises(ValueError, match=r"residual split sums must have shape \[SPLIT_K, M, D\]"):
        norms.add_rms_norm(x, SplitSums(partial[:, :, :-1].contiguous(), None, dtype), weight, EPS, True)
    with pytest.raises(ValueError, match="residual split sums finish to"):
        other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
        norms.add_rms_norm(x, SplitSums(partial, None, other), weight, EPS, True)


def _pending(rows: int, slots: int, experts: int, d: int, dtype: torch.dtype, device, seed: int) -> PendingCombine:
    """Grouped experts' pair outputs as grouped_experts leaves them: each row's distinct ids in no
    order, fp32 weights and outputs, and counts not yet zero (the grouping's)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:slots] for _ in range(rows)])
    weights = torch.rand(rows, slots, generator=gen)
    outs = 3.0 * torch.randn(rows * slots, d, generator=gen)
    counts = torch.randint(1, 5, (experts,), generator=gen, dtype=torch.int32)
    return PendingCombine(outs.to(device), ids.to(device), weights.to(device), counts.to(device), dtype)


def _combine_reference(p: PendingCombine) -> torch.Tensor:
    """A row's pairs in ascending expert id order, weight * output added to an fp32 zero one at a
    time, each product and sum rounded on its own, then one rounding to the dtype."""
    ids, weights, outs = p.ids.cpu(), p.weights.cpu(), p.expert_out.cpu()
    rows, slots = ids.shape
    want = torch.empty(rows, outs.shape[1], dtype=p.dtype)
    for r in range(rows):
        acc = torch.zeros(outs.shape[1])
        for t in torch.argsort(ids[r]).tolist():
            acc = acc + weights[r, t] * outs[r * slots + t]
        want[r] = acc.to(p.dtype)
    return want


@pytest.mark.parametrize("d", [40, 130, 5000], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_add_rms_norm_finishes_pending_combine(device, dtype, d):
    """Grouped experts before their combine as the residual (hybrid_kernels.moe_grouped.PendingCombine):
    the sum and the norm are bitwise those of the combined residual (PendingCombine.finish, which is
    the combine's reference bit for bit), at every row count; either way the grouping's counts end
    at zero."""
    rows, slots, experts = 9, 3, 11
    x, _, weight = make_inputs(rows, d, dtype, device, seed=6)
    full = _pending(rows, slots, experts, d, dtype, device, seed=7)
    full_total, full_normed = norms.add_rms_norm(x, full, weight, EPS, True)
    assert not full.counts.any(), "the norm that finished the combine left the counts for the next routing non-zero"
    for n in (1, 4, rows):
        p = _pending(rows, slots, experts, d, dtype, device, seed=7)
        p = p._replace(expert_out=p.expert_out[: n * slots].contiguous(), ids=p.ids[:n].contiguous(), weights=p.weights[:n].contiguous())
        counts = p.counts.clone()
        total, normed = norms.add_rms_norm(x[:n], p, weight, EPS, True)
        p.counts.copy_(counts)
        combined = p.finish()
        assert not p.counts.any(), "the combine left the counts non-zero"
        assert torch.equal(combined.cpu(), _combine_reference(p)), "the combine differs from its reference"
        want_total, want_normed = norms.add_rms_norm(x[:n], combined, weight, EPS, True)
        assert torch.equal(total, want_total) and torch.equal(normed, want_normed), f"{n} rows: finished in the norm != combined first"
        assert torch.equal(total, full_total[:n]) and torch.equal(normed, full_normed[:n]), f"rows {n} differ in {rows}"
    bad = _pending(rows, slots, experts, d, dtype, device, seed=8)
    with pytest.raises(ValueError, match=r"residual pending combine must have ids \[M, S\] with M = 4"):
        norms.add_rms_norm(x[:4], bad, weight, EPS, True)
    assert not bad.counts.any(), "a refused combine left the counts non-zero: the layer's next routing would start off them"
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="residual pending combine finishes to"):
        norms.add_rms_norm(x, bad._replace(dtype=other), weight, EPS, True)
    with pytest.raises(ValueError, match=r"residual pair outputs"):
        norms.add_rms_norm(x, bad._replace(expert_out=bad.expert_out[:, :-1].contiguous()), weight, EPS, True)
