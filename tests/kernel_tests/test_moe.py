"""kernels/moe.py: the routed experts against their torch reference, expert-order independence,
row invariance, unwritten rows, launcher checks.

Inputs are built at unit scale: x ~ N(0, 1), w_gate / w_up ~ N(0, 1/H), w_down ~ N(0, 1/I),
routing weights in [0, 1), so g, u, h and every output are O(1) (|out| <= ~4 here).
Tolerances (kernel vs reference):
- fp32: rtol 1e-5, atol 1e-5. Both sides compute the same fp32 products and differ only in the
  order of the fp32 sums (the kernel's BLOCK_K chunks vs the CPU's matmul) and, on a GPU, in
  FMA contraction and exp's last ulps: a few ulps of the partial sums' O(1) size, measured
  <= 7e-7 absolute at these shapes. The bound is >10x that, and far below what a wrong index,
  mask or expert would cost (O(0.1) and more).
- bf16: rtol 2^-7, atol 2^-7: one bf16 step. Both sides round h and out once from fp32 values
  that differ by the fp32 noise above, so they differ only where that noise straddles a bf16
  rounding boundary: one step of out (<= 2^-7 |out|), or one step of an element h_i, which moves
  out by |weight * w_down[:, i]| * 2^-8 |h_i| <= 1 * 0.8 * 2^-8 * 2 < 2^-7 at these scales.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_kernels.moe import MAX_TOP_K, moe_experts, moe_experts_ref
from hybrid_kernels.moe_grouped import grouped_config

from .conftest import ROW_COUNTS, assert_close, assert_refused, nan_like

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2.0**-7, 2.0**-7)}  # (rtol, atol), see above
# (R, H, I, E, T): odd sizes; (3, 300, 140) walks several H and I blocks with ragged last ones;
# T 5 leaves masked id slots (BLOCK_T 8); T 16 = MAX_TOP_K fills them all
SHAPES = [(1, 40, 24, 4, 2), (5, 33, 20, 6, 3), (17, 64, 48, 8, 2), (3, 300, 140, 5, 4), (2, 19, 9, 12, 5), (2, 16, 8, 20, 16)]
INVARIANCE_ROWS = [1, 2, 3, 5, 16, 17, 33]  # a subset of ROW_COUNTS (the interpreter runs ~5 ms per program)
assert set(INVARIANCE_ROWS) <= set(ROW_COUNTS)


def shape_id(s):
    return "R{}-H{}-I{}-E{}-T{}".format(*s)


def make(r: int, h: int, i: int, e: int, t: int, dtype: torch.dtype, device: str, seed: int = 0):
    """(x, expert_ids, expert_weights, w_gate, w_up, w_down), ids distinct per row in random order."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, h, generator=g).to(dtype).to(device)
    w_gate = (torch.randn(e, i, h, generator=g) / h**0.5).to(dtype).to(device)
    w_up = (torch.randn(e, i, h, generator=g) / h**0.5).to(dtype).to(device)
    w_down = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype).to(device)
    ids = torch.stack([torch.randperm(e, generator=g)[:t] for _ in range(r)]).to(device) if r else torch.zeros(0, t, dtype=torch.int64, device=device)
    weights = torch.rand(r, t, generator=g).to(device)
    return x, ids, weights, w_gate, w_up, w_down


def on_cpu(*ts):
    return [t.cpu() for t in ts]


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_reference(device, dtype, shape):
    args = make(*shape, dtype, device)
    got = moe_experts(*args)
    want = moe_experts_ref(*on_cpu(*args))  # the reference backend runs on the CPU
    assert got.dtype == dtype
    assert_close(f"moe_experts {dtype} {shape_id(shape)}", got.cpu(), want, *TOLERANCE[dtype])


@pytest.mark.parametrize("shape", [(5, 33, 20, 8, 5), (2, 16, 8, 20, 16)], ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_expert_order_does_not_matter(device, dtype, shape):
    """A row's (id, weight) pairs listed in any order give the bits of the ascending listing."""
    x, ids, weights, w_gate, w_up, w_down = make(*shape, dtype, device)
    sorted_ids, order = ids.sort(dim=1)
    sorted_weights = weights.gather(1, order)
    want = moe_experts(x, sorted_ids, sorted_weights, w_gate, w_up, w_down)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        perm = torch.stack([torch.randperm(shape[4], generator=g) for _ in range(shape[0])]).to(device)
        got = moe_experts(x, sorted_ids.gather(1, perm), sorted_weights.gather(1, perm), w_gate, w_up, w_down)
        assert torch.equal(got, want), "a row's result depends on the order its experts are listed in"
    want_ref = moe_experts_ref(*on_cpu(x, sorted_ids, sorted_weights, w_gate, w_up, w_down))
    assert torch.equal(moe_experts_ref(*on_cpu(x, ids, weights, w_gate, w_up, w_down)), want_ref)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_row_invariance(device, dtype):
    """op(x[:r]) == op(x)[:r] bitwise, and a row alone (a copy, or a view at an odd offset: H 21,
    T 3 put rows off 16-byte alignment) == that row in the batch."""
    x, ids, weights, w_gate, w_up, w_down = make(max(INVARIANCE_ROWS), 21, 20, 6, 3, dtype, device)
    full = moe_experts(x, ids, weights, w_gate, w_up, w_down)
    for r in INVARIANCE_ROWS:
        got = moe_experts(x[:r], ids[:r], weights[:r], w_gate, w_up, w_down)
        assert torch.equal(got, full[:r]), f"rows 0..{r} differ from the {len(x)}-row launch"
    for i in (1, 15, len(x) - 1):
        alone = moe_experts(x[i : i + 1].clone(), ids[i : i + 1].clone(), weights[i : i + 1].clone(), w_gate, w_up, w_down)
        assert torch.equal(alone, full[i : i + 1]), f"row {i} alone differs"
        view = moe_experts(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], w_gate, w_up, w_down)
        assert torch.equal(view, full[i : i + 1]), f"row {i} as a view at an offset differs"


@pytest.mark.parametrize("r", [1, 17], ids=lambda r: f"R{r}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_nan_poisoned_output(device, dtype, r):
    """Every [R, H] element is written and nothing else: out is rows 1..R of a NaN buffer (H odd,
    so out starts off 16-byte alignment)."""
    h = 33
    args = make(r, h, 20, 6, 3, dtype, device)
    buf = nan_like(torch.empty(r + 2, h, dtype=dtype, device=device))
    out = buf[1 : r + 1]
    assert moe_experts(*args, out=out) is out
    assert not torch.isnan(out).any(), "NaN left in out: an element was not written"
    assert torch.equal(out, moe_experts(*args))
    assert torch.isnan(buf[0]).all() and torch.isnan(buf[r + 1]).all(), "wrote outside out"


def test_no_rows(device):
    args = make(0, 16, 8, 4, 2, torch.float32, device)
    assert moe_experts(*args).shape == (0, 16)
    assert moe_experts_ref(*args).shape == (0, 16)


def test_reference_checks_ids():
    x, ids, weights, w_gate, w_up, w_down = make(2, 8, 4, 4, 2, torch.float32, "cpu")
    for bad in ([[0, 4], [1, 2]], [[0, 1], [-1, 2]], [[0, 1], [3, 3]]):
        with pytest.raises(ValueError, match="row"):
            moe_experts_ref(x, torch.tensor(bad), weights, w_gate, w_up, w_down)


def test_config_from_weight_shape_only():
    """Pinned configs: powers of two, from (H, I, dtype) alone (the launcher passes no row count)."""
    for dtype in DTYPES.values():
        for h in (1, 21, 2048, 2304, 7168):
            for i in (1, 20, 512, 1024):
                for size in grouped_config(h, i, dtype)[:6]:
                    assert size >= 1 and size & (size - 1) == 0


def _bad(device, **over):
    x, ids, weights, w_gate, w_up, w_down = make(3, 8, 4, 5, 2, torch.float32, device)
    args = {"x": x, "expert_ids": ids, "expert_weights": weights, "w_gate": w_gate, "w_up": w_up, "w_down": w_down, "out": None}
    args.update(over)
    return args


def _z(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


ERRORS = {
    "x-3d": (lambda d: _bad(d, x=_z(1, 3, 8, device=d)), "x must be 2-D"),
    "x-fp16": (lambda d: _bad(d, x=_z(3, 8, dtype=torch.float16, device=d)), "x dtype"),
    "ids-rows": (lambda d: _bad(d, expert_ids=_z(4, 2, dtype=torch.int64, device=d)), "expert_ids must be"),
    "ids-int32": (lambda d: _bad(d, expert_ids=_z(3, 2, dtype=torch.int32, device=d)), "expert_ids dtype"),
    "ids-too-many": (lambda d: _bad(d, expert_ids=_z(3, 6, dtype=torch.int64, device=d)), "expert_ids has T"),
    "weights-shape": (lambda d: _bad(d, expert_weights=_z(3, 3, device=d)), "expert_weights must have shape"),
    "weights-bf16": (lambda d: _bad(d, expert_weights=_z(3, 2, dtype=torch.bfloat16, device=d)), "expert_weights dtype"),
    "w_gate-2d": (lambda d: _bad(d, w_gate=_z(4, 8, device=d)), "w_gate must be 3-D"),
    "w_gate-H": (lambda d: _bad(d, w_gate=_z(5, 4, 9, device=d), w_up=_z(5, 4, 9, device=d)), "w_gate must have shape"),
    "w_up-shape": (lambda d: _bad(d, w_up=_z(5, 3, 8, device=d)), "w_up must have shape"),
    "w_down-shape": (lambda d: _bad(d, w_down=_z(5, 4, 8, device=d)), "w_down must have shape"),
    "w_down-dtype": (lambda d: _bad(d, w_down=_z(5, 8, 4, dtype=torch.bfloat16, device=d)), "w_down dtype"),
    "w_up-strided": (lambda d: _bad(d, w_up=_z(5, 8, 4, device=d).transpose(1, 2)), "w_up must be contiguous"),
    "out-shape": (lambda d: _bad(d, out=_z(3, 9, device=d)), "out must have shape"),
    "out-dtype": (lambda d: _bad(d, out=_z(3, 8, dtype=torch.bfloat16, device=d)), "out dtype"),
    "out-strided": (lambda d: _bad(d, out=_z(8, 3, device=d).t()), "out must be contiguous"),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_launcher_errors(device, case):
    assert_refused(case, device, moe_experts, moe_experts_ref)


def test_top_k_limit(device):
    x, ids, weights, w_gate, w_up, w_down = make(1, 8, 4, MAX_TOP_K + 2, MAX_TOP_K + 1, torch.float32, device)
    with pytest.raises(ValueError, match="expert_ids has T"):
        moe_experts(x, ids, weights, w_gate, w_up, w_down)


def test_device_mismatch(device):
    if device != "cuda":
        pytest.skip("needs a GPU: under the interpreter every tensor is on the CPU")
    with pytest.raises(ValueError, match="w_down is on"):
        moe_experts(**_bad(device, w_down=_z(5, 8, 4)))
