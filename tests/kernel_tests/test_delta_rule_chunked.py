"""kernels/delta_rule_chunked.py: the chunked (WY-form) GDN delta rule against the serial rule of
kernels/delta_rule.py (prefill's verify, commit=True), its sub-chunk table, and its bitwise
contract: batch invariance, split invariance at absolute chunk boundaries, every value block and
warp count the same bits, a table passed or built the same bits.

Tolerance (chunked vs serial, fp32): rtol 1e-5, atol 4e-6. The chunked form is the serial
recurrence re-associated: the decays' products become exp of sums of their logs, and each row's
correction is solved for through (I + A)^-1 and summed over the sub-chunk in matrix products, so
the two agree to fp32 rounding, not bitwise. Keys are l2-normalised and beta, decay lie in (0, 1),
so every row's update is a contraction and those roundings do not grow along a sequence: errors
of a few 1e-7 on states (size ~1) and outputs (~0.3), against O(0.1-1) for a wrong boundary,
decay, mask or index. Everything between kernel launches is compared with torch.equal.
"""

import pytest
import torch

from hybrid_kernels.delta_rule import delta_rule_verify_ref
from hybrid_kernels.delta_rule_chunked import CHUNK, chunk_table, delta_rule_chunked, delta_rule_chunked_ref

from .conftest import assert_close, assert_refused, nan_like

RTOL, ATOL = 1e-5, 4e-6
N_SLOTS = 7
C = 16  # the sub-chunk of most tests: several sub-chunks a sequence at interpreter-sized row counts
# A ragged batch: lengths around the sub-chunk (one row, a part, one whole, one past, several), a
# padding sequence of no rows, and first rows on and off a chunk boundary.
COUNTS, SLOTS, STARTS = [1, 5, 16, 17, 40, 0], [3, 0, 5, 1, 4, 6], [0, 3, 16, 21, 3, 0]
OPS = {"kernel": delta_rule_chunked, "ref": delta_rule_chunked_ref}


def ragged(counts: list[int], slots: list[int], starts: list[int], device):
    """(seq_slots [S], cu_rows [S+1], starts [S]) int32 for sequences of `counts` rows."""
    cu = [0]
    for n in counts:
        cu.append(cu[-1] + n)
    return tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (slots, cu, starts))


def make(rows: int, heads: int, d_k: int, d_v: int, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random GDN inputs shaped like the models': l2-normalised keys and queries (query scaled by
    d_k^-0.5), one decay a head and row in (0.3, 1), beta in (0, 1), a state of size ~1."""
    g = torch.Generator().manual_seed(seed)

    def l2(x):
        return x / x.norm(dim=-1, keepdim=True)

    t = dict(
        state=torch.randn(N_SLOTS, heads, d_k, d_v, generator=g),
        query=l2(torch.randn(rows, heads, d_k, generator=g)) * d_k**-0.5,
        key=l2(torch.randn(rows, heads, d_k, generator=g)),
        value=torch.randn(rows, heads, d_v, generator=g),
        decay=torch.rand(rows, heads, 1, generator=g) * 0.7 + 0.3,
        beta=torch.rand(rows, heads, generator=g),
    )
    return {name: x.to(device) for name, x in t.items()}


def run(op, t, batch, state=None, out=None, rows=slice(None), **kw):
    """op on t's rows `rows` for batch = (seq_slots, cu_rows, starts), from `state` (None: a copy
    of t's, so t's stays as made) -> (out, state)."""
    state = t["state"].clone() if state is None else state
    got = op(state, t["query"][rows], t["key"][rows], t["value"][rows], t["decay"][rows], t["beta"][rows], *batch,
             out, **kw)
    return got, state


def serial(t, batch):
    """The serial rule, prefill's walk (delta_rule_verify_ref, commit=True) -> (out, state)."""
    state = t["state"].clone()
    out = delta_rule_verify_ref(state, t["query"], t["key"], t["value"], t["decay"], t["beta"], *batch[:2], commit=True)
    return out, state


def assert_matches_serial(name, t, batch, got, state, slots_in_batch):
    want, want_state = serial(t, batch)
    assert_close(f"{name} out", got, want, RTOL, ATOL)  # fails on NaN: every row written
    assert_close(f"{name} state", state, want_state, RTOL, ATOL)
    assert torch.isfinite(got).all() and torch.isfinite(state).all(), f"{name}: not finite"
    for slot in range(N_SLOTS):
        if slot not in slots_in_batch:
            assert torch.equal(state[slot], t["state"][slot]), f"{name}: slot {slot} (padding or outside the batch) was written"


SHAPES = [(2, 16, 16), (2, 32, 24), (2, 16, 40)]  # (H, D_K, D_V): D_V not a power of two, two value blocks


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}-K{}-V{}".format(*s))
def test_matches_the_serial_rule(op, shape, device):
    """Kernel and reference each close to the serial walk: outputs and committed states of a ragged
    batch; the padding sequence's slot and the slot outside the batch are not written."""
    heads, d_k, d_v = shape
    t = make(sum(COUNTS), heads, d_k, d_v, device)
    batch = ragged(COUNTS, SLOTS, STARTS, device)
    out = nan_like(torch.empty(sum(COUNTS), heads, d_v, device=device))
    got, state = run(OPS[op], t, batch, out=out, chunk=C)
    assert got is out
    assert_matches_serial(op, t, batch, got, state, [s for s, n in zip(SLOTS, COUNTS) if n])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("chunk", [32, CHUNK])
def test_other_chunks_match_the_serial_rule(op, chunk, device):
    """The default chunk and another: sequences spanning two sub-chunks, one starting off a boundary."""
    counts, slots, starts = [70, 9, 33], [2, 0, 6], [0, chunk - 4, 5]
    t = make(sum(counts), 2, 16, 24, device, seed=1)
    batch = ragged(counts, slots, starts, device)
    got, state = run(OPS[op], t, batch, chunk=chunk)
    assert_matches_serial(f"{op} chunk {chunk}", t, batch, got, state, slots)


@pytest.mark.parametrize("op", OPS)
def test_a_zero_decay_resets_the_state(op, device):
    """Decays of exactly 0 (log -inf) at a sequence's first row, at and inside sub-chunk boundaries,
    twice in a row and at a last row, and tiny decays (1e-30: ratios past exp's range above the
    diagonal): every value finite and close to the serial walk, which resets the state there."""
    counts, slots, starts = [40, 6, 17], [1, 5, 2], [3, 0, 16]
    t = make(sum(counts), 2, 16, 24, device, seed=2)
    zero_rows = [0, 13, 14, 20, 29, 39, 45, 46, 62]  # rows 13 and 29 start sub-chunks (positions 16, 32)
    t["decay"][zero_rows] = 0.0
    t["decay"][[5, 6, 7], 1] = 1e-30  # head 1 only: head 0 keeps its zeros alone
    t["decay"][52, 0] = 0.0  # one head only
    batch = ragged(counts, slots, starts, device)
    got, state = run(OPS[op], t, batch, chunk=C)
    assert_matches_serial(f"{op} zero decays", t, batch, got, state, slots)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("chunk", [C, CHUNK])
def test_repeated_keys_match_the_serial_rule(op, chunk, device):
    """Every row of a sequence with the same key, beta and decay near 1: A's entries near 1 below
    the diagonal, far from a small correction. (I + A)^-1 is still bounded, and the kernel's block
    inverse close to the serial walk (a power series in A would cancel terms many orders larger)."""
    counts, slots, starts = [70, 40], [1, 4], [5, 16]
    t = make(sum(counts), 2, 32, 24, device, seed=9)
    t["key"][:70] = t["key"][0].clone()
    t["key"][70:] = t["key"][70].clone()
    t["beta"].fill_(0.99)
    t["decay"].fill_(0.999)
    batch = ragged(counts, slots, starts, device)
    got, state = run(OPS[op], t, batch, chunk=chunk)
    assert_matches_serial(f"{op} repeated keys, chunk {chunk}", t, batch, got, state, slots)


def test_chunk_table():
    """Sub-chunks end at absolute multiples of the chunk: a sequence starting mid-chunk first fills
    up to the boundary; a zero-row sequence has none, and the next sequence's rows follow on."""
    want = [
        (0, 0, 1),  # 1 row at position 0
        (1, 1, 5),  # positions 3 .. 7: inside one chunk
        (2, 6, 16),  # positions 16 .. 31: exactly one chunk
        (3, 22, 11), (3, 33, 6),  # positions 21 .. 31, then 32 .. 37
        (4, 39, 13), (4, 52, 16), (4, 68, 11),  # positions 3 .. 15, 16 .. 31, 32 .. 42; sequence 5 has no rows
    ]
    table = chunk_table(STARTS, COUNTS, C)
    assert table.dtype == torch.int32 and table.device.type == "cpu"
    assert table.tolist() == [list(row) for row in want]
    assert chunk_table([14, 0, 16], [3, 0, 2], C).tolist() == [[0, 0, 2], [0, 2, 1], [2, 3, 2]]
    assert chunk_table([5], [3], 64).tolist() == [[0, 0, 3]]
    for starts, counts in (([], []), ([7, 0], [0, 0])):
        empty = chunk_table(starts, counts, C)
        assert empty.shape == (0, 3) and empty.dtype == torch.int32
    with pytest.raises(ValueError, match="2 starts for 1 sequences"):
        chunk_table([0, 1], [3], C)
    with pytest.raises(ValueError, match="sequence 0 has start -1"):
        chunk_table([-1], [3], C)


@pytest.mark.parametrize("chunk", [C, 32, CHUNK])
def test_chunk_table_covers_every_row_once(chunk):
    """Every row of every sequence in exactly one sub-chunk, in order, none across a boundary."""
    counts, starts = [1, 5, 16, 17, 40, 0, 70, 9, 33], [0, 3, 16, 21, 3, 0, 0, 28, 5]
    cu = [0]
    for n in counts:
        cu.append(cu[-1] + n)
    covered = []
    for s, first, n in chunk_table(starts, counts, chunk).tolist():
        assert n >= 1 and cu[s] <= first and first + n <= cu[s + 1]
        lo = starts[s] + first - cu[s]  # the absolute position of the sub-chunk's first row
        assert lo // chunk == (lo + n - 1) // chunk, f"sub-chunk {s, first, n} crosses a boundary"
        assert (lo + n) % chunk == 0 or first + n == cu[s + 1], f"sub-chunk {s, first, n} stops short"
        covered.extend(range(first, first + n))
    assert covered == list(range(cu[-1]))


@pytest.mark.parametrize("op", OPS)
def test_a_table_gives_the_same_bits(op, device):
    """The table passed (built on the host, moved once) or built by the launcher: the same bits."""
    heads, d_v = 2, 24
    t = make(sum(COUNTS), heads, 16, d_v, device, seed=10)
    batch = ragged(COUNTS, SLOTS, STARTS, device)
    built, built_state = run(OPS[op], t, batch, chunk=C)
    table = chunk_table(STARTS, COUNTS, C).to(device)
    passed, passed_state = run(OPS[op], t, batch, chunk=C, table=table)
    assert torch.equal(passed, built) and torch.equal(passed_state, built_state)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant(out_dtype, device):
    """Each sequence alone gives bitwise its outputs and committed state in the ragged batch."""
    heads, d_k, d_v = 2, 16, 24
    t = make(sum(COUNTS), heads, d_k, d_v, device, seed=3)
    batch = ragged(COUNTS, SLOTS, STARTS, device)
    batched, batched_state = run(delta_rule_chunked, t, batch, out=torch.empty(sum(COUNTS), heads, d_v, dtype=out_dtype,
                                                                                device=device), chunk=C)
    first = 0
    for n, slot, start in zip(COUNTS, SLOTS, STARTS):
        rows = slice(first, first + n)
        out = torch.empty(n, heads, d_v, dtype=out_dtype, device=device)
        alone, alone_state = run(delta_rule_chunked, t, ragged([n], [slot], [start], device), out=out, rows=rows, chunk=C)
        assert torch.equal(alone, batched[rows]), f"out, slot {slot}"
        if n:
            assert torch.equal(alone_state[slot], batched_state[slot]), f"state, slot {slot}"
        else:
            assert torch.equal(alone_state, t["state"]), f"a padding sequence alone wrote a slot (slot {slot})"
        first += n


def test_split_at_chunk_boundaries(device):
    """Rows [0, n) in one call == [0, m) then [m, n) (or three calls) where starts + m is a multiple
    of the chunk: outputs and committed state bitwise. A split off a boundary applies other sub-chunks,
    the same math in another association: close, not asserted bitwise."""
    n, slot, start = 70, 4, 5  # boundaries at positions 16, 32, 48, 64: rows 11, 27, 43, 59
    t = make(n, 2, 16, 24, device, seed=4)
    whole, whole_state = run(delta_rule_chunked, t, ragged([n], [slot], [start], device), chunk=C)

    def in_parts(cuts):
        state, outs = t["state"].clone(), []
        for lo, hi in zip([0, *cuts], [*cuts, n]):
            outs.append(run(delta_rule_chunked, t, ragged([hi - lo], [slot], [start + lo], device), state=state,
                            rows=slice(lo, hi), chunk=C)[0])
        return torch.cat(outs), state

    for cuts in ([11], [27], [59], [11, 43]):
        parts, parts_state = in_parts(cuts)
        assert torch.equal(parts, whole), f"out, split at {cuts}"
        assert torch.equal(parts_state, whole_state), f"state, split at {cuts}"
    parts, parts_state = in_parts([20])  # off a boundary
    assert_close("out, split off a boundary", parts, whole, RTOL, ATOL)
    assert_close("state, split off a boundary", parts_state, whole_state, RTOL, ATOL)


def test_every_value_block_gives_the_same_bits(device):
    """BLOCK_V 16 (two walk programs a head) and 32 (one), and other warp counts (both kernels'),
    give the same bits: no sum is cut by the value block, and tl.dot's order is not the layout's."""
    heads, d_k, d_v = 2, 32, 32
    t = make(sum(COUNTS), heads, d_k, d_v, device, seed=5)
    batch = ragged(COUNTS, SLOTS, STARTS, device)
    pinned = run(delta_rule_chunked, t, batch, chunk=C, block_v=32, num_warps=4)
    for block_v, warps in ((16, 4), (16, 1), (32, 8)):
        other = run(delta_rule_chunked, t, batch, chunk=C, block_v=block_v, num_warps=warps)
        assert torch.equal(other[0], pinned[0]), f"out, BLOCK_V {block_v}, {warps} warps"
        assert torch.equal(other[1], pinned[1]), f"state, BLOCK_V {block_v}, {warps} warps"


@pytest.mark.parametrize("op", OPS)
def test_bf16_out_is_the_fp32_out_rounded(op, device):
    """out in bf16 holds each fp32 output rounded to nearest even, bitwise .to(torch.bfloat16) of
    the fp32 output (the interpreter rounds on the bits); the state is the fp32 call's."""
    t = make(sum(COUNTS), 2, 16, 24, device, seed=6)
    t["value"] = t["value"] * 300  # outputs of many magnitudes, so that truncating would differ from rounding
    batch = ragged(COUNTS, SLOTS, STARTS, device)
    wide, wide_state = run(OPS[op], t, batch, chunk=C)
    narrow = torch.empty(wide.shape, dtype=torch.bfloat16, device=device)
    got, narrow_state = run(OPS[op], t, batch, out=narrow, chunk=C)
    assert got is narrow
    assert torch.equal(narrow, wide.to(torch.bfloat16))
    assert torch.equal(narrow_state, wide_state)
    assert not torch.equal(narrow, (wide.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)), \
        "the data does not tell rounding from truncation"


@pytest.mark.parametrize("op", OPS)
def test_zero_row_sequences_store_nothing(op, device):
    """Padding sequences (no rows) leave their slots bitwise as they were, beside a real one and alone."""
    t = make(3, 2, 16, 24, device, seed=7)
    _, state = run(OPS[op], t, ragged([0, 3, 0], [1, 2, 3], [0, 7, 0], device), chunk=C)
    for slot in (0, 1, 3, 4, 5, 6):
        assert torch.equal(state[slot], t["state"][slot]), f"slot {slot} written"
    assert not torch.equal(state[2], t["state"][2]), "the real sequence did not commit its state"
    empty = {name: x[:0] for name, x in t.items() if name != "state"} | {"state": t["state"]}
    _, state = run(OPS[op], empty, ragged([0, 0], [1, 2], [0, 0], device), chunk=C)
    assert torch.equal(state, t["state"]), "a batch of padding sequences wrote a slot"


def _case(change: dict, message: str):
    """(build, message) for assert_refused: a valid call with `change` applied to its arguments."""

    def build(device):
        t = make(4, 2, 16, 24, device, seed=8)
        seq_slots, cu_rows, starts = ragged([4], [0], [0], device)
        kw = dict(state=t["state"], query=t["query"], key=t["key"], value=t["value"], decay=t["decay"], beta=t["beta"],
                  seq_slots=seq_slots, cu_rows=cu_rows, starts=starts, chunk=C, table=None)
        for name, f in change.items():
            kw[name] = f(kw[name])
        return kw

    return build, message


REFUSED = {
    "kda-decay": _case({"decay": lambda d: d.expand(-1, -1, 16).contiguous()}, "KDA.*chunked form is GDN's.*walks rows"),
    "decay-shape": _case({"decay": lambda d: d[:, :1]}, r"decay must have shape \[R, H, 1\]"),
    "key-dtype": _case({"key": lambda k: k.double()}, "key dtype torch.float64"),
    "state-dtype": _case({"state": lambda s: s.bfloat16()}, "state must be float32"),
    "value-dtype": _case({"value": lambda v: v.half()}, "value dtype torch.float16"),
    "value-shape": _case({"value": lambda v: v[..., :20]}, r"value must have shape \[R, H, D_V\]"),
    "query-rows": _case({"query": lambda q: q[:3]}, r"query must have shape \[R, H, D_K\]"),
    "beta-shape": _case({"beta": lambda b: b[..., None]}, r"beta must have shape \[R, H\]"),
    "starts-len": _case({"starts": lambda s: s.repeat(2)}, r"starts must have shape \[S\]"),
    "starts-dtype": _case({"starts": lambda s: s.long()}, "starts dtype torch.int64"),
    "chunk-not-pow2": _case({"chunk": lambda c: 24}, "chunk 24 must be a power of two"),
    "chunk-small": _case({"chunk": lambda c: 8}, "chunk 8 must be a power of two in 16"),
    "state-layout": _case({"state": lambda s: s.transpose(2, 3).contiguous().transpose(2, 3)}, "state must be contiguous"),
    "table-shape": _case({"table": lambda _: torch.zeros(1, 2, dtype=torch.int32)}, r"table must be 2-D \[n_sub, 3\]"),
    "table-dtype": _case({"table": lambda _: torch.zeros(1, 3, dtype=torch.int64)}, "table dtype torch.int64"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refuses_bad_arguments(case, device):
    """Kernel and reference refuse with a ValueError naming the problem."""
    assert_refused(REFUSED[case], device, delta_rule_chunked, delta_rule_chunked_ref)


def test_refuses_bad_out_and_block_v(device):
    t = make(4, 2, 16, 24, device)
    batch = ragged([4], [0], [0], device)
    with pytest.raises(ValueError, match="out must have shape"):
        run(delta_rule_chunked, t, batch, out=torch.empty(4, 2, 20, device=device), chunk=C)
    with pytest.raises(ValueError, match="out must be contiguous"):
        run(delta_rule_chunked, t, batch, out=torch.empty(4, 24, 2, device=device).transpose(1, 2), chunk=C)
    with pytest.raises(ValueError, match="block_v 24 must be a power of two"):
        run(delta_rule_chunked, t, batch, chunk=C, block_v=24)
