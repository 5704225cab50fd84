"""kernels/linear.py: the row-invariant skinny GEMM against its torch reference.

Tolerances (inputs are unit-variance, so an output's scale is sqrt(K)):
- fp32: rtol 1e-5, atol 1e-5 * sqrt(K). Kernel and reference sum the same K exact-in-fp64 products
  in fp32 in different orders (tiles of BLOCK_K vs the CPU's GEMV); that order difference is a few
  units of 2^-24 times the partial sums' size, ~1e-6 * sqrt(K) measured at K <= 300, so the bound
  is ~10x the observed noise yet far below any indexing or masking error (O(1) * sqrt(K)).
- bf16: rtol 2^-7 (one bf16 ulp), atol 1e-4 * sqrt(K). Both sides accumulate the bf16 products
  (exact in fp32) in fp32, add the bias in fp32 and round once, so they differ only where the two
  fp32 sums straddle a rounding boundary: one ulp, at most 2^-7 |out|. atol covers sums that cancel
  to near zero, with 10x the fp32 margin for tensor cores, whose in-MMA accumulation is not
  IEEE round-to-nearest on real GPUs.
"""

import math

import pytest
import torch
import torch.nn.functional as F
import triton

from hybrid_kernels import linear as linear_module
from hybrid_kernels.linear import BLOCK_M, WIDE_N, LinearConfig, SplitSums, linear, linear_config, linear_ref, tile_for_rows

from .conftest import ROW_COUNTS, assert_close, assert_refused, nan_like

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPES = [(1, 40, 24), (5, 33, 70), (17, 64, 130), (33, 96, 47), (3, 300, 20)]  # (M, K, N)


def tolerance(dtype: torch.dtype, k: int) -> tuple[float, float]:
    if dtype == torch.float32:
        return 1e-5, 1e-5 * math.sqrt(k)
    return 2.0**-7, 1e-4 * math.sqrt(k)


def make(m: int, k: int, n: int, dtype: torch.dtype, bias: bool, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = torch.randn(n, k, generator=g).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def on_cpu(*ts):
    return [None if t is None else t.cpu() for t in ts]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}-K{}-N{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_matches_reference(device, dtype, shape, bias):
    m, k, n = shape
    x, w, b = make(m, k, n, dtype, bias, device)
    got = linear(x, w, b)
    want = linear_ref(*on_cpu(x, w, b))  # the reference backend runs on the CPU
    assert got.dtype == dtype
    rtol, atol = tolerance(dtype, k)
    assert_close(f"linear {dtype} M{m} K{k} N{n} bias={bias}", got.cpu(), want, rtol, atol)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_row_invariance(device, dtype, bias):
    """op(x[:r]) == op(x)[:r] bitwise for every row count, and a row alone == that row in a batch.

    K 136 runs several K blocks with a ragged last one (fp32: 5 of 32, bf16: 2 of 128)."""
    k, n = 136, 24
    x, w, b = make(max(ROW_COUNTS), k, n, dtype, bias, device)
    full = linear(x, w, b)
    for r in ROW_COUNTS:
        assert torch.equal(linear(x[:r], w, b), full[:r]), f"rows 0..{r} differ from the {len(x)}-row launch"
    # serial decode computes each verify row alone, at tile slot 0: every other slot of the first
    # tile (under the interpreter, numpy's matmul gave rows 6..15 other bits), and later tiles
    for i in (*range(1, BLOCK_M), BLOCK_M, 2 * BLOCK_M + 1, len(x) - 1):
        assert torch.equal(linear(x[i : i + 1].clone(), w, b), full[i : i + 1]), f"row {i} alone differs"


@pytest.mark.parametrize("m", [1, 17, 33], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_nan_poisoned_output(device, dtype, m):
    """Every [M, N] element is written, nothing outside it: out is a window of a NaN buffer."""
    k, n = 40, 70
    x, w, b = make(m, k, n, dtype, True, device)
    buf = nan_like(torch.empty(m + 3, n + 5, dtype=dtype, device=device))
    out = buf[:m, :n]
    assert linear(x, w, b, out=out) is out
    assert not torch.isnan(out).any(), "NaN left in out: an element was not written"
    assert torch.equal(out, linear(x, w, b))
    assert torch.isnan(buf[m:]).all() and torch.isnan(buf[:, n:]).all(), "wrote outside out"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_strided_x(device, dtype):
    """x as a column window of a wider buffer, or column-major, gives the contiguous result's bits."""
    m, k, n = 5, 33, 24
    x, w, b = make(m, k, n, dtype, True, device)
    wide = torch.zeros(m, k + 7, dtype=dtype, device=device)
    wide[:, 3 : 3 + k] = x
    want = linear(x, w, b)
    assert torch.equal(linear(wide[:, 3 : 3 + k], w, b), want)
    assert torch.equal(linear(x.t().contiguous().t(), w, b), want)


def test_no_rows(device):
    x, w, b = make(0, 16, 8, torch.float32, True, device)
    assert linear(x, w, b).shape == (0, 8)


def test_reference_mirrors_each_row():
    """linear_ref is the reference backend's row-invariant projection, bit for bit."""
    from verifier.model.ops import each_row  # here, so the kernel tests collect without the model

    for dtype in DTYPES.values():
        x, w, b = make(7, 33, 20, dtype, True, "cpu")
        want = each_row(lambda t: F.linear(t, w, b), x, row_invariant=True)
        assert torch.equal(linear_ref(x, w, b), want)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_config_is_legal(dtype):
    """Pinned configs: powers of two >= 16 (tl.dot's minimum), from (N, K, dtype) alone."""
    for n in (1, 24, 130, 2048, 8192, 151936):
        for k in (1, 33, 2048, 5120):
            cfg = linear_config(n, k, dtype)
            for size in (cfg.BLOCK_N, cfg.BLOCK_K):
                assert size >= 16 and size & (size - 1) == 0, cfg


def _bad(device, **over):
    x, w, b = make(3, 8, 5, torch.float32, True, device)
    args = {"x": x, "weight": w, "bias": b, "out": None}
    args.update(over)
    return args


ERRORS = {
    "x-3d": (lambda d: _bad(d, x=torch.zeros(1, 3, 8, device=d)), "x must be 2-D"),
    "x-fp16": (lambda d: _bad(d, x=torch.zeros(3, 8, dtype=torch.float16, device=d)), "x dtype"),
    "weight-dtype-mix": (lambda d: _bad(d, weight=torch.zeros(5, 8, dtype=torch.bfloat16, device=d)), "weight dtype"),
    "weight-K-mismatch": (lambda d: _bad(d, weight=torch.zeros(5, 9, device=d)), "weight K"),
    "weight-1d": (lambda d: _bad(d, weight=torch.zeros(8, device=d)), "weight must be 2-D"),
    "weight-strided-K": (lambda d: _bad(d, weight=torch.zeros(8, 5, device=d).t()), "weight must be contiguous"),
    "bias-dtype": (lambda d: _bad(d, bias=torch.zeros(5, dtype=torch.bfloat16, device=d)), "bias dtype"),
    "bias-shape": (lambda d: _bad(d, bias=torch.zeros(6, device=d)), "bias must have shape"),
    "out-shape": (lambda d: _bad(d, out=torch.zeros(3, 6, device=d)), "out must have shape"),
    "out-dtype": (lambda d: _bad(d, out=torch.zeros(3, 5, dtype=torch.bfloat16, device=d)), "out dtype"),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_launcher_errors(device, case):
    assert_refused(case, device, linear)


def test_device_mismatch(device):
    if device != "cuda":
        pytest.skip("needs a GPU: under the interpreter every tensor is on the CPU")
    with pytest.raises(ValueError, match="weight is on"):
        linear(**_bad(device, weight=torch.zeros(5, 8)))


SPLITS = [LinearConfig(16, 16, 4, 2, SPLIT_K=2), LinearConfig(32, 16, 4, 2, SPLIT_K=4), LinearConfig(16, 32, 4, 2, SPLIT_K=8)]


@pytest.mark.parametrize("cfg", SPLITS, ids=lambda c: f"N{c.BLOCK_N}-K{c.BLOCK_K}-split{c.SPLIT_K}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_split_k(device, dtype, cfg):
    """The fixed split of K (narrow weights on the GPU): matches the reference within the same
    tolerance (another association of the same exact products), is row-invariant, writes every
    output element (NaN-poisoned out), and keeps the bias; K 136 leaves the last split ragged."""
    k, n = 136, 40
    x, w, b = make(max(ROW_COUNTS), k, n, dtype, True, device)
    full = linear(x, w, b, config=cfg)
    assert_close(f"split-K {cfg}", full.cpu(), linear_ref(*on_cpu(x, w, b)), *tolerance(dtype, k))
    for r in ROW_COUNTS:
        assert torch.equal(linear(x[:r], w, b, config=cfg), full[:r]), f"rows 0..{r} differ"
    for i in (*range(1, BLOCK_M), BLOCK_M, len(x) - 1):
        assert torch.equal(linear(x[i : i + 1].clone(), w, b, config=cfg), full[i : i + 1]), f"row {i} alone differs"
    out = nan_like(torch.empty(5, n, dtype=dtype, device=device))
    assert torch.equal(linear(x[:5], w, b, out=out, config=cfg), full[:5])


@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_deferred_split_finishes_to_the_same_bits(device, dtype, bias):
    """defer_split hands a split product's sums over unfinished (SplitSums): finish() gives the
    undeferred output bitwise, at every row count; an unsplit product comes back finished."""
    k, n, cfg = 136, 40, SPLITS[1]
    x, w, b = make(max(ROW_COUNTS), k, n, dtype, bias, device)
    for r in (1, 5, max(ROW_COUNTS)):
        sums = linear(x[:r], w, b, config=cfg, defer_split=True)
        assert isinstance(sums, SplitSums) and sums.partial.shape == (cfg.SPLIT_K, r, n) and sums.dtype == dtype
        assert torch.equal(sums.finish(), linear(x[:r], w, b, config=cfg)), f"rows {r}"
    unsplit = cfg._replace(SPLIT_K=1)
    assert torch.equal(linear(x, w, b, config=unsplit, defer_split=True), linear(x, w, b, config=unsplit))
    with pytest.raises(ValueError, match="defer_split returns the split sums; it takes no out buffer"):
        linear(x, w, b, out=torch.empty(len(x), n, dtype=dtype, device=device), config=cfg, defer_split=True)


def test_narrow_bf16_weights_split_k():
    """The pinned rule: bf16 weights with few output tiles split K (2048-wide outputs of the 2B
    model: 64 tiles, 4 splits), wide ones (an LM head) and fp32 never do."""
    assert linear_config(2048, 4096, torch.bfloat16).SPLIT_K == 4
    assert linear_config(151936, 2048, torch.bfloat16).SPLIT_K == 1
    assert linear_config(2048, 4096, torch.float32).SPLIT_K == 1
    assert linear_config(2048, 256, torch.bfloat16).SPLIT_K == 1  # too few K steps to split


# row counts either side of every tile boundary (kernels/linear.py ROW_TILES), to 1024 on the GPU
TILE_ROW_COUNTS = [1, 15, 16, 17, 31, 32, 33, 64, 65, 127, 128, 129]


@pytest.mark.parametrize("wide", [False, True], ids=["tiles", "wide-tiles"])
@pytest.mark.parametrize("shape", [(136, 40), (1024, 48), (256, 520)], ids=lambda s: "K{}-N{}".format(*s))
def test_row_invariance_across_tiles(device, shape, wide, monkeypatch):
    """bf16 batches take wider tiles from ROW_TILES' row counts on (the K walk unchanged): a row's
    bits are the same alone, in a batch of any size, and sliced at any offset. (1024, 48) splits K
    (narrow weight, many K steps); (136, 40) has a ragged last K block; (256, 520) several N tiles.
    wide: every weight counts as wide (WIDE_N lowered), so 32 to 127 rows take the wide tile."""
    k, n = shape
    if wide:
        monkeypatch.setattr(linear_module, "WIDE_N", 1)
    counts = TILE_ROW_COUNTS + ([576, 1024] if device == "cuda" else [])
    x, w, b = make(max(counts), k, n, torch.bfloat16, True, device)
    assert (linear_config(n, k, torch.bfloat16).SPLIT_K > 1) == (shape == (1024, 48))
    largest = tile_for_rows(linear_config(n, k, torch.bfloat16), n, max(counts), torch.bfloat16)  # ROW_TILES' first
    assert largest.TMA and largest.BLOCK_M == (64 if wide or shape == (1024, 48) else 128)
    split = shape == (1024, 48) and not wide
    for rows, block_n in ((96, 64), (64, 32)):  # ROW_TILES' second and third
        middle = tile_for_rows(linear_config(n, k, torch.bfloat16), n, rows, torch.bfloat16)
        assert not middle.TMA and middle.BLOCK_M == 64 and middle.BLOCK_K == (128 if split else 64)
        assert middle.BLOCK_N == (min(128, triton.next_power_of_2(n)) if wide else min(block_n, triton.next_power_of_2(n)))
    full = linear(x, w, b)
    for r in counts:
        assert torch.equal(linear(x[:r], w, b), full[:r]), f"rows 0..{r} differ from the {len(x)}-row launch"
    for i in (0, 5, 63, 64, 127, len(x) - 1):
        assert torch.equal(linear(x[i : i + 1].clone(), w, b), full[i : i + 1]), f"row {i} alone differs"
    assert torch.equal(linear(x[37:37 + 100], w, b), full[37:137])  # a 64-row-tile batch at an odd offset


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TMA loads run on the GPU only")
@pytest.mark.parametrize("shape", [(2048, 256), (4096, 128), (136, 40)], ids=lambda s: "K{}-N{}".format(*s))
def test_tma_loads_give_the_pointer_loads_bits(shape, monkeypatch):
    """From 128 rows the tiles load through tensor descriptors (TMA): bitwise what the pointer loads
    give, on the whole-K and split-K paths ((4096, 128) splits K) and a ragged last K block
    (136, 40); a batch whose start is not 16-byte aligned falls back to the pointer loads, with
    the same bits."""
    k, n = shape
    x, w, b = make(300, k, n, torch.bfloat16, True, "cuda")
    assert tile_for_rows(linear_config(n, k, torch.bfloat16), n, 300, torch.bfloat16).TMA
    assert linear_module._tma_loads(x, w)
    with_tma = linear(x, w, b)
    flat = torch.empty(300 * k + 1, dtype=torch.bfloat16, device="cuda")
    misaligned = flat[1:].view(300, k)  # starts 2 bytes past an aligned address
    misaligned.copy_(x)
    assert not linear_module._tma_loads(misaligned, w)
    assert torch.equal(linear(misaligned, w, b), with_tma)
    monkeypatch.setattr(linear_module, "_tma_loads", lambda x, weight: False)
    assert torch.equal(linear(x, w, b), with_tma)


def test_tiles_by_rows_keep_the_k_walk():
    """A tile for more rows keeps the pinned SPLIT_K, takes a BLOCK_K that divides the pinned one,
    and fp32 keeps the pinned tile whatever the rows."""
    for n, k in [(12352, 2048), (2048, 4096), (512, 2048), (24, 136), (151936, 2048)]:
        pinned = linear_config(n, k, torch.bfloat16)
        for m in (1, 16, 31, 32, 64, 65, 127, 128, 1024):
            tile = tile_for_rows(pinned, n, m, torch.bfloat16)
            assert tile.SPLIT_K == pinned.SPLIT_K and pinned.BLOCK_K % tile.BLOCK_K == 0
            # from 128 rows: TMA loads, and 64-row tiles for split-K weights and LM heads
            wide_at_128 = n >= WIDE_N or pinned.SPLIT_K > 1
            assert tile.BLOCK_M == (16 if m < 32 else 64 if m < 128 or wide_at_128 else 128)
            assert tile.TMA == (m >= 128)
            if 32 <= m < 128:  # an LM head's features are tiles enough at 128 a tile; narrower weights take
                # 32 up to 64 rows (one M tile), 64 from 65
                narrow = 32 if m <= 64 else 64
                assert tile.BLOCK_N == min(128 if n >= WIDE_N else narrow, max(16, triton.next_power_of_2(n)))
        assert tile_for_rows(linear_config(n, k, torch.float32), n, 1024, torch.float32) == linear_config(n, k, torch.float32)


@pytest.mark.parametrize("shape", [(136, 40), (1024, 48)], ids=lambda s: "K{}-N{}".format(*s))
def test_fp32_out_is_the_bf16_product_widened(device, shape):
    """bf16 x into an fp32 out (an LM head's logits): bitwise the bf16 output widened, on the whole-K
    path and the split-K path (1024, 48), at row counts on both sides of a tile boundary; fp32 x
    into a bf16 out is refused."""
    k, n = shape
    x, w, b = make(40, k, n, torch.bfloat16, True, device)
    for rows in (1, 33, 40):
        out = nan_like(torch.empty(rows, n, dtype=torch.float32, device=device))
        assert linear(x[:rows], w, b, out=out) is out
        assert torch.equal(out, linear(x[:rows], w, b).float()), f"{rows} rows"
    with pytest.raises(ValueError, match="out"):
        linear(x.float(), w.float(), out=torch.empty(40, n, dtype=torch.bfloat16, device=device))
