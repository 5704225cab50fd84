"""kernels/attention_prep.py: the query, the written keys and values against the torch code it
replaces (attention_prep_ref), the cache rows it must not touch, row invariance, launcher checks.

Tolerances (kernel vs reference). fp32: the only difference is the association of each head's
sum of squares (a tree in registers against torch's sum, ~1e-7 relative, halved by the square
root), carried through the rope's two products and sum: rtol 1e-5 and atol 1e-5 (outputs are
O(1) and a rotated element can cancel to near zero). bf16: such a difference can round a normed
element the other way (one bf16 step, 2^-7 relative), and the rope's three roundings can each carry
it one step further; a rotated element that cancels keeps the absolute size of its terms, so the
bound is absolute: 2^-5 on outputs of size ~1-3. That bound alone could hide a misplaced cast, so
at least 97% of bf16 elements must also be bit-identical (in practice nearly all are). Values are
a copy: exact.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_kernels.attention_prep import attention_prep, attention_prep_ref
from verifier.model.ops import rope_cos_sin, rope_inv_freq, rope_table

from .conftest import ROW_COUNTS

EPS = 1e-6
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# (heads, kv_heads, head_dim, rotary dims): GQA with a quarter rotated; no rope; every dim rotated
# in an MHA layout whose head size is no power of two; the shipped target's attention
SHAPES = [(4, 2, 16, 4), (2, 1, 12, 0), (3, 3, 10, 10), (8, 2, 64, 16)]
SHAPE_IDS = [f"H{h}-KV{kv}-hd{hd}-rd{rd}" for h, kv, hd, rd in SHAPES]
SLOTS, LENGTH = 3, 40


def make(rows: int, shape, dtype, device, seed: int = 0):
    """qkv [rows, W] (scale 2), zero-centred norm weights near 0, the cos/sin tables, an
    empty cache (NaN: rows the kernel must not write stay NaN), and each row's (slot, position)."""
    h, kv, hd, rd = shape
    g = torch.Generator().manual_seed(seed)
    qkv = 2.0 * torch.randn(rows, 2 * h * hd + 2 * kv * hd, generator=g)
    q_weight, k_weight = 0.1 * torch.randn(hd, generator=g), 0.1 * torch.randn(hd, generator=g)
    positions = torch.randperm(LENGTH, generator=g)[:rows] if rows <= LENGTH else torch.randint(0, LENGTH, (rows,), generator=g)
    slots = torch.randint(0, SLOTS, (rows,), generator=g)
    if rows > LENGTH:  # distinct (slot, position) per row: a verify batch never writes one twice
        slots, positions = torch.arange(rows) // LENGTH, torch.arange(rows) % LENGTH
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rd, 2).float() / max(rd, 1)))
    freqs = torch.arange(LENGTH).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # the tables of every cache position
    n_slots = max(SLOTS, int(slots.max()) + 1)
    cache = torch.full((n_slots, LENGTH, kv, hd), float("nan"))
    put = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return dict(qkv=put(qkv), q_weight=put(q_weight), k_weight=put(k_weight), eps=EPS, cos=put(emb.cos()), sin=put(emb.sin()),
                keys=put(cache), values=put(cache.clone()), row_slots=slots.to(device), positions=positions.to(torch.int64).to(device),
                n_heads=h, n_kv_heads=kv, head_dim=hd)


def run(fn, args: dict):
    """fn on a copy of the cache: (query, keys, values)."""
    args = dict(args, keys=args["keys"].clone(), values=args["values"].clone())
    return fn(**args), args["keys"], args["values"]


def assert_close_bits(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
    assert torch.equal(got.isnan(), want.isnan()), f"{name}: written elements differ (NaN where the other wrote)"
    g, w = got.float().nan_to_num(), want.float().nan_to_num()
    err = (g - w).abs()
    if dtype == torch.float32:
        assert (err <= 1e-5 + 1e-5 * w.abs()).all(), f"{name}: max err {err.max():.3e}"
        return
    assert (err <= 2.0**-5).all(), f"{name}: max err {err.max():.3e} (bound 2^-5)"
    same = (got == want) | (got.isnan() & want.isnan())
    assert same.float().mean() >= 0.97, f"{name}: only {same.float().mean():.1%} of bf16 elements bit-identical"


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(device, dtype, shape):
    args = make(6, shape, dtype, device)
    query, keys, values = run(attention_prep, args)
    want_query, want_keys, want_values = run(attention_prep_ref, args)
    assert query.shape == (6, shape[0], shape[2]) and query.is_contiguous()
    assert_close_bits(f"query {shape}", query, want_query, dtype)
    assert_close_bits(f"keys {shape}", keys, want_keys, dtype)  # also: only the rows' (slot, position) written
    assert torch.equal(values.nan_to_num(7.0), want_values.nan_to_num(7.0)), "values: an exact copy at each row's (slot, position)"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_alone_equal_rows_in_a_batch(device, dtype):
    """Row invariance (DESIGN.md section 6): a row's query and cache rows carry the same bits
    whether the row is prepared alone or among others."""
    shape = SHAPES[0]
    for rows in [n for n in ROW_COUNTS if n <= 17]:
        args = make(rows, shape, dtype, device, seed=rows)
        query, keys, values = run(attention_prep, args)
        for r in {0, rows // 2, rows - 1}:
            alone = dict(args, **{name: args[name][r : r + 1] for name in ("qkv", "row_slots", "positions")})
            q1, k1, v1 = run(attention_prep, alone)
            slot, position = int(args["row_slots"][r]), int(args["positions"][r])
            assert torch.equal(q1[0], query[r]), f"{rows} rows: row {r}'s query differs alone"
            assert torch.equal(k1[slot, position], keys[slot, position]), f"{rows} rows: row {r}'s key differs alone"
            assert torch.equal(v1[slot, position], values[slot, position])


def test_launcher_checks(device):
    args = make(2, SHAPES[0], torch.float32, device)
    bad = [
        (dict(qkv=args["qkv"][:, 1:]), "qkv must be"),
        (dict(q_weight=args["q_weight"][1:]), "q_weight must have shape"),
        (dict(cos=args["cos"][:, :3], sin=args["sin"][:, :3]), "rd even"),
        (dict(sin=args["sin"][1:]), "sin must have shape"),
        (dict(sin=args["sin"].double()), "sin dtype"),
        (dict(keys=args["keys"][:, :, :1]), "keys must be"),
        (dict(positions=args["positions"].int()), "positions dtype"),
        (dict(row_slots=args["row_slots"][:1]), "row_slots must have shape"),
        (dict(values=args["values"].transpose(0, 1)), "values"),
    ]
    for override, message in bad:
        with pytest.raises(ValueError, match=message):
            attention_prep(**dict(args, **override))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tables' claim is about CUDA's elementwise ops")
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_table_rows_are_each_positions_rope(dtype):
    """The layer reads rope_table by position where it computed rope_cos_sin of its rows: the same
    bits (each element is computed alone on CUDA), for rows alone and in a batch."""
    length, rotary_dim, theta = 300, 16, 10000.0
    cos, sin = rope_table(length, rotary_dim, theta, "cuda", dtype)
    inv_freq = rope_inv_freq(rotary_dim, theta, torch.device("cuda"))
    for positions in ([0], [299], [5, 17, 64, 65, 128, 255, 299], list(range(length))):
        at = torch.tensor(positions, device="cuda")
        want_cos, want_sin = rope_cos_sin(at, inv_freq, dtype)
        assert torch.equal(cos[at], want_cos) and torch.equal(sin[at], want_sin), f"positions {positions[:4]}..."
    assert rope_table(length, rotary_dim, theta, "cuda", dtype)[0] is cos, "made once"
