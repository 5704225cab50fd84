"""kernels/gdn_heads.py: q, k, v against the torch reference, the per-value-head copies, row
invariance, unwritten elements, strided and misaligned inputs, launcher checks.

Tolerances (kernel vs gdn_heads_ref; outputs are fp32 whatever mixed's dtype, widening is exact):
  v: exact (torch.equal): a widening copy.
  k: rtol 1e-5, atol 1e-6, as kernels/norms.py's l2norm: the same formula with correctly rounded
     square root and division; only sum(x^2)'s association differs (a tree in registers against
     torch's sum: at most d_k * 2^-24 relative, 7.6e-6 at d_k = 128, ~1e-7 in practice, halved by
     the square root).
  q: the same, plus one correctly rounded division by sqrt(d_k) on both sides (1 ulp at most).
"""

from __future__ import annotations

import pytest
import torch

from hybrid_kernels import gdn_heads, norms

from .conftest import ROW_COUNTS, assert_close, nan_like

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# (n_k_heads, n_v_heads, d_k, d_v): r = 2 with odd d_v, r = 3 with odd d_k, r = 1, the 2B model's heads
SHAPES = [(2, 4, 16, 12), (1, 3, 6, 10), (2, 2, 8, 8), (2, 4, 128, 128)]
SHAPE_IDS = [f"Hk{hk}-Hv{hv}-dk{dk}-dv{dv}" for hk, hv, dk, dv in SHAPES]
ROW_SHAPE = (2, 6, 8, 10)  # the row-invariance and buffer tests
TOL = (1e-5, 1e-6)  # (rtol, atol) for q and k


def width(hk: int, hv: int, dk: int, dv: int) -> int:
    return 2 * hk * dk + hv * dv


def make(rows: int, shape, dtype, device, seed: int = 0) -> torch.Tensor:
    """mixed [rows, 2*Hk*d_k + Hv*d_v] at scale 2 (conv outputs after SiLU, of either sign)."""
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(rows, width(*shape), generator=g)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(device, dtype, shape):
    hk, hv, dk, dv = shape
    mixed = make(5, shape, dtype, device)
    got = gdn_heads.gdn_heads(mixed, *shape)
    want = gdn_heads.gdn_heads_ref(mixed, *shape)
    for name, g, w in zip("qk", got[:2], want[:2]):
        assert g.dtype == torch.float32 and g.shape == (5, hv, dk)
        assert_close(f"{name} {shape}", g, w, *TOL)
    assert torch.equal(got[2], want[2]), "v differs from the widened slice"
    r = hv // hk
    for t in got[:2]:  # value heads of one key head hold one copy, bit for bit
        grouped = t.view(5, hk, r, dk)
        assert torch.equal(grouped, grouped[:, :, :1].expand_as(grouped))


def test_reference_is_the_layer_math():
    """The reference normalises [rows * heads, d_k] rows with norms.l2norm_ref, as the layer's
    ops.l2norm does on the CPU, then divides q by the python float sqrt(d_k)."""
    hk, hv, dk, dv = ROW_SHAPE
    mixed = make(3, ROW_SHAPE, torch.bfloat16, "cpu", seed=1)
    q, k, v = gdn_heads.gdn_heads_ref(mixed, *ROW_SHAPE)
    raw_k = mixed[:, hk * dk : 2 * hk * dk].float().reshape(3, hk, dk).repeat_interleave(hv // hk, dim=1)
    assert torch.equal(k, norms.l2norm_ref(raw_k.reshape(-1, dk), "rsqrt").view(3, hv, dk))
    raw_q = mixed[:, : hk * dk].float().reshape(3, hk, dk).repeat_interleave(hv // hk, dim=1)
    assert torch.equal(q, norms.l2norm_ref(raw_q.reshape(-1, dk), "rsqrt").view(3, hv, dk) / dk**0.5)
    assert torch.equal(v, mixed[:, 2 * hk * dk :].float().view(3, hv, dv))


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_invariance(device, dtype):
    """op(x[:r]) == op(x)[:r] exactly for every row count, and the last row alone equals its row."""
    mixed = make(max(ROW_COUNTS), ROW_SHAPE, dtype, device, seed=2)
    full = gdn_heads.gdn_heads(mixed, *ROW_SHAPE)
    for r in ROW_COUNTS:
        part = gdn_heads.gdn_heads(mixed[:r], *ROW_SHAPE)
        for name, p, f in zip("qkv", part, full):
            assert torch.equal(p, f[:r]), f"{name}: rows={r} differs from the first {r} rows of the full launch"
    last = gdn_heads.gdn_heads(mixed[-1:], *ROW_SHAPE)
    assert all(torch.equal(p, f[-1:]) for p, f in zip(last, full)), "the last row alone differs"


@pytest.mark.parametrize("rows", [2, 4])
def test_rows_a_program_give_the_same_bits(device, rows):
    """Programs that take `rows` rows in turn (a launch of many rows: rows_per_program) write every
    row, with gates from split sums too, torch.equal a program a row's; rows under one is refused."""
    from hybrid_kernels.linear import SplitSums

    from .test_gdn_gates import make as make_gates

    hv = ROW_SHAPE[1]
    mixed = make(7, ROW_SHAPE, torch.bfloat16, device, seed=5)
    _, _, A_log, dt_bias = make_gates(7, hv, torch.bfloat16, torch.float32, device)
    sums = SplitSums((torch.randn(2, 7, 2 * hv, generator=torch.Generator().manual_seed(8)) * 2).to(device), None, torch.bfloat16)
    want = gdn_heads.gdn_heads(mixed, *ROW_SHAPE, gates=(sums, None, A_log, dt_bias), rows=1)
    out = tuple(nan_like(t) for t in want[:3])
    got = gdn_heads.gdn_heads(mixed, *ROW_SHAPE, out=out, gates=(sums, None, A_log, dt_bias), rows=rows)
    for name, g, w in zip(("q", "k", "v", "decay", "beta"), got, want):
        assert torch.equal(g, w), f"{name}: {rows} rows a program differ from one"  # a NaN (a row unwritten) fails too
    with pytest.raises(ValueError, match="rows a program must be at least 1"):
        gdn_heads.gdn_heads(mixed, *ROW_SHAPE, rows=0)
    assert gdn_heads.rows_per_program(gdn_heads.HEADS_MANY_ROWS - 1) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_poisoned_out(device, dtype):
    """Every element of every row is written: out= buffers pre-filled with NaN keep none."""
    mixed = make(5, ROW_SHAPE, dtype, device, seed=3)
    want = gdn_heads.gdn_heads(mixed, *ROW_SHAPE)
    out = tuple(nan_like(t) for t in want)
    got = gdn_heads.gdn_heads(mixed, *ROW_SHAPE, out=out)
    assert all(g is o for g, o in zip(got, out)), "the launcher did not return the out= buffers"
    for name, o, w in zip("qkv", out, want):
        assert not torch.isnan(o).any(), f"{name}: NaN left in out (unwritten elements)"
        assert torch.equal(o, w), f"{name}: out= result differs from the allocating launch"
    ref_out = tuple(nan_like(t) for t in want)
    assert gdn_heads.gdn_heads_ref(mixed, *ROW_SHAPE, out=ref_out)[0] is ref_out[0]
    assert not any(torch.isnan(o).any() for o in ref_out)


def test_strided_and_misaligned_inputs(device):
    """mixed as a column slice of a wider buffer, or starting off a 16-byte boundary (a one-row
    slice, as decode may pass), gives the contiguous aligned input's bits."""
    w = width(*ROW_SHAPE)
    wide = (2.0 * torch.randn(4, w + 5, generator=torch.Generator().manual_seed(4))).to(device=device, dtype=torch.bfloat16)
    sliced = wide[:, 1 : 1 + w]
    want = gdn_heads.gdn_heads(sliced.contiguous(), *ROW_SHAPE)
    got = gdn_heads.gdn_heads(sliced, *ROW_SHAPE)
    assert all(torch.equal(g, t) for g, t in zip(got, want)), "strided rows differ from contiguous ones"
    off = torch.cat((wide.new_zeros(1), sliced.flatten()))[1:].view(4, w)  # starts one element past an allocation
    assert off.data_ptr() % norms.ALIGN
    got = gdn_heads.gdn_heads(off, *ROW_SHAPE)
    assert all(torch.equal(g, t) for g, t in zip(got, want)), "a misaligned start differs from an aligned one"


def test_no_rows(device):
    q, k, v = gdn_heads.gdn_heads(make(0, ROW_SHAPE, torch.float32, device), *ROW_SHAPE)
    assert q.shape == k.shape == (0, 6, 8) and v.shape == (0, 6, 10)


def _raises(match: str, *args, **kwargs) -> None:
    with pytest.raises(ValueError, match=match):
        gdn_heads.gdn_heads(*args, **kwargs)


def test_launcher_errors(device):
    mixed = make(3, ROW_SHAPE, torch.float32, device)
    q, k, v = gdn_heads.gdn_heads(mixed, *ROW_SHAPE)
    _raises("n_v_heads \\(5\\) must be a positive multiple of n_k_heads \\(2\\)", mixed, 2, 5, 8, 10)
    _raises("d_k \\(0\\)", mixed, 2, 6, 0, 10)
    _raises("d_k \\(8192\\) over 4096", mixed, 2, 6, 8192, 10)
    _raises("mixed must be \\[n, 2\\*Hk\\*d_k \\+ Hv\\*d_v = 92\\]", mixed[:, :-1], *ROW_SHAPE)
    _raises("mixed must be", mixed[0], *ROW_SHAPE)
    _raises("mixed dtype", mixed.double(), *ROW_SHAPE)
    _raises("out must be a \\(q, k, v\\) tuple", mixed, *ROW_SHAPE, out=[q, k, v])
    _raises("k must have shape", mixed, *ROW_SHAPE, out=(q, v, v))
    _raises("v dtype", mixed, *ROW_SHAPE, out=(q, k, v.bfloat16()))
    _raises("q is on meta", mixed, *ROW_SHAPE, out=(q.to("meta"), k, v))
    _raises("q must be contiguous and start 16-byte aligned", mixed, *ROW_SHAPE, out=(torch.empty(3 * 6 * 8 + 1, device=device)[1:].view(3, 6, 8), k, v))


@pytest.mark.parametrize("shape", [(2, 6, 8, 10), (2, 4, 128, 128)], ids=["Hk2-Hv6", "2B-heads"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gates_in_the_same_launch_are_gdn_gates_bits(device, dtype, shape):
    """gdn_heads with the gates (kernels/gdn_gates.py's formula in the head-split programs): q, k,
    v bitwise as without them, decay and beta bitwise gdn_gates' of the same strided column slices,
    at every row count and for a row alone; the reference path returns gdn_gates_ref's; gates of
    the wrong row count are refused. (The interpreter takes a few row counts: ~1 s a launch.)"""
    from hybrid_kernels import gdn_gates

    from .test_gdn_gates import make as make_gates

    hk, hv, dk, dv = shape
    counts = ROW_COUNTS if device == "cuda" else [1, 3, 8]
    mixed = make(max(counts), shape, dtype, device)
    b, a, A_log, dt_bias = make_gates(max(counts), hv, dtype, torch.float32, device)
    for rows in counts:
        got = gdn_heads.gdn_heads(mixed[:rows], *shape, gates=(b[:rows], a[:rows], A_log, dt_bias))
        heads = gdn_heads.gdn_heads(mixed[:rows], *shape)
        gates = gdn_gates.gdn_gates(b[:rows], a[:rows], A_log, dt_bias)
        assert len(got) == 5
        for name, g, w in zip(("q", "k", "v", "decay", "beta"), got, (*heads, *gates)):
            assert torch.equal(g, w), f"{rows} rows: {name} differs from the separate launches"
    alone = gdn_heads.gdn_heads(mixed[4:5].clone(), *shape, gates=(b[4:5].clone(), a[4:5].clone(), A_log, dt_bias))
    for g, w in zip(alone, got):  # got: the largest count's launch
        assert torch.equal(g, w[4:5])
    ref = gdn_heads.gdn_heads_ref(mixed[:3].cpu(), *shape, gates=(b[:3].cpu(), a[:3].cpu(), A_log.cpu(), dt_bias.cpu()))
    want = gdn_gates.gdn_gates_ref(b[:3].cpu(), a[:3].cpu(), A_log.cpu(), dt_bias.cpu())
    assert torch.equal(ref[3], want[0]) and torch.equal(ref[4], want[1])
    with pytest.raises(ValueError, match="gdn_heads"):
        gdn_heads.gdn_heads(mixed[:3], *shape, gates=(b[:2], a[:2], A_log, dt_bias))


@pytest.mark.parametrize("splits", [2, 3])
def test_gates_from_split_sums_are_the_finished_columns_bits(device, splits):
    """b | a handed over as their GEMM's unfinished split-K sums (kernels/linear.py's SplitSums): the
    programs add each column's splits in ascending order and round once to the sums' dtype, the
    reduce's bits, so q, k, v, decay and beta equal the launch given the finished b and a (summed
    here in torch the reduce's way), and each row's bits alone equal its bits among all rows; a
    non-None a, a bias or a wrong shape is refused."""
    from hybrid_kernels.linear import SplitSums

    from .test_gdn_gates import make as make_gates

    shape = (2, 6, 8, 10)
    hv, rows = shape[1], 5
    mixed = make(rows, shape, torch.bfloat16, device)
    _, _, A_log, dt_bias = make_gates(rows, hv, torch.bfloat16, torch.float32, device)
    g = torch.Generator().manual_seed(7)
    partial = (torch.randn(splits, rows, 2 * hv, generator=g) * 2).to(device)
    finished = partial[0].clone()
    for s in range(1, splits):
        finished = finished + partial[s]
    finished = finished.bfloat16()
    got = gdn_heads.gdn_heads(mixed, *shape, gates=(SplitSums(partial, None, torch.bfloat16), None, A_log, dt_bias))
    want = gdn_heads.gdn_heads(mixed, *shape, gates=(finished[:, :hv], finished[:, hv:], A_log, dt_bias))
    for name, a, b in zip(("q", "k", "v", "decay", "beta"), got, want):
        assert torch.equal(a, b), f"{name} differs from the finished columns' launch"
    for r in (1, 3):  # the first r rows' sums alone: each row's bits as among all rows
        part = gdn_heads.gdn_heads(mixed[:r], *shape, gates=(SplitSums(partial[:, :r].contiguous(), None, torch.bfloat16), None,
                                                            A_log, dt_bias))
        assert all(torch.equal(a, b[:r]) for a, b in zip(part, got)), f"the first {r} rows differ from the same rows among {rows}"
    sums = SplitSums(partial, None, torch.bfloat16)
    with pytest.raises(ValueError, match="a must be None"):
        gdn_heads.gdn_heads(mixed, *shape, gates=(sums, finished[:, hv:], A_log, dt_bias))
    with pytest.raises(ValueError, match="no bias"):
        gdn_heads.gdn_heads(mixed, *shape, gates=(SplitSums(partial, finished[0], torch.bfloat16), None, A_log, dt_bias))
    with pytest.raises(ValueError, match=r"\[splits, n, 2 Hv\]"):
        gdn_heads.gdn_heads(mixed, *shape, gates=(SplitSums(partial[:, :, :-1], None, torch.bfloat16), None, A_log, dt_bias))
