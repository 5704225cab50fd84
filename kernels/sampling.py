"""Choosing tokens on the device: greedy argmax and coupled sampling, one program per row.
The design in full: DESIGN.md section 6, "Choosing tokens on the device".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_launchable
from .dependent_launch import after_previous, launch_options

BLOCK_V = 1024  # ids per step of the walk
# argmax_rows' stage-one chunk (ids per program). At V = 151936 it gives C = 38 programs per row:
# one row spreads over 38 SMs (each reading 16 KB of fp32 in 4 steps) instead of walking 150k ids
# on one, and a 64-row batch is 2432 programs, enough to fill 132 SMs several times over; at 576
# rows it is 21888 programs, still short ones (2048 would give 75 per row but 43776 at 576 rows,
# and 8192 only 19 per row). A constant, so the chunks depend on V alone, never on the row count;
# read at each call, so a test may set a smaller one to cover many chunks under the interpreter.
CHUNK_V = 4096
NUM_WARPS = 4
DTYPES = (torch.float32, torch.bfloat16)

NO_ID = tl.constexpr(2147483647)
GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (2^64 / golden ratio)
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's finaliser multipliers
U_BITS = 23  # bits of the hash kept for u: (bits + 0.5) needs 24 significant bits, so u is exact in fp32
_GAMMA, _MIX1, _MIX2 = tl.constexpr(GAMMA), tl.constexpr(MIX1), tl.constexpr(MIX2)
_U_SHIFT, _U_SCALE = tl.constexpr(64 - U_BITS), tl.constexpr(2.0 ** -U_BITS)


@triton.jit
def _argmax_chunks_kernel(p_logits, p_val, p_id, V, s_row, C, CHUNK_V: tl.constexpr, BLOCK_V: tl.constexpr,
                          PDL: tl.constexpr):
    """Stage one: program (r, c) -> partials [r, c]: chunk c's first NaN (value NaN), else its
    maximum and the lowest id reaching it (an all -inf chunk: its first id)."""
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_row = tl.program_id(0).to(tl.int64)
    i_chunk = tl.program_id(1)
    o_v = tl.arange(0, BLOCK_V)
    p_row = p_logits + i_row * s_row
    b_best = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per lane: the largest number seen
    b_id = tl.full([BLOCK_V], NO_ID, tl.int32)  # per lane: the first id holding it
    b_nan = tl.full([BLOCK_V], NO_ID, tl.int32)  # per lane: the first NaN's id
    for v0 in range(0, CHUNK_V, BLOCK_V):
        o_id = i_chunk * CHUNK_V + v0 + o_v
        m_id = o_id < V
        b_x = tl.load(p_row + o_id, mask=m_id, other=float("-inf")).to(tl.float32)
        m_nan = b_x != b_x
        b_nan = tl.minimum(b_nan, tl.where(m_nan, o_id, NO_ID))
        # ids only grow within a lane: a later id replaces only a strictly larger number, and a
        # lane's first valid id seeds it (so an all -inf chunk answers its first id)
        m_take = m_id & ~m_nan & ((b_x > b_best) | (b_id == NO_ID))
        b_best = tl.where(m_take, b_x, b_best)
        b_id = tl.where(m_take, o_id, b_id)
    b_max = tl.max(b_best, axis=0)
    b_first = tl.min(tl.where(b_best == b_max, b_id, NO_ID), axis=0)  # lanes past V hold NO_ID
    b_first_nan = tl.min(b_nan, axis=0)
    m_has_nan = b_first_nan < NO_ID
    i_partial = i_row * C + i_chunk
    tl.store(p_val + i_partial, tl.where(m_has_nan, float("nan"), b_max))
    tl.store(p_id + i_partial, tl.where(m_has_nan, b_first_nan, b_first))


@triton.jit
def _argmax_combine_kernel(p_val, p_id, p_out, C, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """Stage two: program r -> out[r] from partials [r, :C] (BLOCK_C >= C, a power of two)."""
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_row = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, BLOCK_C)
    m_c = o_c < C
    b_val = tl.load(p_val + i_row * C + o_c, mask=m_c, other=float("-inf"))
    b_id = tl.load(p_id + i_row * C + o_c, mask=m_c, other=NO_ID)
    m_nan = b_val != b_val
    # a NaN chunk's id is its first NaN, and chunks hold increasing ids: the lowest is the row's first NaN
    b_first_nan = tl.min(tl.where(m_nan, b_id, NO_ID), axis=0)
    m_num = m_c & ~m_nan  # the chunks' maxima (NaN kept out of the max, padding out of the ties)
    b_max = tl.max(tl.where(m_num, b_val, float("-inf")), axis=0)
    # an all -inf row: every chunk holds -inf = b_max with its first id, and chunk 0's is id 0
    b_first = tl.min(tl.where(m_num & (b_val == b_max), b_id, NO_ID), axis=0)
    b_choice = tl.where(b_first_nan < NO_ID, b_first_nan, b_first)
    tl.store(p_out + i_row, b_choice.to(tl.int64))


@triton.jit
def _mix(x):
    """SplitMix64's finaliser on uint64 (multiplication wraps mod 2^64)."""
    x = (x ^ (x >> 30)) * _MIX1
    x = (x ^ (x >> 27)) * _MIX2
    return x ^ (x >> 31)


@triton.jit
def _row_key(b_seed, b_position):
    """int64 seed and position (scalars) -> the row's uint64 key."""
    b_key = _mix(b_seed.to(tl.uint64, bitcast=True) + _GAMMA)
    return _mix((b_key ^ b_position.to(tl.uint64, bitcast=True)) + _GAMMA)


@triton.jit
def _uniform(b_key, o_id):
    """The row key and ids [BLOCK_V] int32 -> u [BLOCK_V] fp32, 0 < u < 1."""
    b_bits = _mix(b_key + (o_id.to(tl.uint64) + 1) * _GAMMA)
    return ((b_bits >> _U_SHIFT).to(tl.float32) + 0.5) * _U_SCALE


@triton.jit
def _gumbel(b_u):
    """u -> -log(-log(u)). The winners have u near 1, where -log(u) is tiny, so the log must be
    accurate there (an lg2.approx-style log, absolute error ~2^-22, would not be): tl.log on fp32
    lowers to libdevice's logf, the log torch's CUDA kernels call (on an H200 with Triton 3.6 this
    g equals the reference's bitwise over all 2^23 values of u); the interpreter uses numpy's."""
    return -tl.log(-tl.log(b_u))


@triton.jit(do_not_specialize=["V", "s_row"])
def _coupled_choice_kernel(p_logits, p_temperature, p_seed, p_position, p_threshold, p_out, V, s_row,
                           HAS_THRESHOLD: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_row = tl.program_id(0).to(tl.int64)
    o_v = tl.arange(0, BLOCK_V)
    p_row = p_logits + i_row * s_row
    b_t = tl.load(p_temperature + i_row)
    b_key = _row_key(tl.load(p_seed + i_row), tl.load(p_position + i_row))
    b_threshold = float("-inf")
    if HAS_THRESHOLD:
        b_threshold = tl.load(p_threshold + i_row)
    b_best = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per lane: the best score seen
    b_id = tl.full([BLOCK_V], NO_ID, tl.int32)  # per lane: the first id holding it
    for v0 in range(0, V, BLOCK_V):
        o_id = v0 + o_v
        m_id = o_id < V
        # div_rn: correctly rounded as torch divides, so the threshold (computed by torch from
        # the same quotients) masks exactly the ids the reference masks
        b_scaled = tl.math.div_rn(tl.load(p_row + o_id, mask=m_id, other=0.0).to(tl.float32), b_t)
        b_g = _gumbel(_uniform(b_key, o_id))
        b_score = tl.where(b_scaled >= b_threshold, b_scaled + b_g, float("-inf"))
        m_take = m_id & ((b_score > b_best) | (b_id == NO_ID))
        b_best = tl.where(m_take, b_score, b_best)
        b_id = tl.where(m_take, o_id, b_id)
    b_max = tl.max(b_best, axis=0)
    b_first = tl.min(tl.where(b_best == b_max, b_id, NO_ID), axis=0)
    tl.store(p_out + i_row, b_first.to(tl.int64))


@triton.jit(do_not_specialize=["V"])
def _gumbel_rows_kernel(p_seed, p_position, p_u, p_g, V, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_row = tl.program_id(0).to(tl.int64)
    o_v = tl.arange(0, BLOCK_V)
    b_key = _row_key(tl.load(p_seed + i_row), tl.load(p_position + i_row))
    for v0 in range(0, V, BLOCK_V):
        o_id = v0 + o_v
        m_id = o_id < V
        b_u = _uniform(b_key, o_id)
        tl.store(p_u + i_row * V + o_id, b_u, mask=m_id)
        tl.store(p_g + i_row * V + o_id, _gumbel(b_u), mask=m_id)


@triton.jit
def _cumsum_rows_kernel(p_x, p_out, V, s_row, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_row = tl.program_id(0).to(tl.int64)
    o_v = tl.arange(0, BLOCK_V)
    p_in, p_row = p_x + i_row * s_row, p_out + i_row * s_row
    carry = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)  # the running total before this block
    for start in range(0, V, BLOCK_V):
        m_v = start + o_v < V
        b_x = tl.load(p_in + start + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_sum = carry + tl.cumsum(b_x, axis=0)
        tl.store(p_row + start + o_v, b_sum, mask=m_v)
        carry = tl.sum(tl.where(o_v == BLOCK_V - 1, b_sum, 0.0), axis=0)  # exactly the last element


def cumsum_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] fp32, rows contiguous -> [R, V] fp32: each row's running sum, row-invariant."""
    if x.dim() != 2 or x.dtype != torch.float32 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"cumsum_rows: x must be fp32 [R, V] with contiguous rows, got {x.dtype} {list(x.shape)}")
    check_launchable("cumsum_rows", "x", x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel():
        _cumsum_rows_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK_V=BLOCK_V, num_warps=NUM_WARPS,
                                           **launch_options(x.device))
    return out


def cumsum_rows_ref(x: torch.Tensor) -> torch.Tensor:
    """torch.cumsum along the rows (the CPU's sequential sum: row-invariant there)."""
    return torch.cumsum(x, dim=-1)


def argmax_rows(logits: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V] -> int64 [R]: each row's argmax, ties (and NaNs) to the lowest id."""
    _check_logits("argmax_rows", logits)
    _check_out("argmax_rows", logits, out)
    check_launchable("argmax_rows", "logits", logits)
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        if CHUNK_V < 1 or CHUNK_V & (CHUNK_V - 1):
            raise ValueError(f"argmax_rows: CHUNK_V {CHUNK_V} is not a power of two")
        chunks = triton.cdiv(vocab, CHUNK_V)
        # [rows, chunks]: each chunk's best value (NaN if it holds one) and its id
        val = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
        ids = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
        options = launch_options(logits.device)
        _argmax_chunks_kernel[(rows, chunks)](logits, val, ids, vocab, logits.stride(0), chunks, CHUNK_V=CHUNK_V,
                                              BLOCK_V=min(BLOCK_V, CHUNK_V), num_warps=NUM_WARPS, **options)
        _argmax_combine_kernel[(rows,)](val, ids, out, chunks, BLOCK_C=triton.next_power_of_2(chunks), num_warps=1,
                                        **options)
    return out


def argmax_rows_ref(logits: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.argmax over the last dim (ties and NaNs: the first)."""
    _check_logits("argmax_rows", logits)
    _check_out("argmax_rows", logits, out)
    return _into(out, torch.argmax(logits, dim=-1))


def coupled_choice(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                   keep_threshold: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's coupled-sampling choice: argmax over kept ids of logits / T + g(seed, position, id)."""
    _check_coupled(logits, temperature, seeds, positions, keep_threshold, out)
    check_launchable("coupled_choice", "logits", logits)
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        threshold = keep_threshold if keep_threshold is not None else temperature  # unread without a threshold
        _coupled_choice_kernel[(rows,)](logits, temperature, seeds, positions, threshold, out, vocab, logits.stride(0),
                                        HAS_THRESHOLD=keep_threshold is not None, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS,
                                        **launch_options(logits.device))
    return out


def coupled_choice_ref(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                       keep_threshold: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The same formula in torch ops, all rows at once."""
    _check_coupled(logits, temperature, seeds, positions, keep_threshold, out)
    scaled = logits.float() / temperature[:, None]  # [R, V]
    _, g = gumbel_rows_ref(seeds, positions, logits.shape[1])
    threshold = keep_threshold[:, None] if keep_threshold is not None else float("-inf")
    score = torch.where(scaled >= threshold, scaled + g, float("-inf"))
    return _into(out, torch.argmax(score, dim=-1))


def gumbel_rows(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The noise coupled_choice adds: (u, g), each [R, vocab] fp32 (for tests and inspection)."""
    _check_keys(seeds, positions)
    check_launchable("gumbel_rows", "seeds", seeds)
    u = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    g = torch.empty_like(u)
    if seeds.shape[0] and vocab:
        _gumbel_rows_kernel[(seeds.shape[0],)](seeds, positions, u, g, vocab, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS,
                                               **launch_options(seeds.device))
    return u, g


def gumbel_rows_ref(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, g) [R, vocab] fp32 with the hash in int64 ops (two's complement: + and * wrap as uint64 does)."""
    _check_keys(seeds, positions)
    key = _splitmix64_ref(_splitmix64_ref(seeds) ^ positions)  # [R]
    ids = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    bits = _splitmix64_ref(key[:, None] + ids * _signed(GAMMA))  # [R, vocab]
    u = (_shift_right(bits, 64 - U_BITS).float() + 0.5) * 2.0 ** -U_BITS
    return u, -torch.log(-torch.log(u))


def _signed(x: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic on int64)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix64_ref(x: torch.Tensor) -> torch.Tensor:
    return _mix_ref(x + _signed(GAMMA))


def _mix_ref(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shift_right(x, 30)) * _signed(MIX1)
    x = (x ^ _shift_right(x, 27)) * _signed(MIX2)
    return x ^ _shift_right(x, 31)


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


def _check_logits(op: str, logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"{op}: logits must be [rows, vocab], got shape {list(logits.shape)}")
    if logits.dtype not in DTYPES:
        raise ValueError(f"{op}: logits dtype {logits.dtype} is not one of {DTYPES}")
    if logits.shape[1] < 1:
        raise ValueError(f"{op}: empty vocabulary")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"{op}: logits must be contiguous along the vocabulary, got strides {logits.stride()}")


def _check_out(op: str, logits: torch.Tensor, out: torch.Tensor | None) -> None:
    if out is not None and (out.shape != (logits.shape[0],) or out.dtype != torch.int64 or out.device != logits.device):
        raise ValueError(f"{op}: out must be int64 [{logits.shape[0]}] on {logits.device}, "
                         f"got {out.dtype} {list(out.shape)} on {out.device}")


def _check_row_vector(name: str, t: torch.Tensor, rows: int, dtype: torch.dtype, device: torch.device) -> None:
    if t.shape != (rows,) or t.dtype != dtype or t.device != device or (rows > 1 and t.stride(0) != 1):
        raise ValueError(f"coupled_choice: {name} must be contiguous {dtype} [{rows}] on {device}, "
                         f"got {t.dtype} {list(t.shape)} strides {t.stride()} on {t.device}")


def _check_keys(seeds: torch.Tensor, positions: torch.Tensor) -> None:
    if seeds.dim() != 1:
        raise ValueError(f"coupled_choice: seeds must be [rows], got shape {list(seeds.shape)}")
    _check_row_vector("seeds", seeds, seeds.shape[0], torch.int64, seeds.device)
    _check_row_vector("positions", positions, seeds.shape[0], torch.int64, seeds.device)


def _check_coupled(logits, temperature, seeds, positions, keep_threshold, out) -> None:
    _check_logits("coupled_choice", logits)
    rows, device = logits.shape[0], logits.device
    _check_row_vector("temperature", temperature, rows, torch.float32, device)
    _check_row_vector("seeds", seeds, rows, torch.int64, device)
    _check_row_vector("positions", positions, rows, torch.int64, device)
    if keep_threshold is not None:
        _check_row_vector("keep_threshold", keep_threshold, rows, torch.float32, device)
    _check_out("coupled_choice", logits, out)
