"""kernels/sampling.py: the row argmax equals torch.argmax (ties and NaNs to the first), row by row
and across the chunks of its first stage;
coupled_choice and its counter-based Gumbel noise against the torch reference, and the device path
of coupled sampling (verifier.sampling.choose_rows, keep_threshold) as the engine uses it."""

import pytest
import torch

import hybrid_kernels.sampling
from hybrid_kernels.sampling import (BLOCK_V, CHUNK_V, GAMMA, MIX1, MIX2, U_BITS, argmax_rows, argmax_rows_ref, coupled_choice, cumsum_rows,
                              coupled_choice_ref, gumbel_rows, gumbel_rows_ref)
from verifier.sampling import SamplingParams, choose, choose_rows, keep_threshold, keep_thresholds, masked_logits

from .conftest import ROW_COUNTS, assert_close

VOCABS = [1, 7, BLOCK_V, BLOCK_V + 3, 2 * BLOCK_V + 517]
# g = -log(-log(u)) from two logs of a few ulps each: -log(u) carries a relative error of ~3e-7,
# which the outer log turns into an absolute one, plus an ulp of |g| <= 17 (measured: 5e-7)
G_RTOL, G_ATOL = 1e-6, 2e-6
GAP = 1e-3  # kernel and reference choices must agree wherever the best two scores differ by more
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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


# --- argmax_rows across chunks: stage one's partials and stage two's combine --------------------

@pytest.fixture(params=[256, CHUNK_V], ids=lambda c: f"chunk{c}")
def chunk(request, monkeypatch):
    """The chunk size argmax_rows runs with: the production one (several steps of BLOCK_V per
    chunk), and a small one (one step) so that the interpreter covers many chunks per row."""
    monkeypatch.setattr(hybrid_kernels.sampling, "CHUNK_V", request.param)
    return request.param


def _assert_argmax(logits: torch.Tensor, want: list[int] | None = None) -> None:
    """argmax_rows equals torch.argmax (and `want`, where given), every row of out written."""
    out = torch.full((logits.shape[0],), -1, dtype=torch.int64, device=logits.device)
    got, ref = argmax_rows(logits, out=out).tolist(), torch.argmax(logits, dim=-1).tolist()
    bad = [(r, g, w) for r, (g, w) in enumerate(zip(got, ref)) if g != w]
    assert not bad, f"(row, got, torch.argmax) for {len(bad)} rows: {bad[:8]}"
    if want is not None:
        assert got == want


def test_ties_straddling_chunks_go_to_the_lowest_id(device, chunk):
    vocab = 3 * chunk + 5
    logits = torch.randn(6, vocab, device=device)
    logits[0, [chunk - 1, chunk]] = 9.0  # the last id of chunk 0 against the first of chunk 1
    logits[1, [chunk + 3, 2 * chunk + 1, vocab - 1]] = 9.0  # nothing in chunk 0; chunk 1 wins
    logits[2, [5, chunk + 2]] = float("inf")  # +inf in two chunks, a lower lane in the later one
    logits[3, [2 * chunk + 7, 3 * chunk]] = 9.0  # chunks 2 and 3 (the partial one)
    logits[4] = 1.0  # one value everywhere: every chunk ties
    logits[5, [chunk + 1, 3 * chunk + 2]] = 9.0
    logits[5, 3 * chunk + 4] = 9.5  # a strictly larger value after the ties, in the last chunk
    _assert_argmax(logits, [chunk - 1, chunk + 3, 5, 2 * chunk + 7, 0, 3 * chunk + 4])


def test_maximum_in_the_last_partial_chunk(device, chunk):
    vocab = 2 * chunk + 3  # the last chunk holds 3 ids
    logits = torch.randn(3, vocab, device=device)
    logits[0, vocab - 1] = 10.0
    logits[1, 2 * chunk] = 10.0
    logits[2, vocab - 1] = float("inf")
    _assert_argmax(logits, [vocab - 1, 2 * chunk, vocab - 1])


def test_nan_across_chunks(device, chunk):
    """NaN beats every number, +inf included, whichever chunk holds them; the first NaN wins."""
    vocab = 4 * chunk + 9
    logits = torch.randn(5, vocab, device=device)
    logits[0, 3] = float("inf")
    logits[0, 2 * chunk + 5] = float("nan")  # a later chunk's NaN against an earlier +inf
    logits[1, [chunk + 8, 3 * chunk + 1]] = float("nan")  # NaN in two chunks: the first
    logits[2, [3 * chunk + 2, 2 * chunk + 9, 2 * chunk + 4]] = float("nan")  # a chunk's lowest, not its lane's
    logits[3, vocab - 1] = float("nan")  # in the last partial chunk
    logits[3, 0] = float("inf")
    logits[4] = float("nan")  # every chunk NaN
    _assert_argmax(logits, [2 * chunk + 5, chunk + 8, 2 * chunk + 4, vocab - 1, 0])


def test_all_minus_inf_rows(device, chunk):
    """Rows of -inf answer 0 (torch.argmax's answer), however many chunks; -inf and NaN: the NaN."""
    vocab = 3 * chunk + 11
    logits = torch.full((4, vocab), float("-inf"), device=device)
    logits[1, 2 * chunk + 3] = -1e30  # the one number, in a later chunk
    logits[2, 3 * chunk + 10] = float("nan")
    logits[3, chunk] = torch.finfo(torch.float32).min
    _assert_argmax(logits, [0, 2 * chunk + 3, 3 * chunk + 10, chunk])
    _assert_argmax(logits[:1, : chunk + 1], [0])  # one id in the second chunk


@pytest.mark.parametrize("span", ["1", "7", "chunk-1", "chunk", "chunk+1", "2chunk+129"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vocab_sizes_against_torch(device, chunk, span, dtype):
    """Random rows at vocabularies below, at and past a chunk (the last chunk partial or whole),
    with planted ties, +-inf and NaNs, against torch.argmax."""
    vocab = {"1": 1, "7": 7, "chunk-1": chunk - 1, "chunk": chunk, "chunk+1": chunk + 1, "2chunk+129": 2 * chunk + 129}[span]
    gen = torch.Generator().manual_seed(vocab)
    # small integers: each row's maximum recurs, usually in several chunks
    logits = torch.randint(-40, 6, (8, vocab), generator=gen).float()
    logits[1] = torch.randn(vocab, generator=gen)
    specials = torch.rand(8, vocab, generator=gen)
    logits[4:6] = torch.where(specials[4:6] < 0.002, float("inf"), logits[4:6])
    logits[6:8] = torch.where(specials[6:8] < 0.001, float("nan"), logits[6:8])
    logits[7] = torch.where(specials[7] < 0.5, float("-inf"), logits[7])
    logits = logits.to(dtype).to(device)
    _assert_argmax(logits)
    assert torch.equal(argmax_rows(logits), argmax_rows_ref(logits))


def test_row_invariant_across_chunks(device, monkeypatch):
    """Several chunks per row: each row's answer alone, in batches of every size, and strided."""
    monkeypatch.setattr(hybrid_kernels.sampling, "CHUNK_V", 128)
    vocab = 2 * 128 + 17
    gen = torch.Generator().manual_seed(1)
    big = torch.randint(-20, 3, (64, vocab + 8), generator=gen).float().to(device)
    logits = big[:, :vocab]  # rows strided past the vocabulary
    full = argmax_rows(logits)  # ROW_COUNTS' largest, 64
    assert torch.equal(full, argmax_rows_ref(logits))
    for n in [n for n in ROW_COUNTS if n < 64]:
        assert torch.equal(argmax_rows(logits[:n]), full[:n]), n
    assert torch.equal(argmax_rows(logits[63:]), full[63:])  # the last row alone


def test_chunk_must_be_a_power_of_two(device, monkeypatch):
    monkeypatch.setattr(hybrid_kernels.sampling, "CHUNK_V", 3000)
    with pytest.raises(ValueError, match="power of two"):
        argmax_rows(torch.randn(2, 50, device=device))


# --- coupled sampling: the noise ---------------------------------------------------------------

def _splitmix64(x: int) -> int:
    mask = (1 << 64) - 1
    x = (x + GAMMA) & mask
    x = ((x ^ (x >> 30)) * MIX1) & mask
    x = ((x ^ (x >> 27)) * MIX2) & mask
    return x ^ (x >> 31)


def _keys(seeds: list[int], positions: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """uint64 seeds as the int64 tensors the kernels take."""
    signed = [s - (1 << 64) if s >= 1 << 63 else s for s in seeds]
    return torch.tensor(signed, dtype=torch.int64, device=device), torch.tensor(positions, dtype=torch.int64, device=device)


SEEDS = [0, 1, 2**63, 2**64 - 1, 12345, 7]
POSITIONS = [0, 7, 2**40, 3, 99, 8]


def test_hash_is_splitmix64_with_exact_uniforms():
    """The reference's int64 hash is splitmix64 in uint64 (computed here with Python integers)."""
    vocab = 300
    seeds, positions = _keys(SEEDS, POSITIONS, "cpu")
    u, g = gumbel_rows_ref(seeds, positions, vocab)
    want = [[((_splitmix64(_splitmix64(_splitmix64(s) ^ p) + i * GAMMA & (1 << 64) - 1) >> (64 - U_BITS)) + 0.5) * 2.0 ** -U_BITS
             for i in range(vocab)] for s, p in zip(SEEDS, POSITIONS)]
    assert torch.equal(u.double(), torch.tensor(want, dtype=torch.float64))  # fp32 holds every u exactly
    assert 2.0 ** -(U_BITS + 1) <= float(u.min()) and float(u.max()) <= 1 - 2.0 ** -(U_BITS + 1)
    assert torch.isfinite(g).all()
    extremes = torch.tensor([2.0 ** -(U_BITS + 1), 1 - 2.0 ** -(U_BITS + 1)])  # the noise's whole range
    assert torch.isfinite(-torch.log(-torch.log(extremes))).all()


@pytest.mark.parametrize("vocab", [1, 7, BLOCK_V + 3])
def test_noise_kernel_equals_reference(device, vocab):
    seeds, positions = _keys(SEEDS, POSITIONS, device)
    u, g = gumbel_rows(seeds, positions, vocab)
    u_ref, g_ref = gumbel_rows_ref(seeds, positions, vocab)
    assert torch.equal(u, u_ref)  # the hash and the conversion to u are exact on both
    assert_close("g", g, g_ref, rtol=G_RTOL, atol=G_ATOL)


def test_noise_is_uniform_and_uncorrelated():
    """Chi-square of u over 64 bins, along ids, positions and seeds; neighbours uncorrelated.

    262144 draws per check: chi-square with 63 degrees of freedom has mean 63 and sd 11.2 (bound:
    mean + 6 sd); a correlation estimate has sd 0.002 (bound: 5 sd)."""
    def chi_square(u: torch.Tensor, bins: int = 64) -> float:
        counts = torch.bincount((u.flatten() * bins).long(), minlength=bins).double()
        expected = u.numel() / bins
        return float(((counts - expected) ** 2 / expected).sum())

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.corrcoef(torch.stack([a.flatten().double(), b.flatten().double()]))[0, 1])

    by_id = gumbel_rows_ref(*_keys([5] * 64, list(range(64)), "cpu"), 4096)[0]  # [positions, ids]
    by_seed = gumbel_rows_ref(*_keys(list(range(4096)), [3] * 4096, "cpu"), 64)[0]  # [seeds, ids]
    big_seeds = gumbel_rows_ref(*_keys([2**63 + s for s in range(4096)], [2**33] * 4096, "cpu"), 64)[0]
    for name, u in [("ids x positions", by_id), ("seeds x ids", by_seed), ("large seeds", big_seeds)]:
        assert chi_square(u) < 63 + 6 * 11.2, name
        assert abs(float(u.mean()) - 0.5) < 5 * (1 / 12 / u.numel()) ** 0.5, name
    assert abs(corr(by_id[:, :-1], by_id[:, 1:])) < 0.01  # adjacent ids
    assert abs(corr(by_id[:-1], by_id[1:])) < 0.01  # adjacent positions
    assert abs(corr(by_seed[:-1], by_seed[1:])) < 0.01  # adjacent seeds


# --- coupled sampling: the choice --------------------------------------------------------------

def _inputs(rows: int, vocab: int, device, seed: int, dtype=torch.float32, with_threshold=True):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    temperature = 0.3 + 1.5 * torch.rand(rows, generator=gen)
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    threshold = None
    if with_threshold:  # each row keeps its top 1 .. vocab scaled logits
        scaled = logits.float() / temperature[:, None]
        keep = torch.randint(1, vocab + 1, (rows,), generator=gen)
        threshold = torch.stack([torch.sort(scaled[r], descending=True).values[keep[r] - 1] for r in range(rows)])
        threshold = threshold.to(device)
    return logits.to(device), temperature.to(device), seeds.to(device), positions.to(device), threshold


def _scores(logits, temperature, seeds, positions, threshold):
    """The reference's per-id scores [R, V] (masked ids -inf)."""
    scaled = logits.float() / temperature[:, None]
    g = gumbel_rows_ref(seeds, positions, logits.shape[1])[1]
    cut = threshold[:, None] if threshold is not None else float("-inf")
    return torch.where(scaled >= cut, scaled + g, float("-inf"))


@pytest.mark.parametrize("with_threshold", [False, True], ids=["all-kept", "top-k-top-p"])
@pytest.mark.parametrize("vocab,dtype", [(7, torch.float32), (BLOCK_V + 37, torch.float32), (BLOCK_V + 37, torch.bfloat16)],
                         ids=["v7", "v1061", "v1061-bf16"])
def test_choice_equals_reference(device, vocab, dtype, with_threshold):
    args = _inputs(48, vocab, device, seed=vocab, dtype=dtype, with_threshold=with_threshold)
    got, want = coupled_choice(*args), coupled_choice_ref(*args)
    top2 = torch.topk(_scores(*args), min(2, vocab), dim=-1).values
    clear = top2[:, 0] - top2[:, -1] > GAP if vocab > 1 else torch.ones(48, dtype=torch.bool)
    clear |= torch.isinf(top2[:, -1])  # one kept id: nothing to be close to
    assert int(clear.sum()) >= 40, "too few rows with a clear winner: the check would be vacuous"
    assert torch.equal(got[clear], want[clear])


def test_choice_row_invariant_and_strided(device):
    big = torch.randn(64, BLOCK_V + 3 + 5, device=device)
    logits = big[:, : BLOCK_V + 3]  # rows strided past the vocabulary
    _, temperature, seeds, positions, threshold = _inputs(64, BLOCK_V + 3, device, seed=1)
    threshold = torch.where(torch.arange(64, device=device) % 3 == 0, float("-inf"), threshold)
    full = coupled_choice(logits, temperature, seeds, positions, threshold)
    for n in ROW_COUNTS:
        part = torch.full((n,), -1, dtype=torch.int64, device=device)
        coupled_choice(logits[:n], temperature[:n], seeds[:n], positions[:n], threshold[:n], out=part)
        assert torch.equal(part, full[:n]), n
    # a row alone, at the end of the launch: the same choice (nothing but its own inputs reaches it)
    last = slice(63, 64)
    assert torch.equal(coupled_choice(logits[last], temperature[last], seeds[last], positions[last], threshold[last]), full[last])


def test_choice_ties_to_the_lowest_id(device):
    """Equal scores (+inf logits) across lanes and blocks go to the lowest id; a row with nothing
    but -inf scores answers id 0, as torch.argmax does."""
    vocab = 2 * BLOCK_V + 7
    logits = torch.randn(4, vocab, device=device)
    logits[0, [BLOCK_V + 5, 7]] = float("inf")  # id 7 in block 0 against a lower lane in block 1
    logits[1, [BLOCK_V + 2, 2 * BLOCK_V + 1]] = float("inf")  # both past block 0
    logits[2, [9, 3]] = float("inf")  # one block, two lanes
    logits[3] = float("-inf")
    temperature = torch.full((4,), 0.7, device=device)
    seeds, positions = _keys([1, 2, 3, 4], [5, 6, 7, 8], device)
    want = [7, BLOCK_V + 2, 3, 0]
    assert coupled_choice(logits, temperature, seeds, positions).tolist() == want
    assert coupled_choice_ref(logits, temperature, seeds, positions).tolist() == want


def test_masked_ids_never_chosen(device):
    """Flat logits: the noise alone picks outside the top 3 most of the time; the threshold stops it."""
    rows, vocab = 64, 50
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(vocab, generator=gen) * 0.1).expand(rows, vocab).contiguous().to(device)
    temperature = torch.ones(rows, device=device)
    seeds, positions = _keys(list(range(rows)), [11] * rows, device)
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    threshold = torch.topk(logits[0], 3).values[-1].expand(rows).contiguous()
    free = coupled_choice(logits, temperature, seeds, positions).tolist()
    assert sum(c not in top3 for c in free) > rows // 2  # without the mask the check could fail
    masked = coupled_choice(logits, temperature, seeds, positions, threshold)
    assert set(masked.tolist()) <= top3 and len(set(masked.tolist())) == 3
    assert torch.equal(masked, coupled_choice_ref(logits, temperature, seeds, positions, threshold))


def test_choice_checks(device):
    logits, temperature, seeds, positions, _ = _inputs(3, 20, device, seed=0, with_threshold=False)
    with pytest.raises(ValueError, match="temperature"):
        coupled_choice(logits, temperature.double(), seeds, positions)
    with pytest.raises(ValueError, match="seeds"):
        coupled_choice(logits, temperature, seeds[:2], positions)
    with pytest.raises(ValueError, match="positions"):
        coupled_choice(logits, temperature, seeds, positions.int())
    with pytest.raises(ValueError, match="keep_threshold"):
        coupled_choice(logits, temperature, seeds, positions, torch.zeros(3, 1, device=device))
    with pytest.raises(ValueError, match="rows, vocab"):
        coupled_choice(logits[0], temperature, seeds, positions)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=3, top_p=0.9)],
                         ids=["t0.8", "t1.2-topk3-topp0.9"])
def test_choices_follow_the_target_distribution(params):
    """Over 20000 seeds (reference) the choice frequencies match softmax(masked logits / T): total
    variation under 0.02 (sampling noise at this n: ~0.006 for 6 outcomes); so do 20000 positions
    of one seed. The kernel agrees with the reference on these rows (all of them on a GPU)."""
    vocab, n = 6, 20000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 1.5
    target = torch.softmax(masked_logits(row, params), dim=-1)
    logits = row.expand(n, vocab).contiguous()
    temperature = torch.full((n,), params.temperature)
    threshold = keep_threshold(row / temperature[0], params).expand(n).contiguous()
    for seeds, positions in [_keys(list(range(n)), [17] * n, "cpu"), _keys([99] * n, list(range(n)), "cpu")]:
        chosen = coupled_choice_ref(logits, temperature, seeds, positions, threshold)
        freq = torch.bincount(chosen, minlength=vocab).float() / n
        tv = 0.5 * float((freq - target).abs().sum())
        assert tv < 0.02, f"choices are {tv:.4f} (TV) from the target"
        assert float(freq[target == 0].sum()) == 0.0  # masked ids never chosen
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = n if device == "cuda" else 256  # the interpreter walks 1024 lanes per row: a sample of rows
    args = (logits[:m].to(device), temperature[:m].to(device), seeds[:m].to(device), positions[:m].to(device), threshold[:m].to(device))
    assert torch.equal(coupled_choice(*args).cpu(), coupled_choice_ref(*args).cpu())


# --- the device path in verifier.sampling ------------------------------------------------------

MASKS = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.5, top_p=0.7),
         SamplingParams(temperature=1.25, top_k=9, top_p=0.5), SamplingParams(temperature=2.0, top_p=0.999),
         SamplingParams(temperature=1.0, top_k=40)]


@pytest.mark.parametrize("params", MASKS, ids=["k5", "p0.7", "k9-p0.5", "p0.999", "k-off"])
def test_keep_threshold_keeps_what_masked_logits_keeps(params):
    """Distinct logits (no ties at the cut) and temperatures exact in fp32: the device threshold
    keeps exactly the ids the host's masks keep."""
    for seed in range(8):
        row = torch.randn(40, generator=torch.Generator().manual_seed(seed)) * 2
        scaled = row / torch.tensor(params.temperature, dtype=torch.float32)
        kept = scaled >= keep_threshold(scaled, params)
        assert torch.equal(kept, torch.isfinite(masked_logits(row, params))), seed


def test_choose_rows_is_row_local():
    """A row's choice (its threshold included) is the same alone and among rows with other
    parameters: the device path's row invariance, on the reference here and the kernel on a GPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = (torch.randn(6, 300, generator=torch.Generator().manual_seed(2)) * 2).to(device)
    params = [MASKS[i % len(MASKS)] for i in range(5)] + [SamplingParams(temperature=0.7, seed=2**64 - 1)]
    positions = [10, 11, 12, 40, 41, 3]
    together = choose_rows(logits, params, positions).tolist()
    alone = [int(choose_rows(logits[r : r + 1], params[r : r + 1], positions[r : r + 1])[0]) for r in range(6)]
    assert together == alone
    with pytest.raises(ValueError, match="greedy"):
        choose_rows(logits[:1], [SamplingParams()], [0])


def test_cpu_choose_keeps_its_bits():
    """The CPU backend's coupled sampling is unchanged by the device path: these ids were drawn by
    the CPU choose before it existed (torch.Generator noise, masked_logits)."""
    rows = torch.randn(6, 97, generator=torch.Generator().manual_seed(11)) * 2
    expected = {
        SamplingParams(temperature=0.9, seed=42): [44, 30, 54, 56, 1, 72],
        SamplingParams(temperature=1.3, top_k=7, top_p=0.8, seed=7): [44, 34, 20, 92, 72, 81],
        SamplingParams(temperature=0.5, top_p=0.6, seed=2**64 - 1): [10, 7, 20, 11, 94, 72],
    }
    for params, ids in expected.items():
        assert [choose(row, params, 10 + i) for i, row in enumerate(rows)] == ids, params


@gpu
def test_cuda_choose_uses_the_device_path(monkeypatch):
    row = torch.randn(500, device="cuda")
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=3)
    want = int(choose_rows(row[None], [params], [12])[0])
    monkeypatch.setattr("verifier.sampling.masked_logits", lambda *a: pytest.fail("CUDA logits reached the host masks"))
    assert choose(row, params, 12) == want


@gpu
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, seed=42), SamplingParams(temperature=1.3, top_k=7, top_p=0.8, seed=7)],
                         ids=["t0.9", "t1.3-topk-topp"])
def test_engine_samples_on_the_device(hf_checkpoint, monkeypatch, params):
    """On CUDA the engine's coupled sampling never copies rows to the host for choosing, and a
    speculative stream equals the plain one."""
    from verifier.proposers import OracleProposer, RandomProposer
    from verifier.engine import Engine
    from verifier.generate import generate
    from verifier.model import load_model

    model = load_model(hf_checkpoint("qwen3_5_text"), "cuda")
    monkeypatch.setattr("verifier.sampling.masked_logits", lambda *a: pytest.fail("a row reached the host masks"))
    monkeypatch.setattr("verifier.acceptance.choose", lambda *a: pytest.fail("a row was chosen on the host"))
    engine = Engine(model, 2, 96, max_k=6)
    prompt = torch.randint(3, model.config.vocab_size, (8,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = generate(engine, prompt, 24, params, eos_ids=())
    for proposer in (RandomProposer(model.config.vocab_size, seed=3), OracleProposer(len(prompt), plain.tokens)):
        spec = generate(engine, prompt, 24, params, proposer, 5, eos_ids=())
        assert spec.tokens == plain.tokens
        assert torch.equal(spec.logits, plain.logits)


def test_keep_thresholds_of_a_batch_equal_each_row_alone():
    """The engine thresholds every sampled row of a step at once: each row's threshold is the one it
    gets alone, bitwise, whatever rows share the batch (CPU here, the CUDA ops on a GPU), at a
    vocabulary the size of the published checkpoints' too."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = MASKS + [SamplingParams(temperature=0.9), SamplingParams(temperature=1.1, top_k=1),
                      SamplingParams(temperature=0.6, top_k=2000, top_p=0.95)]
    for vocab in (300, 151936):
        gen = torch.Generator().manual_seed(vocab)
        scaled = (torch.randn(len(params) * 3, vocab, generator=gen) * 3).to(device)
        batch_params = [params[r % len(params)] for r in range(scaled.shape[0])]
        together = keep_thresholds(scaled, batch_params)
        for r in range(scaled.shape[0]):
            alone = keep_thresholds(scaled[r : r + 1], batch_params[r : r + 1])[0]
            assert torch.equal(together[r], alone), (vocab, r, batch_params[r])
            assert torch.equal(alone, keep_threshold(scaled[r], batch_params[r]))
        for size in (2, 5, 17):  # sub-batches at other offsets and sizes
            part = keep_thresholds(scaled[1 : 1 + size], batch_params[1 : 1 + size])
            assert torch.equal(part, together[1 : 1 + size]), (vocab, size)


def test_cumsum_rows_is_a_running_sum_and_row_invariant():
    """hybrid_kernels.sampling.cumsum_rows (top-p's running sum on the device) against torch.cumsum within
    fp32 rounding (another association: a block scan and a carry), across several blocks of the walk;
    and each row's sums bitwise the same alone, in a batch, and at another offset."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = 2 * BLOCK_V + 37 if device == "cpu" else 151936
    probs = torch.softmax(torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 3, dim=-1).to(device)
    sums = cumsum_rows(probs)
    assert torch.allclose(sums.cpu(), torch.cumsum(probs.cpu().double(), dim=-1).float(), rtol=1e-5, atol=1e-6)
    for r in range(6):
        assert torch.equal(cumsum_rows(probs[r : r + 1].clone())[0], sums[r])
    assert torch.equal(cumsum_rows(probs[1:4]), sums[1:4])
    with pytest.raises(ValueError, match="cumsum_rows"):
        cumsum_rows(probs.double())
