"""kernels/linear_fp8.py: the row-invariant W8A16 block-FP8 GEMM against its torch reference.

Weights are random fp8 values (~N(0, 1), so the format's subnormals and large values both occur)
times block scales in [0.5, 1.5): real weights of unit scale, like test_linear.py's. The kernel
and `linear_fp8_ref` multiply the same real weight (fp8 x scale in fp32, cast once to x's dtype:
the kernel rebuilds exactly `dequantize_ref`'s tensor per tile), so they differ only in the
order of the fp32 sums, and test_linear.py's tolerances apply unchanged:
- fp32: rtol 1e-5, atol 1e-5 * sqrt(K) (summation order, ~1e-6 * sqrt(K) observed);
- bf16: rtol 2^-7 (one bf16 ulp of the output), atol 1e-4 * sqrt(K).
"""

import math

import pytest
import torch

from hybrid_kernels import linear_fp8 as linear_fp8_module
from hybrid_kernels.linear import LinearConfig, linear, linear_config
from hybrid_kernels.linear_fp8 import FP8, BlockScales, dequantize_ref, fp8_config, linear_fp8, linear_fp8_ref, standard_scale_row

from .conftest import ROW_COUNTS, assert_close, assert_refused, nan_like

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (M, K, N, [block_n, block_k]): N and K off the block grid (partial edge blocks), a block larger
# than the weight, and a block_k that is not a power of two
SHAPES = [(1, 40, 24, (16, 16)), (5, 70, 33, (16, 32)), (17, 136, 40, (32, 24)), (3, 300, 20, (128, 128)), (33, 47, 96, (8, 40))]


def tolerance(dtype: torch.dtype, k: int) -> tuple[float, float]:
    if dtype == torch.float32:
        return 1e-5, 1e-5 * math.sqrt(k)
    return 2.0**-7, 1e-4 * math.sqrt(k)


def make_weight(n: int, k: int, block: tuple[int, int], device: str, seed: int = 0) -> tuple[torch.Tensor, BlockScales]:
    """A float8_e4m3fn [n, k] weight and its scales [ceil(n / bn), ceil(k / bk)] in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    bn, bk = block
    weight = torch.randn(n, k, generator=g).to(FP8)
    scale_inv = 0.5 + torch.rand(-(-n // bn), -(-k // bk), generator=g)
    return weight.to(device), BlockScales(scale_inv.to(device), standard_scale_row(n, bn, device), bk)


def make(m: int, k: int, n: int, block, dtype: torch.dtype, bias: bool, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return (x, *make_weight(n, k, block, device, seed), b)


def on_cpu(x, weight, scales, bias):
    return x.cpu(), weight.cpu(), BlockScales(*(t.cpu() for t in scales[:2]), scales.block_k), None if bias is None else bias.cpu()


def shape_id(s):
    return "M{}-K{}-N{}-block{}x{}".format(*s[:3], *s[3])


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_reference(device, dtype, shape, bias):
    m, k, n, block = shape
    args = make(m, k, n, block, dtype, bias, device)
    got = linear_fp8(*args)
    want = linear_fp8_ref(*on_cpu(*args))
    assert got.dtype == dtype
    assert_close(f"linear_fp8 {dtype} {shape_id(shape)} bias={bias}", got.cpu(), want, *tolerance(dtype, k))


def test_dequantize_ref_is_block_scaling():
    """dequantize_ref against a plain loop over blocks, edge blocks partial: fp32(fp8) x scale, cast once."""
    weight, scales = make_weight(37, 53, (16, 32), "cpu")
    for dtype in DTYPES.values():
        want = torch.empty(37, 53, dtype=dtype)
        for i in range(0, 37, 16):
            for j in range(0, 53, 32):
                want[i : i + 16, j : j + 32] = (weight[i : i + 16, j : j + 32].float() * scales.scale_inv[i // 16, j // 32]).to(dtype)
        assert torch.equal(dequantize_ref(weight, scales, dtype), want)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_row_invariance(device, dtype, bias):
    """op(x[:r]) == op(x)[:r] bitwise for every row count; a row alone (a copy, and a view at an
    odd offset of the batch) == that row in the batch. K 136 with blocks [16, 24]: several K steps,
    a ragged last one, and scales gathered per element (24 is no multiple of the K step)."""
    k, n = 136, 40
    x, weight, scales, b = make(max(ROW_COUNTS), k, n, (16, 24), dtype, bias, device)
    full = linear_fp8(x, weight, scales, b)
    for r in ROW_COUNTS:
        assert torch.equal(linear_fp8(x[:r], weight, scales, b), full[:r]), f"rows 0..{r} differ from the {len(x)}-row launch"
    block_m = fp8_config(n, k, dtype).BLOCK_M
    for i in sorted({*range(1, min(block_m, len(x))), len(x) - 1}):
        assert torch.equal(linear_fp8(x[i : i + 1].clone(), weight, scales, b), full[i : i + 1]), f"row {i} alone differs"
    odd = torch.zeros(len(x) * k + 1, dtype=dtype, device=device)[1:].view(len(x), k)  # rows start off alignment
    odd.copy_(x)
    for i in (3, 17):
        assert torch.equal(linear_fp8(odd[i : i + 1], weight, scales, b), full[i : i + 1]), f"row {i} at an odd offset differs"


SPLITS = [LinearConfig(16, 16, 4, 2, SPLIT_K=2), LinearConfig(32, 16, 4, 2, SPLIT_K=4), LinearConfig(16, 32, 4, 2, SPLIT_K=8)]


@pytest.mark.parametrize("cfg", SPLITS, ids=lambda c: f"N{c.BLOCK_N}-K{c.BLOCK_K}-split{c.SPLIT_K}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_split_k(device, dtype, cfg):
    """The fixed split of K (narrow bf16 weights on the GPU): close to the reference, row-invariant,
    every output element written (NaN-poisoned out), bias kept; K 136 leaves the last split ragged."""
    k, n = 136, 40
    x, weight, scales, b = make(max(ROW_COUNTS), k, n, (16, 32), dtype, True, device)
    full = linear_fp8(x, weight, scales, b, config=cfg)
    assert_close(f"split-K {cfg}", full.cpu(), linear_fp8_ref(*on_cpu(x, weight, scales, b)), *tolerance(dtype, k))
    for r in (1, 2, 5, 16, 17, 33):
        assert torch.equal(linear_fp8(x[:r], weight, scales, b, config=cfg), full[:r]), f"rows 0..{r} differ"
    out = nan_like(torch.empty(5, n, dtype=dtype, device=device))
    assert torch.equal(linear_fp8(x[:5], weight, scales, b, out=out, config=cfg), full[:5])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_scales_per_step_or_per_element_agree(device, dtype):
    """The two ways of loading scales give the same bits: block_k 16 under a 16-wide K step (one
    scale column per step) vs the same real weight as block_k 8 with each scale repeated (gathered
    per element)."""
    k, n, cfg = 48, 24, LinearConfig(16, 16, 4, 2)
    x, weight, scales, _ = make(5, k, n, (16, 16), dtype, False, device)
    halves = BlockScales(scales.scale_inv.repeat_interleave(2, dim=1).contiguous(), scales.scale_row, 8)
    assert torch.equal(linear_fp8(x, weight, scales, config=cfg), linear_fp8(x, weight, halves, config=cfg))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rows_keep_their_scale_rows(device, dtype):
    """Rows permuted and joined (as the loader de-interleaves and concatenates weights) keep their
    own scales through scale_row: the result is the original's columns, permuted."""
    k, n = 40, 24
    x, weight, scales, _ = make(3, k, n, (16, 16), dtype, False, device)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3)).to(device)
    moved = BlockScales(scales.scale_inv, scales.scale_row[perm].contiguous(), scales.block_k)
    got = linear_fp8(x, weight[perm].contiguous(), moved)
    assert_close("permuted rows", got.cpu(), linear_fp8_ref(*on_cpu(x, weight, scales, None))[:, perm.cpu()], *tolerance(dtype, k))


@pytest.mark.parametrize("m", [1, 17], ids=lambda m: f"M{m}")
def test_nan_poisoned_output(device, m):
    """Every [M, N] element is written, nothing outside it: out is a window of a NaN buffer."""
    k, n = 40, 70
    x, weight, scales, b = make(m, k, n, (16, 16), torch.bfloat16, True, device)
    buf = nan_like(torch.empty(m + 3, n + 5, dtype=torch.bfloat16, device=device))
    out = buf[:m, :n]
    assert linear_fp8(x, weight, scales, b, out=out) is out
    assert not torch.isnan(out).any(), "NaN left in out: an element was not written"
    assert torch.equal(out, linear_fp8(x, weight, scales, b))
    assert torch.isnan(buf[m:]).all() and torch.isnan(buf[:, n:]).all(), "wrote outside out"


def test_no_rows(device):
    x, weight, scales, b = make(0, 16, 8, (16, 16), torch.float32, True, device)
    assert linear_fp8(x, weight, scales, b).shape == (0, 8)


def _bad(device, **over):
    x, weight, scales, b = make(3, 40, 24, (16, 16), torch.float32, True, device)
    args = {"x": x, "weight": weight, "scales": scales, "bias": b, "out": None}
    for key, value in over.items():
        if key in ("scale_inv", "scale_row", "block_k"):
            args["scales"] = args["scales"]._replace(**{key: value})
        else:
            args[key] = value
    return args


ERRORS = {
    "weight-fp32": (lambda d: _bad(d, weight=torch.zeros(24, 40, device=d)), "weight dtype"),
    "weight-K": (lambda d: _bad(d, weight=torch.zeros(24, 41, device=d).to(FP8)), "weight K"),
    "scale-cols": (lambda d: _bad(d, scale_inv=torch.ones(2, 2, device=d)), "scale_inv must have shape"),
    "scale-bf16": (lambda d: _bad(d, scale_inv=torch.ones(2, 3, dtype=torch.bfloat16, device=d)), "scale_inv dtype"),
    "scale_row-int64": (lambda d: _bad(d, scale_row=torch.zeros(24, dtype=torch.int64, device=d)), "scale_row dtype"),
    "scale_row-len": (lambda d: _bad(d, scale_row=torch.zeros(23, dtype=torch.int32, device=d)), "scale_row must have shape"),
    "block_k-0": (lambda d: _bad(d, block_k=0), "block_k must be"),
    "bias-shape": (lambda d: _bad(d, bias=torch.zeros(6, device=d)), "bias must have shape"),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_launcher_errors(device, case):
    assert_refused(case, device, linear_fp8, linear_fp8_ref)


@pytest.mark.parametrize("block", [(128, 128), (16, 24)], ids=["blocks128", "blocks16x24"])
def test_row_invariance_across_row_counts(device, block):
    """One tile for every row count (the module docstring): a row's bits are the same alone and in
    batches on either side of the bf16 GEMM's tile boundaries (32, 65, 128 rows), with scales read
    one column per K step (128 x 128 blocks) or gathered per element (16 x 24)."""
    k, n = 256, 72
    counts = [1, 16, 31, 32, 33, 63, 64, 65, 127, 128, 129] + ([576] if device == "cuda" else [])
    x, weight, scales, b = make(max(counts), k, n, block, torch.bfloat16, True, device)
    full = linear_fp8(x, weight, scales, b)
    for r in counts:
        assert torch.equal(linear_fp8(x[:r], weight, scales, b), full[:r]), f"rows 0..{r} differ"
    for i in (0, 40, 63, 64, len(x) - 1):
        assert torch.equal(linear_fp8(x[i : i + 1].clone(), weight, scales, b), full[i : i + 1]), f"row {i} alone differs"


class _Launches:
    """Stands in for the kernel: records each launch's grid and keyword arguments, runs nothing."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, kwargs))


def test_one_config_for_every_row_count(device, monkeypatch):
    """fp32: the launch's constexprs (tile, K step, split, warps, stages) are those of fp8_config for
    the weight's shape at every row count; only the grid's row axis follows M."""
    dtype = torch.float32
    launches = _Launches()
    monkeypatch.setattr(linear_fp8_module, "_linear_fp8_kernel", launches)
    monkeypatch.setattr(linear_fp8_module, "reduce_splits_kernel", _Launches())
    k, n = 2048, 1024
    weight, scales = make_weight(n, k, (128, 128), device)
    cfg = fp8_config(n, k, dtype)
    for m in (1, 9, 31, 32, 64, 65, 128, 576):
        linear_fp8(torch.zeros(m, k, dtype=dtype, device=device), weight, scales)
    assert len(launches.calls) == 8
    for m, (grid, kwargs) in zip((1, 9, 31, 32, 64, 65, 128, 576), launches.calls):
        tile = {key: kwargs[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")}
        assert tile == {key: getattr(cfg, key) for key in tile}, f"M = {m}: launched {tile}, not {cfg}"
        assert grid == (-(-m // cfg.BLOCK_M), -(-n // cfg.BLOCK_N), cfg.SPLIT_K)


@pytest.mark.parametrize("n", [96, 128], ids=["N96", "N128"])  # 128: whole few-rows tiles, no masks (WHOLE)
@pytest.mark.parametrize("target", [None, 2], ids=["bf16_walk", "fp8_walk"])
@pytest.mark.parametrize("m", [1, 9, 63, 64, 65, 130], ids=lambda m: f"M{m}")
def test_bf16_paths_are_the_gemm_of_the_dequantized_weight(device, m, target, n, monkeypatch):
    """bf16: few rows take the weight-first tile, many the bf16 GEMM of the weight dequantized once;
    both walk fp8_config's K (its split included) and give, bitwise, the bf16 GEMM over
    dequantize_ref's weight with that walk, so a row's bits do not depend on which path its batch
    took. FP8_TARGET_PROGRAMS gives FP8 weights a walk of their own (here unsplit where the bf16
    GEMM's pinned walk of the shape splits K in two): both paths follow it."""
    monkeypatch.setattr(linear_fp8_module, "FP8_TARGET_PROGRAMS", target)
    k = 1152  # a split of K in bf16 (9 steps)
    x, weight, scales, b = make(m, k, n, (128, 128), torch.bfloat16, True, device)
    walk = fp8_config(n, k, torch.bfloat16)
    assert walk.SPLIT_K == (2 if target is None else 1) == (linear_config(n, k, torch.bfloat16).SPLIT_K if target is None else 1)
    real = dequantize_ref(weight, scales, torch.bfloat16)
    assert torch.equal(linear_fp8_module.dequantize(weight, scales, torch.bfloat16), real)
    # the interpreter's dot sums each tile's K step at once, so there its bits follow BLOCK_K, which
    # the bf16 GEMM's wide tiles change: compare with the walk's own tile (the GPU's MMAs add 16-wide chunks)
    config = walk if device == "cpu" and m < linear_fp8_module.DEQUANTIZED_ROWS else None
    assert torch.equal(linear_fp8(x, weight, scales, b), linear(x, real, b, config=config, pinned=walk))
    # a caller that keeps the real weight (HybridModel.keep_fp8_reals) gets the same bits on either path
    assert torch.equal(linear_fp8(x, weight, scales, b, real=real), linear(x, real, b, config=config, pinned=walk))


def test_a_kept_real_weight_of_another_shape_or_dtype_is_refused(device):
    x, weight, scales, _ = make(64, 256, 96, (128, 128), torch.bfloat16, False, device)
    real = dequantize_ref(weight, scales, torch.bfloat16)
    with pytest.raises(ValueError, match="real must have shape"):
        linear_fp8(x, weight, scales, real=real[:, :128])
    with pytest.raises(ValueError, match="real"):
        linear_fp8(x, weight, scales, real=real.float())


@pytest.mark.parametrize("m", [1, 9, 64, 72], ids=lambda m: f"M{m}")
def test_fp8_gemm_is_the_gemm_of_the_dequantized_weight(device, m):
    """The W8A16 GEMM multiplies by exactly dequantize_ref's weight: bitwise the bf16 GEMM over that
    weight under the same launch config (the same K walk and tile). The two kernels differ only in
    where the weight tile comes from, so any difference is a dequantization that is not
    `dequantize_ref`'s."""
    k, n = 384, 96
    x, weight, scales, _ = make(m, k, n, (128, 128), torch.bfloat16, False, device)
    cfg = fp8_config(n, k, torch.bfloat16)
    real = dequantize_ref(weight, scales, torch.bfloat16)
    assert torch.equal(linear_fp8(x, weight, scales), linear(x, real, config=cfg))


@pytest.mark.parametrize("layout", ["strided", "misaligned"])
def test_few_rows_take_any_row_layout(device, layout):
    """The few-rows kernel reads x contiguous and 16-byte aligned; rows handed over strided (a column
    slice) or off the alignment (a view one element in) give the bits of the same rows contiguous."""
    m, k, n = 5, 256, 128
    x, weight, scales, b = make(m, k, n, (128, 128), torch.bfloat16, True, device)
    wide = torch.zeros(m, k + 8, dtype=x.dtype, device=device)
    if layout == "strided":
        wide[:, :k] = x
        given = wide[:, :k]
    else:
        given = wide.view(-1)[1:1 + m * k].view(m, k)
        given.copy_(x)
    assert given.data_ptr() % 16 if layout == "misaligned" else given.stride(0) != k
    assert torch.equal(linear_fp8(given, weight, scales, b), linear_fp8(x, weight, scales, b))


@pytest.mark.parametrize("split", [False, True], ids=["whole_k", "split_k"])
def test_scale_after_walk_is_one_walk_across_the_row_switch(device, monkeypatch, split):
    """The dense scale-after walk (SCALE_AFTER_ON): each K step's sum over the raw weight (the fp8
    values times 2^-120), times 2^120 and its block scale. The few-rows kernel (raw tile made in
    registers) and the many-rows kernel (the raw weight, made once or kept) take the same steps in
    the same order, so every row's bits are the same alone, among the first M rows and across
    DEQUANTIZED_ROWS; they are the fp32 product of the fp8 values and their scales to within one
    bf16 rounding of the output and the fp32 sums (the walk never rounds a weight to bf16)."""
    monkeypatch.setattr(linear_fp8_module, "SCALE_AFTER_ON", True)
    k, n = (1152, 128) if split else (256, 256)
    x, weight, scales, b = make(130, k, n, (128, 128), torch.bfloat16, True, device)
    walk = fp8_config(n, k, torch.bfloat16)
    assert walk.SPLIT_K == (2 if split else 1)
    assert linear_fp8_module.scale_after_dense(n, k, walk, scales.block_k)
    full = linear_fp8(x, weight, scales, b)
    raw = linear_fp8_module.raw_weight(weight)
    assert torch.equal(linear_fp8(x, weight, scales, b, raw=raw), full), "a kept raw weight gives other bits"
    for m in (1, 2, 9, 17, 63, 64, 65, 129):
        assert torch.equal(linear_fp8(x[:m], weight, scales, b), full[:m]), f"the first {m} rows differ from the 130-row batch"
    assert torch.equal(linear_fp8(x[64:65], weight, scales, b), full[64:65])
    # the exact product, in fp64: real weight = fp8 value x its scale, unrounded
    exact = x.double() @ (weight.double() * scales.scale_inv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]).T
    assert_close("scale-after", full, (exact + b.double()).float(), *tolerance(torch.bfloat16, k))
    # the dequantize walk rounds every weight to bf16 first: another walk, other bits
    monkeypatch.setattr(linear_fp8_module, "SCALE_AFTER_ON", False)
    assert not torch.equal(linear_fp8(x, weight, scales, b), full)


def test_scale_after_walk_only_where_the_shape_allows(monkeypatch):
    """Whole K steps in one scale column and features a multiple of 128; off with SCALE_AFTER_ON."""
    cfg = fp8_config(256, 1024, torch.bfloat16)
    monkeypatch.setattr(linear_fp8_module, "SCALE_AFTER_ON", True)
    assert linear_fp8_module.scale_after_dense(256, 1024, cfg, 128)
    assert not linear_fp8_module.scale_after_dense(192, 1024, cfg, 128)  # features: not whole 128-wide tiles
    assert not linear_fp8_module.scale_after_dense(256, 1000, fp8_config(256, 1000, torch.bfloat16), 128)  # a partial K step
    assert not linear_fp8_module.scale_after_dense(256, 1024, cfg, 64)  # a K step across two scale columns
    monkeypatch.setattr(linear_fp8_module, "SCALE_AFTER_ON", False)
    assert not linear_fp8_module.scale_after_dense(256, 1024, cfg, 128)


def test_raw_weight_is_each_fp8_value_times_two_to_the_minus_120():
    w = torch.arange(256, dtype=torch.uint8).view(FP8)
    raw = linear_fp8_module.raw_weight(w)
    assert raw.dtype == torch.bfloat16
    finite = ~torch.isnan(w.float())
    assert torch.equal(raw.float()[finite], w.float()[finite] * 2.0**-120)
