"""kernels/moe.py's block-FP8 path (`moe_experts_fp8`) against its torch reference, row
invariance, unwritten rows, launcher checks.

Expert weights are random fp8 values (~N(0, 1)) times block scales in [0.5, 1.5) / sqrt(fan_in):
the unit-scale real weights of test_moe.py. The kernel dequantizes each tile to x's dtype exactly
as `dequantize_ref` does (fp8 x scale in fp32, one rounding), so against `moe_experts_fp8_ref`
(moe_experts_ref over the dequantized weights) it differs only as the bf16/fp32 path does, in
the order of the fp32 sums: test_moe.py's tolerances apply (fp32 1e-5; bf16 one bf16 step, 2^-7).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from hybrid_kernels.linear_fp8 import FP8, BlockScales, dequantize_ref, raw_bf16, standard_scale_row
from hybrid_kernels.moe import moe_experts_fp8, moe_experts_fp8_ref, moe_experts_ref
from hybrid_kernels.runtime import interpreting

from .conftest import assert_close, assert_refused, nan_like

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2.0**-7, 2.0**-7)}
# (R, H, I, E, T, [block_n, block_k]): H and I off the block grid (partial edge blocks); block_k
# 24 and 8 are no multiple of the K steps (scales gathered per element), 16 and 128 are; the last
# two route to many experts per slot (FP8 in bf16 then takes grouped_config's wider feature tiles)
SHAPES = [(2, 40, 24, 4, 2, (16, 16)), (3, 70, 33, 5, 3, (16, 24)), (2, 300, 140, 4, 2, (128, 128)), (1, 19, 9, 6, 4, (8, 8)),
          (3, 70, 33, 16, 2, (16, 24)), (2, 300, 140, 17, 2, (128, 128))]
INVARIANCE_ROWS = [1, 2, 3, 5, 16, 17]


def shape_id(s):
    return "R{}-H{}-I{}-E{}-T{}-block{}x{}".format(*s[:5], *s[5])


def make_experts(e: int, n: int, k: int, block, device: str, g: torch.Generator) -> tuple[torch.Tensor, BlockScales]:
    """fp8 [e, n, k] and scales [e, ceil(n / bn), ceil(k / bk)] making unit-scale real weights."""
    bn, bk = block
    weight = torch.randn(e, n, k, generator=g).to(FP8)
    scale_inv = (0.5 + torch.rand(e, -(-n // bn), -(-k // bk), generator=g)) / k**0.5
    return weight.to(device), BlockScales(scale_inv.to(device), standard_scale_row(n, bn, device), bk)


def make(r, h, i, e, t, block, dtype, device, seed=0):
    """(x, expert_ids, expert_weights, w_gate, w_up, w_down, scales)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, h, generator=g).to(dtype).to(device)
    (w_gate, s_gate), (w_up, s_up), (w_down, s_down) = (make_experts(e, n, k, block, device, g) for n, k in ((i, h), (i, h), (h, i)))
    ids = torch.stack([torch.randperm(e, generator=g)[:t] for _ in range(r)]).to(device)
    weights = torch.rand(r, t, generator=g).to(device)
    return x, ids, weights, w_gate, w_up, w_down, (s_gate, s_up, s_down)


def on_cpu(x, ids, weights, w_gate, w_up, w_down, scales):
    cpu_scales = tuple(BlockScales(s.scale_inv.cpu(), s.scale_row.cpu(), s.block_k) for s in scales)
    return x.cpu(), ids.cpu(), weights.cpu(), w_gate.cpu(), w_up.cpu(), w_down.cpu(), cpu_scales


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_reference(device, dtype, shape):
    args = make(*shape, dtype, device)
    got = moe_experts_fp8(*args)
    assert got.dtype == dtype
    assert_close(f"moe_experts_fp8 {dtype} {shape_id(shape)}", got.cpu(), moe_experts_fp8_ref(*on_cpu(*args)), *TOLERANCE[dtype])


@pytest.mark.parametrize("experts", [6, 24], ids=["few-experts", "many-experts"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_row_invariance(device, dtype, experts):
    """op(x[:r]) == op(x)[:r] bitwise; a row alone (a copy, or a view at an odd offset: H 21) ==
    that row in the batch. Many experts per slot: bf16 takes the wider feature tiles."""
    x, ids, weights, w_gate, w_up, w_down, scales = make(max(INVARIANCE_ROWS), 21, 20, experts, 3, (16, 8), dtype, device)
    full = moe_experts_fp8(x, ids, weights, w_gate, w_up, w_down, scales)
    for r in INVARIANCE_ROWS:
        got = moe_experts_fp8(x[:r], ids[:r], weights[:r], w_gate, w_up, w_down, scales)
        assert torch.equal(got, full[:r]), f"rows 0..{r} differ from the {len(x)}-row launch"
    for i in (1, len(x) - 1):
        alone = moe_experts_fp8(x[i : i + 1].clone(), ids[i : i + 1].clone(), weights[i : i + 1].clone(), w_gate, w_up, w_down, scales)
        assert torch.equal(alone, full[i : i + 1]), f"row {i} alone differs"
        view = moe_experts_fp8(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], w_gate, w_up, w_down, scales)
        assert torch.equal(view, full[i : i + 1]), f"row {i} as a view at an offset differs"


def test_nan_poisoned_output(device):
    """Every [R, H] element is written and nothing else (out starts off 16-byte alignment)."""
    r, h = 3, 33
    args = make(r, h, 20, 6, 3, (16, 16), torch.bfloat16, device)
    buf = nan_like(torch.empty(r + 2, h, dtype=torch.bfloat16, device=device))
    out = buf[1 : r + 1]
    assert moe_experts_fp8(*args, out=out) is out
    assert not torch.isnan(out).any(), "NaN left in out: an element was not written"
    assert torch.equal(out, moe_experts_fp8(*args))
    assert torch.isnan(buf[0]).all() and torch.isnan(buf[r + 1]).all(), "wrote outside out"


def _bad(device, which: int = 0, **over):
    x, ids, weights, w_gate, w_up, w_down, scales = make(3, 8, 4, 5, 2, (4, 4), torch.float32, device)
    args = {"x": x, "expert_ids": ids, "expert_weights": weights, "w_gate": w_gate, "w_up": w_up, "w_down": w_down, "scales": scales}
    scale_fields = {k: over.pop(k) for k in list(over) if k in BlockScales._fields}
    if scale_fields:
        scales = list(scales)
        scales[which] = scales[which]._replace(**scale_fields)
        args["scales"] = tuple(scales)
    args.update(over)
    return args


ERRORS = {
    "w_gate-fp32": (lambda d: _bad(d, w_gate=torch.zeros(5, 4, 8, device=d)), "w_gate dtype"),
    "w_down-shape": (lambda d: _bad(d, w_down=torch.zeros(5, 4, 8, device=d).to(FP8)), "w_down must have shape"),
    "gate-scale-shape": (lambda d: _bad(d, 0, scale_inv=torch.ones(5, 1, 1, device=d)), "w_gate scale_inv must have shape"),
    "down-scale-lead": (lambda d: _bad(d, 2, scale_inv=torch.ones(4, 2, 1, device=d)), "w_down scale_inv must have shape"),
    "up-scale_row": (lambda d: _bad(d, 1, scale_row=torch.zeros(3, dtype=torch.int32, device=d)), "w_up scale_row must have shape"),
    "gate-up-layouts": (lambda d: _bad(d, 1, scale_inv=torch.ones(5, 2, 2, device=d), block_k=5), "share a layout"),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_launcher_errors(device, case):
    assert_refused(case, device, moe_experts_fp8, moe_experts_fp8_ref)


def test_few_rows_launch_keeps_the_arithmetic():
    """launch_for_rows changes launch fields only, fitted to the shape, and only up to FEW_ROWS rows."""
    import hybrid_kernels.moe_grouped as mg

    pinned = mg.grouped_config(2048, 512, torch.bfloat16, 257, 9, fp8=True)
    launch = dict(BLOCK_N=16, num_warps=1, BLOCK_N2=4096, num_warps2=2, BLOCK_H=64, BLOCK_K=16)  # BLOCK_K: not a launch field
    few = mg.launch_for_rows(pinned, 1, 2048, 512, launch)
    assert (few.BLOCK_M, few.BLOCK_K, few.BLOCK_K2) == (pinned.BLOCK_M, pinned.BLOCK_K, pinned.BLOCK_K2)
    assert (few.BLOCK_N, few.num_warps, few.BLOCK_N2, few.num_warps2, few.BLOCK_H) == (16, 1, 2048, 2, 64)
    assert mg.launch_for_rows(pinned, mg.FEW_ROWS, 2048, 512, launch) == few
    assert mg.launch_for_rows(pinned, mg.FEW_ROWS + 1, 2048, 512, launch) == pinned
    assert mg.launch_for_rows(pinned, 1, 2048, 512, {}) == pinned
    # from MANY_ROWS on the many-rows launch, which alone may take 32-pair blocks
    many = mg.launch_for_rows(pinned, mg.MANY_ROWS, 2048, 512, {}, {"BLOCK_M": 32, "num_warps": 8, "BLOCK_K": 16})
    assert many == pinned._replace(BLOCK_M=32, num_warps=8)
    assert mg.launch_for_rows(pinned, mg.MANY_ROWS - 1, 2048, 512, {}, {"BLOCK_M": 32}) == pinned
    assert mg.launch_for_rows(pinned, 1, 2048, 512, {"BLOCK_M": 32}, {}) == pinned  # few rows: BLOCK_M is not theirs
    with pytest.raises(ValueError, match="BLOCK_M must be 16 or 32"):
        mg.launch_for_rows(pinned, mg.MANY_ROWS, 2048, 512, {}, {"BLOCK_M": 64})


def test_many_rows_launch_of_32_pair_blocks_gives_the_pinned_bits(device, monkeypatch):
    """From MANY_ROWS rows on, blocks of 32 pairs (two 16-row MMA tiles): every row equal to itself
    alone (and under the interpreter, whose dot never mixes rows, to the 16-pair blocks)."""
    import hybrid_kernels.moe_grouped as mg

    rows = mg.MANY_ROWS + 3
    x, ids, weights, w_gate, w_up, w_down, scales = make(rows, 40, 48, 32, 3, (16, 16), torch.bfloat16, device, seed=4)
    pinned = moe_experts_fp8(x, ids, weights, w_gate, w_up, w_down, scales)
    monkeypatch.setattr(mg, "MANY_ROWS_LAUNCH", dict(BLOCK_M=32, num_warps=8))
    wide = moe_experts_fp8(x, ids, weights, w_gate, w_up, w_down, scales)
    assert torch.equal(wide, pinned)
    for i in (0, rows - 1):
        assert torch.equal(moe_experts_fp8(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], w_gate, w_up, w_down, scales), wide[i : i + 1])


@pytest.mark.parametrize("rows", [1, 5])
def test_few_rows_launch_gives_the_pinned_bits(device, monkeypatch, rows):
    """Block-FP8 experts of many in bf16 take FEW_ROWS_LAUNCH up to FEW_ROWS rows: the same bits as
    the pinned launch (narrow feature tiles, one warp, a narrow combine), and rows past FEW_ROWS
    equal to themselves alone."""
    import hybrid_kernels.moe_grouped as mg

    x, ids, weights, w_gate, w_up, w_down, scales = make(mg.FEW_ROWS + 2, 40, 48, 32, 3, (16, 16), torch.bfloat16, device, seed=3)
    assert mg.MANY_EXPERTS_PER_SLOT * 3 <= 32
    pinned = moe_experts_fp8(x[:rows], ids[:rows], weights[:rows], w_gate, w_up, w_down, scales)
    monkeypatch.setattr(mg, "FEW_ROWS_LAUNCH", dict(BLOCK_N=16, num_warps=1, num_stages=3, BLOCK_N2=16, num_warps2=1, BLOCK_H=16))
    few = moe_experts_fp8(x[:rows], ids[:rows], weights[:rows], w_gate, w_up, w_down, scales)
    assert torch.equal(few, pinned)
    full = moe_experts_fp8(x, ids, weights, w_gate, w_up, w_down, scales)
    assert torch.equal(full[:rows], few), f"rows 0..{rows} with the few-rows launch differ from the {len(x)}-row launch"


@triton.jit
def _raw(src, dst, INTERPRET: tl.constexpr):
    o = tl.arange(0, 256)
    tl.store(dst + o, raw_bf16(tl.load(src + o), INTERPRET))


def test_raw_bf16_is_each_fp8_value_times_two_to_the_minus_120(device):
    """Every e4m3 byte but the two NaN encodings (subnormals and both zeros included) becomes the bf16
    of its value times 2^-120, exactly: the weights a step that applies its scale after the sum
    multiplies. (A NaN byte, which no quantizer writes, reads as 480 times 2^-120.)"""
    src = torch.arange(256, dtype=torch.uint8).view(FP8).to(device)
    dst = torch.empty(256, dtype=torch.bfloat16, device=device)
    _raw[(1,)](src, dst, interpreting())
    got, want = dst.cpu().float(), src.cpu().float() * 2.0**-120
    nan = torch.isnan(want)
    assert nan.sum() == 2 and torch.equal(got[~nan], want[~nan])
    assert torch.equal(dst.cpu().view(torch.int16)[[0, 128]], torch.tensor([0, -32768], dtype=torch.int16))  # +0, -0


@pytest.mark.parametrize("scale_after", [True, False])
def test_both_walks_match_their_reference_and_keep_rows_invariant(device, monkeypatch, scale_after):
    """At a shape that takes the scale-after walk (`scale_after`: K steps in one scale column,
    features of 128), with it (the default) and without it (every weight dequantized): within the
    bf16 tolerance of the reference each computes, and each row's bits alone equal its bits among
    1, 3 and 17 rows."""
    import hybrid_kernels.moe_grouped as mg

    monkeypatch.setattr(mg, "SCALE_AFTER_ON", scale_after)
    r, h, i, e, t, block = 17, 256, 256, 17, 2, (128, 128)
    assert mg.scale_after(h, i, 128, 128) and mg.scale_after(i, h, 128, 128)
    args = make(r, h, i, e, t, block, torch.bfloat16, device, seed=5)
    got = moe_experts_fp8(*args)
    if scale_after:
        # against the fp32 real weights: the scale-after walk never rounds a weight to bf16, so what is
        # left is the kernel's bf16 roundings of the hidden rows and the output (one bf16 step, 2^-7)
        x, ids, weights, w_gate, w_up, w_down, scales = on_cpu(*args)
        real = [dequantize_ref(w, sc, torch.float32) for w, sc in zip((w_gate, w_up, w_down), scales)]
        want = moe_experts_ref(x.float(), ids, weights, *real)
    else:  # the bf16 real weights, as the CPU backend multiplies them
        want = moe_experts_fp8_ref(*on_cpu(*args))
    walk = "scale-after" if scale_after else "dequantize"
    assert_close(f"moe_experts_fp8, {walk} walk", got.cpu(), want, *TOLERANCE[torch.bfloat16])
    x, ids, weights, *rest = args
    for rows in (1, 3):
        part = moe_experts_fp8(x[:rows], ids[:rows], weights[:rows], *rest)
        assert torch.equal(part, got[:rows]), f"the first {rows} rows differ from the same rows among {r}"


def test_a_prefill_launch_matches_the_reference_and_keeps_rows_invariant(device):
    """A prefill's launch (moe_grouped.PREFILL_LAUNCH: blocks of 64 pairs, wide feature tiles) of
    block-FP8 experts of many: within the tolerance of the fp32 real weights' reference, and each
    row's bits alone equal its bits among 3 and 70 rows (a block of 64 pairs and more)."""
    from hybrid_kernels.moe import moe_experts_routed
    from hybrid_kernels.moe_grouped import PREFILL_LAUNCH, group_pairs, many_experts

    r, h, i, e, t, block = 70, 256, 256, 17, 2, (128, 128)
    assert many_experts(e, t) and PREFILL_LAUNCH["BLOCK_M"] == 64
    args = make(r, h, i, e, t, block, torch.bfloat16, device, seed=9)
    x, ids, weights, w_gate, w_up, w_down, scales = args

    def prefill(rows: int) -> torch.Tensor:
        routing = group_pairs(ids[:rows].contiguous(), weights[:rows].float().contiguous(), e)
        return moe_experts_routed(x[:rows], routing, w_gate, w_up, w_down, scales, prefill=True)

    got = prefill(r)
    cx, cids, cweights, *cw, cscales = on_cpu(*args)
    real = [dequantize_ref(w, sc, torch.float32) for w, sc in zip(cw, cscales)]
    assert_close("moe_experts_routed, prefill launch", got.cpu(), moe_experts_ref(cx.float(), cids, cweights, *real),
                 *TOLERANCE[torch.bfloat16])
    for rows in (1, 3):
        assert torch.equal(prefill(rows), got[:rows]), f"the first {rows} rows differ from the same rows among {r}"


@pytest.mark.parametrize("parts", [1, 2])
def test_stage_one_in_k_parts_matches_the_reference_and_keeps_rows_invariant(device, monkeypatch, parts):
    """Stage 1's scale-after walk summing H in 1 or 2 parts (moe_grouped.SCALE_AFTER_PARTS): within
    the tolerance of the fp32 real weights' reference, and each row's bits the same alone, among 3
    (two programs a tile, the second adding the first's sums), among 17 (one program walking both
    parts) and among 70 rows (the many-row launch). The tickets are all back at zero after every
    launch, and a launch run again gives the same bits."""
    import hybrid_kernels.moe_grouped as mg

    monkeypatch.setattr(mg, "SCALE_AFTER_PARTS", parts)
    r, h, i, e, t, block = 70, 512, 256, 17, 2, (128, 128)
    assert mg.k_parts(h, 128, True) == parts
    args = make(r, h, i, e, t, block, torch.bfloat16, device, seed=11)
    got = moe_experts_fp8(*args)
    x, ids, weights, w_gate, w_up, w_down, scales = on_cpu(*args)
    real = [dequantize_ref(w, sc, torch.float32) for w, sc in zip((w_gate, w_up, w_down), scales)]
    assert_close(f"moe_experts_fp8, stage 1 in {parts} parts", got.cpu(), moe_experts_ref(x.float(), ids, weights, *real),
                 *TOLERANCE[torch.bfloat16])
    x, ids, weights, *rest = args
    for rows in (1, 3, 17):
        part = moe_experts_fp8(x[:rows], ids[:rows], weights[:rows], *rest)
        assert torch.equal(part, got[:rows]), f"the first {rows} rows differ from the same rows among {r}"
    assert torch.equal(moe_experts_fp8(x[:3], ids[:3], weights[:3], *rest), got[:3]), "a second launch differs"
    held = mg._PART_BUFFERS._by_device.get(torch.device(device))
    if parts > 1:
        assert held is not None and not held[1].any(), "a ticket was left above zero"
