"""attend_rows: the Triton kernel against its torch reference, row invariance, decode vs verify.
attend_prefill (prefill's tiles of rows): against the reference, and each row's bits its own
whatever tile, batch or chunk split it sits in."""

import pytest
import torch

from hybrid_kernels.attention import BLOCK_N, attend_prefill, attend_rows, attend_rows_ref, prefill_tile_rows
from hybrid_kernels.delta_rule_chunked import chunk_table

from .conftest import ROW_COUNTS, assert_close, nan_like

# (HQ, HKV, D_K, D_V): GQA, MLA-like (one kv head per query head, D_K != D_V, neither a power of 2), MHA
SHAPES = {"gqa": (6, 2, 12, 12), "mla": (3, 3, 14, 10), "mha": (2, 2, 7, 7)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The kernel and the reference differ only in association (online rescaling by exp(m_old - m_new),
# dot order, normalising after the value product instead of before). Each output is a convex
# combination of <= 150 values with |v| < 5, so fp32 rounding walks stay ~sqrt(L) eps |v| ~ 1e-6
# (observed max 4.2e-7 over 6 seeds); a logic error (a position off by one, a wrong head, the scale)
# moves outputs by > 1e-2. bf16: the reference rounds scores to bf16 (|s| < 5: up to 1e-2 absolute)
# where the kernel keeps them fp32; both round probabilities to bf16 before the value product (the
# kernel's are unnormalised, the reference's normalised) and the output at the end; observed max
# 1.6e-2, one bf16 ulp of an output in [2, 4). The bound allows ~2.5x that.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 4e-2)}  # (rtol, atol)
LENGTH = 150  # KV positions per slot: rows cross several BLOCK_N = 64 blocks
N_SLOTS = 4


def make_cache(shape, dtype, device, max_positions, seed=0, fill=float("nan")):
    """keys, values [N_SLOTS, LENGTH, HKV, D] random up to max_positions[slot], `fill` beyond (unused slots all `fill`)."""
    _, kv_heads, d_k, d_v = shape
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(N_SLOTS, LENGTH, kv_heads, d_k, generator=g)
    values = torch.randn(N_SLOTS, LENGTH, kv_heads, d_v, generator=g)
    for slot in range(N_SLOTS):
        seen = max_positions.get(slot, -1) + 1
        keys[slot, seen:] = fill
        values[slot, seen:] = fill
    return keys.to(dtype=dtype, device=device), values.to(dtype=dtype, device=device)


def make_rows(shape, dtype, device, slots, positions, seed=0):
    """query [R, HQ, D_K], the cache (NaN past every row), row_slots and row_positions int32 [R]."""
    n_heads, _, d_k, _ = shape
    max_positions = {}
    for s, p in zip(slots, positions):
        max_positions[s] = max(p, max_positions.get(s, -1))
    keys, values = make_cache(shape, dtype, device, max_positions, seed)
    g = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(len(slots), n_heads, d_k, generator=g).to(dtype=dtype, device=device)
    row_slots = torch.tensor(slots, dtype=torch.int32, device=device)
    row_positions = torch.tensor(positions, dtype=torch.int32, device=device)
    return query, keys, values, row_slots, row_positions


def scale_of(shape):
    return shape[2] ** -0.5


def launch(query, keys, values, row_slots, row_positions, scale):
    """attend_rows into a NaN-poisoned output; every element must be written."""
    out = nan_like(torch.empty(query.shape[0], query.shape[1], values.shape[-1], dtype=query.dtype, device=query.device))
    got = attend_rows(query, keys, values, row_slots, row_positions, scale, out=out)
    assert got is out
    assert not torch.isnan(got).any(), "attend_rows left NaN in out (an unwritten row, or masked KV leaked)"
    return got


# Rows of several slots at positions around every block boundary, in one launch.
MIXED_SLOTS = [0, 1, 2, 0, 1, 2, 0, 1, 3, 3]
MIXED_POSITIONS = [0, 1, BLOCK_N - 1, BLOCK_N, BLOCK_N + 1, 2 * BLOCK_N - 1, 2 * BLOCK_N, LENGTH - 1, 5, 6]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_reference(device, shape, dtype):
    query, keys, values, row_slots, row_positions = make_rows(shape, dtype, device, MIXED_SLOTS, MIXED_POSITIONS)
    got = launch(query, keys, values, row_slots, row_positions, scale_of(shape))
    want = attend_rows_ref(query, keys, values, row_slots, row_positions, scale_of(shape))
    rtol, atol = TOLERANCE[dtype]
    assert_close("attend_rows out", got, want, rtol, atol)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_output_gate(device, dtype):
    """out * sigmoid(gate) in the same launch, the gate a strided view (the projection's gate
    columns): against the reference, and the ungated output times the gate as torch computes it."""
    shape = SHAPES["gqa"]
    query, keys, values, row_slots, row_positions = make_rows(shape, dtype, device, MIXED_SLOTS, MIXED_POSITIONS)
    n, heads, d_v = query.shape[0], shape[0], shape[3]
    g = torch.Generator().manual_seed(9)
    projection = (3.0 * torch.randn(n, heads, 2 * d_v, generator=g)).to(dtype=dtype, device=device)
    gate = projection[..., d_v:]  # strided rows and heads, contiguous last dim
    got = attend_rows(query, keys, values, row_slots, row_positions, scale_of(shape), gate=gate)
    want = attend_rows_ref(query, keys, values, row_slots, row_positions, scale_of(shape), gate=gate)
    rtol, atol = TOLERANCE[dtype]
    assert_close("gated attend_rows out", got, want, rtol, atol)
    plain = launch(query, keys, values, row_slots, row_positions, scale_of(shape))
    # bf16: the product's rounding, and the ungated output's cast (the interpreter truncates it)
    assert_close("gated vs plain * sigmoid", got, plain * torch.sigmoid(gate), 2.0**-6 if dtype == torch.bfloat16 else 1e-6, 1e-6)
    for r in (0, n // 2, n - 1):  # row invariance of the gated output: a row alone gets its bits in the batch
        alone = attend_rows(query[r : r + 1], keys, values, row_slots[r : r + 1], row_positions[r : r + 1], scale_of(shape),
                            gate=gate[r : r + 1])
        assert torch.equal(alone[0], got[r]), f"row {r}'s gated output differs alone"
    with pytest.raises(ValueError, match="gate must be"):
        attend_rows(query, keys, values, row_slots, row_positions, scale_of(shape), gate=gate[:-1])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_int64_indices_give_the_int32_bits(device, dtype):
    """A step's own int64 row_slots / positions (no cast launched) walk the same positions."""
    shape = next(iter(SHAPES.values()))
    query, keys, values, row_slots, row_positions = make_rows(shape, dtype, device, MIXED_SLOTS, MIXED_POSITIONS)
    narrow = launch(query, keys, values, row_slots, row_positions, scale_of(shape))
    assert torch.equal(launch(query, keys, values, row_slots.long(), row_positions.long(), scale_of(shape)), narrow)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_row_invariance(device, dtype):
    """attend_rows(rows[:r]) == attend_rows(rows)[:r] bit for bit, for every row count."""
    shape = (2, 1, 5, 3)
    n = max(ROW_COUNTS)
    g = torch.Generator().manual_seed(3)
    slots = torch.randint(0, N_SLOTS, (n,), generator=g).tolist()
    positions = torch.randint(0, LENGTH, (n,), generator=g).tolist()
    query, keys, values, row_slots, row_positions = make_rows(shape, dtype, device, slots, positions)
    full = launch(query, keys, values, row_slots, row_positions, scale_of(shape))
    for r in ROW_COUNTS:
        part = launch(query[:r], keys, values, row_slots[:r], row_positions[:r], scale_of(shape))
        assert torch.equal(part, full[:r]), f"rows {r}: differs from the first {r} rows of a {n}-row launch"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", [SHAPES["gqa"], SHAPES["mla"]], ids=["gqa", "mla"])
def test_verify_equals_decode(device, shape, dtype):
    """K verify rows of a sequence at p .. p+K-1 (next to another sequence's rows) == K one-row decodes."""
    k, start = 5, BLOCK_N - 2  # the rows cross a block boundary
    slots = [2] * k + [0, 0]
    positions = list(range(start, start + k)) + [10, 11]
    query, keys, values, row_slots, row_positions = make_rows(shape, dtype, device, slots, positions)
    verify = launch(query, keys, values, row_slots, row_positions, scale_of(shape))
    for i in range(k):
        decode = launch(query[i : i + 1], keys, values, row_slots[i : i + 1], row_positions[i : i + 1], scale_of(shape))
        assert torch.equal(decode, verify[i : i + 1]), f"verify row {i} (position {start + i}) != its one-row decode"


@pytest.mark.parametrize("fill", [float("inf"), -1e30, 0.0], ids=["inf", "huge", "zero"])
def test_hidden_positions_never_read(device, fill):
    """Whatever sits past a row's position (NaN in the other tests) leaves its output bit-identical."""
    shape, dtype = SHAPES["gqa"], torch.float32
    query, keys, values, row_slots, row_positions = make_rows(shape, dtype, device, MIXED_SLOTS, MIXED_POSITIONS)
    max_positions = {}
    for s, p in zip(MIXED_SLOTS, MIXED_POSITIONS):
        max_positions[s] = max(p, max_positions.get(s, -1))
    other_keys, other_values = make_cache(shape, dtype, device, max_positions, fill=fill)
    nan_out = launch(query, keys, values, row_slots, row_positions, scale_of(shape))
    other_out = launch(query, other_keys, other_values, row_slots, row_positions, scale_of(shape))
    assert torch.equal(nan_out, other_out)


def test_strided_inputs(device):
    """A query sliced from [query | gate] and a cache sliced from a larger buffer: same bits as contiguous copies."""
    shape, dtype = SHAPES["mla"], torch.float32
    n_heads, kv_heads, d_k, d_v = shape
    query, keys, values, row_slots, row_positions = make_rows(shape, dtype, device, MIXED_SLOTS, MIXED_POSITIONS)
    query_and_gate = torch.cat((query, torch.randn_like(query)), dim=-1)
    big_keys = torch.zeros(N_SLOTS + 1, LENGTH + 3, kv_heads + 1, d_k, dtype=dtype, device=device)
    big_values = torch.zeros(N_SLOTS + 1, LENGTH + 3, kv_heads + 1, d_v, dtype=dtype, device=device)
    big_keys[1:, :LENGTH, 1:] = keys
    big_values[1:, :LENGTH, 1:] = values
    strided = launch(query_and_gate[..., :d_k], big_keys[1:, :LENGTH, 1:], big_values[1:, :LENGTH, 1:], row_slots,
                     row_positions, scale_of(shape))
    assert torch.equal(strided, launch(query, keys, values, row_slots, row_positions, scale_of(shape)))


def test_one_row_with_odd_row_stride(device):
    """torch calls a [1, HQ, D] tensor contiguous whatever its row stride: the result must not change."""
    shape = SHAPES["gqa"]
    n_heads, _, d_k, d_v = shape
    query, keys, values, row_slots, row_positions = make_rows(shape, torch.float32, device, MIXED_SLOTS, MIXED_POSITIONS)
    full = launch(query, keys, values, row_slots, row_positions, scale_of(shape))
    odd_query = query[:1].as_strided((1, n_heads, d_k), (1, d_k, 1))
    odd_out = nan_like(full[:1]).as_strided((1, n_heads, d_v), (1, d_v, 1))
    attend_rows(odd_query, keys, values, row_slots[:1], row_positions[:1], scale_of(shape), out=odd_out)
    assert torch.equal(odd_out, full[:1])


def test_no_rows(device):
    shape = SHAPES["mla"]
    query, keys, values, row_slots, row_positions = make_rows(shape, torch.float32, device, [0], [3])
    out = attend_rows(query[:0], keys, values, row_slots[:0], row_positions[:0], scale_of(shape))
    assert out.shape == (0, shape[0], shape[3])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_reference_is_the_cpu_backend(shape, dtype):
    """attend_rows_ref computes exactly what the reference backend's row-invariant attend computes."""
    from verifier.model.layers.attend import attend
    from verifier.model.rows import RowBatch
    from verifier.model.state import AttentionState

    batch = RowBatch(slots=(2, 0, 3), starts=(BLOCK_N - 2, 0, 100), counts=(4, 3, 2))
    slots = [s for s, c in zip(batch.slots, batch.counts) for _ in range(c)]
    positions = [p + r for p, c in zip(batch.starts, batch.counts) for r in range(c)]
    query, keys, values, row_slots, row_positions = make_rows(shape, dtype, "cpu", slots, positions)
    want = attend(batch, AttentionState(keys, values), query, scale_of(shape), row_invariant=True)
    assert torch.equal(attend_rows_ref(query, keys, values, row_slots, row_positions, scale_of(shape)), want)


def _bad(name):
    """A (mutation of the valid arguments, expected message) case for the launcher's checks."""
    cases = {
        "query_dim": (lambda a: a.update(query=a["query"][0]), "query must be"),
        "query_fp16": (lambda a: a.update(query=a["query"].half()), "query dtype"),
        "keys_dtype": (lambda a: a.update(keys=a["keys"].double()), "keys dtype"),
        "values_dtype": (lambda a: a.update(values=a["values"].to(torch.bfloat16)), "values dtype"),
        "keys_d_k": (lambda a: a.update(keys=a["keys"][..., :-1]), "keys d_k"),
        "values_length": (lambda a: a.update(values=a["values"][:, :-1]), "values shape"),
        "heads": (lambda a: a.update(query=a["query"][:, :-1]), "not a multiple of keys kv_heads"),
        "keys_stride": (lambda a: a.update(keys=a["keys"].transpose(0, 3).contiguous().transpose(0, 3)), "keys must be contiguous"),
        "query_stride": (lambda a: a.update(query=a["query"].transpose(1, 2).contiguous().transpose(1, 2)), "query must be contiguous"),
        "slots_int16": (lambda a: a.update(row_slots=a["row_slots"].short()), "row_slots dtype"),
        "positions_length": (lambda a: a.update(row_positions=a["row_positions"][:-1]), "row_positions shape"),
        "positions_stride": (lambda a: a.update(row_positions=a["row_positions"].repeat_interleave(2)[::2]), "row_positions must"),
        "out_shape": (lambda a: a.update(out=a["out"][:, :, :-1]), "out shape"),
        "out_dtype": (lambda a: a.update(out=a["out"].double()), "out dtype"),
    }
    return pytest.param(*cases[name], id=name)


BAD = ["query_dim", "query_fp16", "keys_dtype", "values_dtype", "keys_d_k", "values_length", "heads", "keys_stride",
       "query_stride", "slots_int16", "positions_length", "positions_stride", "out_shape", "out_dtype"]


@pytest.mark.parametrize("mutate, message", [_bad(name) for name in BAD])
def test_launcher_errors_name_the_tensor(device, mutate, message):
    shape = SHAPES["gqa"]
    query, keys, values, row_slots, row_positions = make_rows(shape, torch.float32, device, [0, 1], [3, 4])
    args = dict(query=query, keys=keys, values=values, row_slots=row_slots, row_positions=row_positions,
                out=torch.empty(2, shape[0], shape[3], device=device))
    mutate(args)
    with pytest.raises(ValueError, match=message):
        attend_rows(scale=1.0, **args)


# -- attend_prefill: prefill's rows in tiles ----------------------------------------------------------

# Three sequences' prompt pieces: one crossing two KV blocks and several tiles, a short one from
# position 0, one ending at the cache's last position.
PREFILL_SLOTS, PREFILL_STARTS, PREFILL_COUNTS = (2, 0, 3), (BLOCK_N - 6, 0, LENGTH - 41), (BLOCK_N + 9, 3, 41)


def prefill_rows(shape, dtype, device, slots=PREFILL_SLOTS, starts=PREFILL_STARTS, counts=PREFILL_COUNTS, seed=0):
    """The pieces' rows (each sequence's at consecutive positions), the cache NaN past each piece."""
    slot_rows = [s for s, c in zip(slots, counts) for _ in range(c)]
    positions = [p + r for p, c in zip(starts, counts) for r in range(c)]
    return make_rows(shape, dtype, device, slot_rows, positions, seed)


def tiles(shape, starts, counts, device):
    return chunk_table(starts, counts, prefill_tile_rows(shape[0], shape[1])).to(device)


def prefill_launch(query, keys, values, row_slots, row_positions, table, scale, gate=None):
    """attend_prefill into a NaN-poisoned output; every element must be written."""
    out = nan_like(torch.empty(query.shape[0], query.shape[1], values.shape[-1], dtype=query.dtype, device=query.device))
    got = attend_prefill(query, keys, values, row_slots, row_positions, table, scale, out=out, gate=gate)
    assert got is out
    assert not torch.isnan(got).any(), "attend_prefill left NaN in out (an unwritten row, or masked KV leaked)"
    return got


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", [*SHAPES.values(), (16, 2, 16, 16)], ids=[*SHAPES.keys(), "gqa8"])
def test_prefill_matches_reference(device, shape, dtype):
    """The tiles' result against each row computed alone (the reference), attend_rows' tolerance:
    the same maths in another association."""
    query, keys, values, row_slots, row_positions = prefill_rows(shape, dtype, device)
    got = prefill_launch(query, keys, values, row_slots, row_positions, tiles(shape, PREFILL_STARTS, PREFILL_COUNTS, device),
                         scale_of(shape))
    want = attend_rows_ref(query, keys, values, row_slots, row_positions, scale_of(shape))
    rtol, atol = TOLERANCE[dtype]
    assert_close("attend_prefill out", got, want, rtol, atol)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", [SHAPES["gqa"], SHAPES["mla"]], ids=["gqa", "mla"])
def test_prefill_rows_keep_their_bits_whatever_tile_batch_or_split(device, shape, dtype):
    """A prompt's rows cut at other boundaries (as a cached prefix resumes at a boundary), each
    sequence alone, or the pieces in another order: every row torch.equal to the batch's."""
    query, keys, values, row_slots, row_positions = prefill_rows(shape, dtype, device)
    scale = scale_of(shape)
    full = prefill_launch(query, keys, values, row_slots, row_positions, tiles(shape, PREFILL_STARTS, PREFILL_COUNTS, device), scale)
    offsets = [0]
    for c in PREFILL_COUNTS:
        offsets.append(offsets[-1] + c)
    for s, (start, count) in enumerate(zip(PREFILL_STARTS, PREFILL_COUNTS)):
        for cuts in ([0, count], [0, 1, count], [0, count // 2, count], [0, 5, 6, count]):
            cuts = sorted({min(c, count) for c in cuts})
            for a, b in zip(cuts, cuts[1:]):
                rows = slice(offsets[s] + a, offsets[s] + b)
                part = prefill_launch(query[rows], keys, values, row_slots[rows], row_positions[rows],
                                      tiles(shape, (start + a,), (b - a,), device), scale)
                assert torch.equal(part, full[rows]), f"sequence {s} rows {a}..{b} alone differ from the batch's"
    order = [2, 0, 1]
    index = torch.cat([torch.arange(offsets[s], offsets[s + 1]) for s in order]).to(device)
    swapped = prefill_launch(query[index], keys, values, row_slots[index], row_positions[index],
                             tiles(shape, [PREFILL_STARTS[s] for s in order], [PREFILL_COUNTS[s] for s in order], device), scale)
    assert torch.equal(swapped, full[index]), "the pieces in another order give other bits"


@pytest.mark.parametrize("fill", [float("inf"), -1e30, 0.0], ids=["inf", "huge", "zero"])
def test_prefill_never_reads_past_its_rows(device, fill):
    """Whatever sits past a piece's last position (NaN in the other tests) leaves its rows bit-identical."""
    shape, dtype = SHAPES["gqa"], torch.float32
    query, keys, values, row_slots, row_positions = prefill_rows(shape, dtype, device)
    ends = {s: p + c - 1 for s, p, c in zip(PREFILL_SLOTS, PREFILL_STARTS, PREFILL_COUNTS)}
    other_keys, other_values = make_cache(shape, dtype, device, ends, fill=fill)
    table = tiles(shape, PREFILL_STARTS, PREFILL_COUNTS, device)
    nan_out = prefill_launch(query, keys, values, row_slots, row_positions, table, scale_of(shape))
    other_out = prefill_launch(query, other_keys, other_values, row_slots, row_positions, table, scale_of(shape))
    assert torch.equal(nan_out, other_out)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_prefill_output_gate(device, dtype):
    """The gate in the same launch, as attend_rows applies it: out * sigmoid(gate) against the reference."""
    shape = SHAPES["gqa"]
    query, keys, values, row_slots, row_positions = prefill_rows(shape, dtype, device)
    n, heads, d_v = query.shape[0], shape[0], shape[3]
    g = torch.Generator().manual_seed(9)
    gate = (3.0 * torch.randn(n, heads, 2 * d_v, generator=g)).to(dtype=dtype, device=device)[..., d_v:]
    table = tiles(shape, PREFILL_STARTS, PREFILL_COUNTS, device)
    got = prefill_launch(query, keys, values, row_slots, row_positions, table, scale_of(shape), gate=gate)
    want = attend_rows_ref(query, keys, values, row_slots, row_positions, scale_of(shape), gate=gate)
    rtol, atol = TOLERANCE[dtype]
    assert_close("gated attend_prefill out", got, want, rtol, atol)


def test_prefill_table_errors(device):
    shape = SHAPES["gqa"]
    query, keys, values, row_slots, row_positions = prefill_rows(shape, torch.float32, device)
    table = tiles(shape, PREFILL_STARTS, PREFILL_COUNTS, device)
    for bad in (table.long(), table[:, :2].contiguous(), table.reshape(-1)):
        with pytest.raises(ValueError, match="attend_prefill: table must be"):
            attend_prefill(query, keys, values, row_slots, row_positions, bad, 1.0)
    with pytest.raises(ValueError, match="attend_prefill: keys dtype"):
        attend_prefill(query, keys.double(), values, row_slots, row_positions, table, 1.0)
