"""kernels/moe_grouped.py: the grouping (blocks of pairs per expert) and the row invariance that
the grouped launch must keep although a row's block-mates change with the batch.

Each launch groups the batch's (row, slot) pairs by expert into blocks of BLOCK_M (16 for fp32,
64 for bf16), so the tests pick row counts and routings that put a row in other blocks, at other
places in a block, beside other rows, or alone: every result must be bitwise a function of the row
alone (torch.equal). Kernel vs reference uses test_moe.py's tolerances.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_kernels.moe import moe_experts, moe_experts_ref
from hybrid_kernels.moe_grouped import block_bound, grouped_config

from .conftest import assert_close
from .test_moe import DTYPES, TOLERANCE, make, on_cpu

# (H, I, E, T): H 21 and T 3 put rows off 16-byte alignment; 8 experts of 2 spread the pairs thin
ROUTINGS = {"H21-E6-T3": (21, 20, 6, 3), "H40-E8-T2": (40, 24, 8, 2)}


def block_m(dtype: torch.dtype) -> int:
    return grouped_config(16, 16, dtype).BLOCK_M


def test_block_bound_is_tight():
    """block_bound covers every split of P pairs over E experts, and some split needs all of it."""
    for p in (1, 2, 3, 16, 17, 33, 100):
        for e in (1, 2, 5, 8):
            for bm in (16, 64):
                bound = block_bound(p, e, bm)
                worst = 0
                g = torch.Generator().manual_seed(p * 100 + e)
                for _ in range(50):
                    counts = torch.bincount(torch.randint(0, e, (p,), generator=g), minlength=e)
                    worst = max(worst, sum(-(-int(c) // bm) for c in counts))
                # one expert with all but n - 1 pairs, the others one each
                n = min(e, p)
                worst = max(worst, -(-(p - n + 1) // bm) + n - 1)
                assert worst <= bound, f"P {p} E {e} BLOCK_M {bm}: {worst} blocks > bound {bound}"
                assert worst == bound, f"P {p} E {e} BLOCK_M {bm}: bound {bound} never reached (max {worst})"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_every_prefix(device, dtype):
    """op(x[:r]) == op(x)[:r] for every r in 1..N: ~18 pairs an expert at N, past an fp32 block."""
    n = 36
    x, ids, weights, w_gate, w_up, w_down = make(n, *ROUTINGS["H21-E6-T3"], dtype, device)
    full = moe_experts(x, ids, weights, w_gate, w_up, w_down)
    assert_close(f"moe_experts {dtype} {n} rows", full.cpu(), moe_experts_ref(*on_cpu(x, ids, weights, w_gate, w_up, w_down)),
                 *TOLERANCE[dtype])
    for r in range(1, n + 1):
        got = moe_experts(x[:r], ids[:r], weights[:r], w_gate, w_up, w_down)
        assert torch.equal(got, full[:r]), f"rows 0..{r} differ from the {n}-row launch"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_permuted_rows_and_ids(device, dtype):
    """Rows in another order (so other block-mates and places in the blocks), and each row's ids
    listed in another order, give each row its bits."""
    x, ids, weights, w_gate, w_up, w_down = make(33, *ROUTINGS["H21-E6-T3"], dtype, device)
    want = moe_experts(x, ids, weights, w_gate, w_up, w_down)
    g = torch.Generator().manual_seed(7)
    rows = torch.randperm(33, generator=g).to(device)
    slots = torch.stack([torch.randperm(ids.shape[1], generator=g) for _ in range(33)]).to(device)
    got = moe_experts(x[rows], ids[rows].gather(1, slots[rows]), weights[rows].gather(1, slots[rows]), w_gate, w_up, w_down)
    assert torch.equal(got, want[rows]), "a row's bits depend on the order of the rows or of its ids"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_row_alone_vs_in_33(device, dtype):
    """Each row of a 33-row launch, launched alone (one pair per expert, every block one row)."""
    x, ids, weights, w_gate, w_up, w_down = make(33, *ROUTINGS["H40-E8-T2"], dtype, device)
    full = moe_experts(x, ids, weights, w_gate, w_up, w_down)
    for r in range(33):
        alone = moe_experts(x[r : r + 1].clone(), ids[r : r + 1].clone(), weights[r : r + 1].clone(), w_gate, w_up, w_down)
        assert torch.equal(alone, full[r : r + 1]), f"row {r} alone differs from itself among 33"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_one_expert_gets_every_row(device, dtype):
    """Every row lists expert 2 (more pairs than two blocks of either dtype, 4 blocks of fp32) and
    expert 3 gets no pair: the result matches the reference and each row alone."""
    n = 2 * block_m(dtype) + 3
    x, _, weights, w_gate, w_up, w_down = make(n, 16, 16, 5, 2, dtype, device)
    others = torch.tensor([0, 4, 1])[torch.arange(n) % 3]  # slot 1 cycles over experts 0, 4, 1
    ids = torch.stack([others, torch.full((n,), 2)], dim=1).to(device)  # [n, 2]: expert 2 second, to be sorted
    full = moe_experts(x, ids, weights, w_gate, w_up, w_down)
    assert_close(f"moe_experts {dtype} one expert", full.cpu(), moe_experts_ref(*on_cpu(x, ids, weights, w_gate, w_up, w_down)),
                 *TOLERANCE[dtype])
    for r in (0, block_m(dtype) - 1, block_m(dtype), n - 1):
        alone = moe_experts(x[r : r + 1].clone(), ids[r : r + 1].clone(), weights[r : r + 1].clone(), w_gate, w_up, w_down)
        assert torch.equal(alone, full[r : r + 1]), f"row {r} alone differs from itself among {n} rows of one expert"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_block_mates_never_leak(device, dtype):
    """Rows sharing a row's experts that hold huge values or NaN (a padding row of the engine may
    hold anything) leave the row's bits alone."""
    x, ids, weights, w_gate, w_up, w_down = make(9, 16, 16, 2, 2, dtype, device)  # E = T = 2: one block per expert, all rows
    want = moe_experts(x[:1], ids[:1], weights[:1], w_gate, w_up, w_down)
    for poison in (float("nan"), 3e38):
        bad = x.clone()
        bad[1:] = poison
        got = moe_experts(bad, ids, weights, w_gate, w_up, w_down)
        assert torch.equal(got[:1], want), f"block-mates holding {poison} changed row 0"


def test_gpu_sizes(device):
    """bf16 at a verify batch's scale (GPU only: too slow for the interpreter): every row count of
    ROW_COUNTS and 576 rows (64 sequences x 9) against the 576-row launch, and rows alone."""
    if device != "cuda":
        pytest.skip("needs a GPU: 576 rows of 8 experts run for minutes under the interpreter")
    x, ids, weights, w_gate, w_up, w_down = make(576, 512, 256, 8, 2, torch.bfloat16, device)
    full = moe_experts(x, ids, weights, w_gate, w_up, w_down)
    assert_close("moe_experts bf16 576 rows", full.cpu(), moe_experts_ref(*on_cpu(x, ids, weights, w_gate, w_up, w_down)),
                 *TOLERANCE[torch.bfloat16])
    for r in (1, 2, 3, 5, 8, 15, 16, 17, 33, 64, 65, 72, 128, 129, 575):
        got = moe_experts(x[:r], ids[:r], weights[:r], w_gate, w_up, w_down)
        assert torch.equal(got, full[:r]), f"rows 0..{r} differ from the 576-row launch"
    for r in (0, 63, 64, 300, 575):
        alone = moe_experts(x[r : r + 1].clone(), ids[r : r + 1].clone(), weights[r : r + 1].clone(), w_gate, w_up, w_down)
        assert torch.equal(alone, full[r : r + 1]), f"row {r} alone differs"


def test_many_experts_take_small_blocks_in_every_dtype():
    """A router of many experts per slot gives each expert few pairs per batch: its blocks are 16
    rows in bf16 too; few experts keep bf16's 64-row blocks. A function of the weights' shapes."""
    from hybrid_kernels.moe_grouped import MANY_EXPERTS_PER_SLOT

    assert grouped_config(2048, 2048, torch.bfloat16, n_experts=8, top_k=2).BLOCK_M == 64
    assert grouped_config(2048, 512, torch.bfloat16, n_experts=256, top_k=8).BLOCK_M == 16
    assert grouped_config(2048, 512, torch.bfloat16, n_experts=MANY_EXPERTS_PER_SLOT * 8 - 1, top_k=8).BLOCK_M == 64
    assert grouped_config(2048, 512, torch.float32, n_experts=8, top_k=2).BLOCK_M == 16


def test_fp8_experts_of_many_take_wider_tiles_and_nothing_else_changes():
    """FP8 weights dequantized in registers take wider tiles and longer K steps where experts are
    many (bench.fp8_configs screened them, bench.fp8_real_size chose); bf16 experts and fp32 keep theirs."""
    fp8 = grouped_config(2048, 512, torch.bfloat16, n_experts=256, top_k=8, fp8=True)
    bf16 = grouped_config(2048, 512, torch.bfloat16, n_experts=256, top_k=8)
    assert (fp8.BLOCK_N, fp8.BLOCK_K, fp8.BLOCK_N2, fp8.BLOCK_K2) == (64, 128, 128, 128)
    assert (bf16.BLOCK_N, bf16.BLOCK_K, bf16.BLOCK_N2, bf16.BLOCK_K2) == (32, 64, 32, 64)
    assert fp8._replace(BLOCK_N=32, BLOCK_K=64, BLOCK_N2=32, BLOCK_K2=64) == bf16
    assert grouped_config(2048, 2048, torch.bfloat16, n_experts=8, top_k=2, fp8=True) == grouped_config(2048, 2048, torch.bfloat16, n_experts=8, top_k=2)
    assert grouped_config(64, 32, torch.float32, n_experts=256, top_k=8, fp8=True) == grouped_config(64, 32, torch.float32, n_experts=256, top_k=8)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_any_row_layout(device, dtype):
    """Stage 1 reads x contiguous and 16-byte aligned (kernels/moe.py copies it otherwise): rows handed
    over strided (a column slice) or one element off the alignment give the bits of the same rows
    contiguous."""
    x, ids, weights, w_gate, w_up, w_down = make(9, *ROUTINGS["H21-E6-T3"], dtype, device)
    want = moe_experts(x, ids, weights, w_gate, w_up, w_down)
    r, h = x.shape
    wide = torch.zeros(r, h + 8, dtype=dtype, device=device)
    wide[:, :h] = x
    off = torch.zeros(r * h + 1, dtype=dtype, device=device)[1:].view(r, h)
    off.copy_(x)
    assert wide[:, :h].stride(0) != h and off.data_ptr() % 16
    for given in (wide[:, :h], off):
        assert torch.equal(moe_experts(given, ids, weights, w_gate, w_up, w_down), want)
