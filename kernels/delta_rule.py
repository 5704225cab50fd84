"""The gated delta rule over the rows of a ragged batch: GDN (decay per head) and KDA (decay per key channel).
The design in full: DESIGN.md section 6, "The gated delta rule".
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .checks import check_contiguous, check_launchable, check_ragged, check_tensor
from .dependent_launch import after_previous, launch_options
from .one_row_commit import commits, rows_to_roll
from .rounding import cast_rtne
from .runtime import interpreting

MAX_D_K = 256  # the whole key dim is one register tile: no split of the sum over D_K
MAX_SUM_LEVELS = tl.constexpr(MAX_D_K.bit_length() - 2)  # sum_halves' pairwise levels after its first: MAX_D_K / 2 rows to 1


class DeltaRuleConfig(NamedTuple):
    BLOCK_K: int
    BLOCK_V: int
    num_warps: int


ONE_SEQUENCE_MIN_ROWS = 5  # from these rows a one-sequence launch takes the narrow tile


def delta_rule_config(d_k: int, d_v: int, sequences: int = 0, rows: int = 0) -> DeltaRuleConfig:
    """The tile for a launch over `sequences` sequences of `rows` rows in all. The full key dim per
    tile; at most 32 value columns (a 128 x 32 fp32 tile is 32 registers a thread in 4 warps), so a
    128 x 128 head runs as 4 programs per (sequence, head) to spread a decode over the SMs; tiles
    under 2048 values use one warp. One sequence of at least ONE_SEQUENCE_MIN_ROWS rows (a batch-1
    verify: its walk's latency is the launch's) takes 16 columns in 2 warps, 2 of its 4 sums'
    levels across warps instead of 4: faster from 5 rows on, slower at 2 rows, hence the bound
    (H200, 2B GDN shape). Every tile gives the same bits (`sum_halves`); the 32-column tile is the
    fastest, or close to it, at 1 to 64 sequences otherwise. `python -m bench.gpu` times the steps."""
    block_k = triton.next_power_of_2(d_k)
    narrow = sequences == 1 and rows >= ONE_SEQUENCE_MIN_ROWS
    block_v = min(16 if narrow else 32, triton.next_power_of_2(d_v))
    return DeltaRuleConfig(BLOCK_K=block_k, BLOCK_V=block_v, num_warps=(2 if narrow else 4) if block_k * block_v >= 2048 else 1)


@triton.jit
def halve(b_x):
    """[N, BLOCK_V] -> its rows 0 .. N/2 - 1 and its rows N/2 .. N - 1, each [N/2, BLOCK_V]. Where a
    thread holds both rows of each pair (the first halvings, in the state tile's register layout)
    no data moves; the last ones pair rows of other warps, which the compiler exchanges."""
    N: tl.constexpr = b_x.shape[0]
    return tl.split(tl.permute(tl.reshape(b_x, [2, N // 2, b_x.shape[1]]), (1, 2, 0)))


@triton.jit
def unhalve(b_lo, b_hi):
    """halve's inverse: [N, BLOCK_V] twice -> [2N, BLOCK_V], b_lo's rows first."""
    N: tl.constexpr = b_lo.shape[0]
    return tl.reshape(tl.permute(tl.join(b_lo, b_hi), (2, 0, 1)), [2 * N, b_lo.shape[1]])


@triton.jit
def sum_halves(b_lo_s, b_hi_s, b_lo_x, b_hi_x):
    """sum_k S[k, :] * x[k] -> [BLOCK_V] of S and x split into halves: row k + N/2's product added
    to row k's in one fused multiply-add, then the [N/2, BLOCK_V] partial sums added pairwise,
    row j + n/2 to row j, down to one row. The order is written out, so the sum's bits depend on
    BLOCK_K alone, not on which threads hold which rows (tl.sum's order follows the register
    layout, which the tile shape and num_warps pick). It is also shallower than a sum along a
    thread's registers: a shorter, shallower walk, faster where rows walk and even at 64 decodes
    (H200, 2B GDN shape; `python -m bench.gpu` times the steps)."""
    b_p = tl.fma(b_lo_s, b_lo_x, b_hi_s * b_hi_x)  # [N/2, BLOCK_V]
    for _ in tl.static_range(MAX_SUM_LEVELS):  # N/2 rows, a power of two, halved to 1 (unrolled)
        if b_p.shape[0] > 1:
            b_lo, b_hi = halve(b_p)
            b_p = b_lo + b_hi
    return tl.reshape(b_p, [b_p.shape[1]])


@triton.jit
def _update_state(b_s, b_k, b_v, b_decay, b_beta, DECAY_K: tl.constexpr):
    """Apply one row to a state tile: b_s [BLOCK_K, BLOCK_V] fp32, b_k [BLOCK_K], b_v [BLOCK_V],
    b_decay [BLOCK_K] (KDA) or a scalar (GDN, DECAY_K 1: its head's one decay), b_beta scalar -> the new b_s.
    Mirrors the reference `update_state` below; the one function decode, verify and fold apply a row with."""
    if DECAY_K == 1:
        b_s = b_s * b_decay  # the same products as a broadcast [BLOCK_K] of it, without its registers
    else:
        b_s = b_s * b_decay[:, None]
    b_lo_s, b_hi_s = halve(b_s)
    b_lo_k, b_hi_k = halve(tl.broadcast_to(b_k[:, None], b_s.shape))
    b_recalled = sum_halves(b_lo_s, b_hi_s, b_lo_k, b_hi_k)  # [BLOCK_V]
    b_delta = tl.broadcast_to(((b_v - b_recalled) * b_beta)[None, :], b_lo_s.shape)
    # b_s + k delta^T as one fused multiply-add an element (one rounding, one instruction): written
    # out, since contraction is off and every walk must give these bits; it is also faster than a
    # separate multiply and add at 64 sequences x 9 rows (H200, 2B GDN shape). On the
    # halves the key was split into for the sum, so the key reaches one register layout once a row.
    return unhalve(tl.fma(b_lo_k, b_delta, b_lo_s), tl.fma(b_hi_k, b_delta, b_hi_s))


@triton.jit
def _read_state(b_s, b_q):
    """b_s [BLOCK_K, BLOCK_V], b_q [BLOCK_K] -> out [BLOCK_V] = sum_k S[k, :] * q[k], in sum_halves' order."""
    b_lo_s, b_hi_s = halve(b_s)
    b_lo_q, b_hi_q = halve(tl.broadcast_to(b_q[:, None], b_s.shape))
    return sum_halves(b_lo_s, b_hi_s, b_lo_q, b_hi_q)


@triton.jit
def state_tile(i_v, D_K: tl.constexpr, D_V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """A program's [BLOCK_K, BLOCK_V] tile of one head's state (value block i_v) -> key offsets o_k
    [BLOCK_K], value offsets o_v [BLOCK_V], their masks m_k, m_v, the tile's mask m_s and offsets
    o_s within the head's [D_K, D_V] state."""
    o_k = tl.arange(0, BLOCK_K)  # [BLOCK_K] key channels
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V] value channels
    m_k = o_k < D_K
    m_v = o_v < D_V
    m_s = m_k[:, None] & m_v[None, :]
    o_s = o_k[:, None] * D_V + o_v[None, :]  # [BLOCK_K, BLOCK_V] within one head's state
    return o_k, o_v, m_k, m_v, m_s, o_s


@triton.jit
def _load_stash_row(p_key, p_value, p_decay, p_beta, o_k, o_v, m_k, m_v, DECAY_K: tl.constexpr):
    """One row's key [BLOCK_K], value [BLOCK_V], decay ([BLOCK_K], or GDN's scalar) and beta (scalar) of one head (each
    pointer at that row and head's first channel). The walks below load row t + 1 while row t is
    applied (the last row loads itself again, unused), so no row waits for its own loads."""
    b_k = tl.load(p_key + o_k, mask=m_k, other=0.0)
    b_v = tl.load(p_value + o_v, mask=m_v, other=0.0)
    if DECAY_K == 1:
        # a scalar: its [BLOCK_K] broadcast (and the next row's) held registers that cost occupancy
        # (faster at 64 sequences x 9 rows, the same bits; `python -m bench.gpu` times those steps)
        b_decay = tl.load(p_decay)
    else:
        b_decay = tl.load(p_decay + o_k, mask=m_k, other=0.0)
    b_beta = tl.load(p_beta)
    return b_k, b_v, b_decay, b_beta


@triton.jit
def walk_rows(b_s, key, value, decay, beta, s_key, s_value, s_decay, s_beta, i_n, o_k, o_v, m_k, m_v, DECAY_K: tl.constexpr):
    """b_s advanced by i_n >= 1 stash rows of one head: key, value, decay, beta point at row 0's
    first channel of that head, rows s_key, s_value, s_decay, s_beta elements apart. Row t + 1 is
    loaded while row t is applied, as in the verify walk below: the same values reach
    `_update_state` in the same order. The fused fold's walk (kernels/fused_rollback.py)."""
    b_k, b_v, b_decay, b_beta = _load_stash_row(key, value, decay, beta, o_k, o_v, m_k, m_v, DECAY_K)
    for i_t in range(0, i_n):
        i_row = tl.where(i_t + 1 < i_n, i_t + 1, i_t).to(tl.int64)  # the next row (the last: itself again)
        n_k, n_v, n_decay, n_beta = _load_stash_row(key + i_row * s_key, value + i_row * s_value, decay + i_row * s_decay,
                                                    beta + i_row * s_beta, o_k, o_v, m_k, m_v, DECAY_K)
        b_s = _update_state(b_s, b_k, b_v, b_decay, b_beta, DECAY_K)
        b_k, b_v, b_decay, b_beta = n_k, n_v, n_decay, n_beta
    return b_s


@triton.jit
def _stash_rows(i_rh, key, value, decay, beta, H: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr,
                DECAY_K: tl.constexpr):
    """Pointers to the key, value, decay and beta of one head (head index i_rh) of a row: the walk
    steps them H heads a row."""
    return key + i_rh * D_K, value + i_rh * D_V, decay + i_rh * DECAY_K, beta + i_rh


_NO_ALIGNMENT = ["state", "query", "key", "value", "decay", "beta", "out", "snapshots", "carry_key", "carry_value",
                 "carry_decay", "carry_beta"]


# scratch_slot is not specialised on either: its value (the pool's size, or -1) must not pick another compiled kernel
@triton.jit(do_not_specialize=["scratch_slot"], do_not_specialize_on_alignment=_NO_ALIGNMENT)
def _delta_rule_kernel(
    state, query, key, value, decay, beta, seq_slots, cu_rows, consumed, out, snapshots, scratch_slot,
    carried, carry_key, carry_value, carry_decay, carry_beta,
    H: tl.constexpr,
    D_K: tl.constexpr,
    D_V: tl.constexpr,
    DECAY_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    FOLD: tl.constexpr,  # False: verify (rows of cu_rows, store out); True: fold (first consumed rows, store state)
    STORE_SNAPSHOTS: tl.constexpr,
    COMMIT: tl.constexpr,  # verify of rows all consumed (prefill): the state after the last row is stored too
    CARRY_ROWS: tl.constexpr,  # verify: C > 0, each slot's carried stash rows (C a slot) go first; 0: none
    INTERPRET: tl.constexpr,  # the interpreter truncates fp32 -> bf16: out is rounded on the bits first there
    PDL: tl.constexpr,
):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_s = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    i_slot = tl.load(seq_slots + i_s).to(tl.int64)
    i_bos = tl.load(cu_rows + i_s)
    if FOLD:
        i_rows = rows_to_roll(cu_rows, consumed, i_s)
    else:
        i_rows = tl.load(cu_rows + i_s + 1) - i_bos
    if i_rows == 0:
        # a padding sequence (graph buckets), or a fold with nothing to do: no state tile is read, nothing is stored
        return
    i_bos = i_bos.to(tl.int64)

    o_k, o_v, m_k, m_v, m_s, o_s = state_tile(i_v, D_K, D_V, BLOCK_K, BLOCK_V)

    p_state = state + (i_slot * H + i_h) * (D_K * D_V) + o_s
    b_s = tl.load(p_state, mask=m_s, other=0.0)  # padded lanes are 0 and stay 0
    i_carried = 0  # the slot's carried rows (verifier/model/rollback.py): walked first, then committed
    i_ch = i_h.to(tl.int64)  # row 0 of the slot's carry, this head
    if CARRY_ROWS > 0:
        i_carried = tl.load(carried + i_s)
        i_ch = (i_slot * CARRY_ROWS) * H + i_h
    i_rh = i_bos * H + i_h  # row 0's head
    i_walk = i_carried + i_rows

    # One walk over the carried rows, then the step's rows: one loop, one set of prefetch registers
    # (a loop of their own before this one is slower: more registers held across two loops). Row t + 1's inputs are
    # loaded while row t is applied (the last row loads itself again, unused): the same values reach
    # _update_state in the same order as a walk that loads each row when it applies it, and the
    # carried rows' as the fold's `walk_rows`.

    # the step's row 0 (head i_rh), where the walk starts unless the slot carries rows (head i_ch of its row 0)
    r_k, r_v, r_decay, r_beta = _stash_rows(i_rh, key, value, decay, beta, H, D_K, D_V, DECAY_K)
    p_k, p_v, p_decay, p_beta = r_k, r_v, r_decay, r_beta
    if CARRY_ROWS > 0:
        c_k, c_v, c_decay, c_beta = _stash_rows(i_ch, carry_key, carry_value, carry_decay, carry_beta, H, D_K, D_V, DECAY_K)
        first_carried = i_carried > 0
        p_k, p_v = tl.where(first_carried, c_k, r_k), tl.where(first_carried, c_v, r_v)
        p_decay, p_beta = tl.where(first_carried, c_decay, r_decay), tl.where(first_carried, c_beta, r_beta)
    b_k, b_v, b_decay, b_beta = _load_stash_row(p_k, p_v, p_decay, p_beta, o_k, o_v, m_k, m_v, DECAY_K)
    p_q = query + i_rh * D_K  # the step's row 0's query, which carried rows load too (unused)
    if not FOLD:
        b_q = tl.load(p_q + o_k, mask=m_k, other=0.0)
    for i_t in range(0, i_walk):
        # the next row's pointers stepped from this row's: one row on (H heads), from the last carried
        # row to the step's row 0, past the last row this one again. Stepped, not computed from the
        # row's index: fewer instructions a row on sm_90, the same bits. Row 0's pointers are kept
        # (r_k ...) rather than recomputed for the jump, for the same reason
        i_next = i_t + 1
        more = i_next < i_walk
        jump = i_next == i_carried
        p_k = tl.where(more, tl.where(jump, r_k, p_k + H * D_K), p_k)
        p_v = tl.where(more, tl.where(jump, r_v, p_v + H * D_V), p_v)
        p_decay = tl.where(more, tl.where(jump, r_decay, p_decay + H * DECAY_K), p_decay)
        p_beta = tl.where(more, tl.where(jump, r_beta, p_beta + H), p_beta)
        p_q = tl.where(more & (i_next > i_carried), p_q + H * D_K, p_q)
        n_k, n_v, n_decay, n_beta = _load_stash_row(p_k, p_v, p_decay, p_beta, o_k, o_v, m_k, m_v, DECAY_K)
        if not FOLD and CARRY_ROWS > 0:
            # the next query: loaded before the update with a carry, after it without one; each the
            # faster schedule, with or without carried rows, the same bits (`python -m bench.gpu`)
            n_q = tl.load(p_q + o_k, mask=m_k, other=0.0)
        b_s = _update_state(b_s, b_k, b_v, b_decay, b_beta, DECAY_K)
        step_row = True  # a row of this step, not a carried one
        if CARRY_ROWS > 0:
            step_row = i_t >= i_carried
            if i_t + 1 == i_carried and i_rows > 1:
                # the carried rows committed, as their fold would have; one row stores its state once, below
                tl.store(p_state, b_s, mask=m_s)
        if not FOLD:
            if CARRY_ROWS == 0:
                n_q = tl.load(p_q + o_k, mask=m_k, other=0.0)
            if step_row:
                i_row = i_rh + (i_t - i_carried) * H  # its head
                b_out = cast_rtne(_read_state(b_s, b_q), out.dtype.element_ty, INTERPRET)  # fp32, or rounded to bf16
                tl.store(out + i_row * D_V + o_v, b_out, mask=m_v)
                if STORE_SNAPSHOTS:
                    tl.store(snapshots + i_row * (D_K * D_V) + o_s, b_s, mask=m_s)
            b_q = n_q
        b_k, b_v, b_decay, b_beta = n_k, n_v, n_decay, n_beta

    if FOLD or COMMIT:  # the same walk's state: a verify that commits stores the bits a fold of all its rows would
        tl.store(p_state, b_s, mask=m_s)
    elif commits(i_rows, i_slot, scratch_slot):  # a one-row verify: kernels/one_row_commit.py
        tl.store(p_state, b_s, mask=m_s)


def check_state_rows(op: str, state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, launch: bool = True
                     ) -> tuple[int, int, int, int]:
    """The state (fp32 [n_slots, H, D_K, D_V], contiguous; launch: launchable too) and the rows' keys
    [R, H, D_K] and values [R, H, D_V] (fp32, on the state's device) of a delta-rule walk -> (R, H,
    D_K, D_V). What every walk's launcher checks first (this module's, the chunked prefill's)."""
    if state.dim() != 4:
        raise ValueError(f"{op}: state must be 4-D [n_slots, H, D_K, D_V], got shape {list(state.shape)}")
    if state.dtype != torch.float32:
        raise ValueError(f"{op}: state must be float32, got {state.dtype}")
    if launch:
        check_launchable(op, "state", state)
    check_contiguous(op, "state", state)
    _, heads, d_k, d_v = state.shape
    if d_k > MAX_D_K:
        raise ValueError(f"{op}: D_K {d_k} > {MAX_D_K}: the key dim must fit one register tile")
    if key.dim() != 3:
        raise ValueError(f"{op}: key must be 3-D [R, H, D_K], got shape {list(key.shape)}")
    rows, on_state = key.shape[0], ("state", state)
    check_tensor(op, "key", key, (rows, heads, d_k), torch.float32, on_state, layout="[R, H, D_K]")
    check_tensor(op, "value", value, (rows, heads, d_v), torch.float32, on_state, layout="[R, H, D_V]")
    return rows, heads, d_k, d_v


def _check(op: str, state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
           seq_slots: torch.Tensor, cu_rows: torch.Tensor) -> None:
    """Shapes, dtypes and devices of what both launchers take. Row bounds and slot values live on
    the device and are not checked (that would sync)."""
    rows, heads, d_k, _ = check_state_rows(op, state, key, value)
    f32, on_state = torch.float32, ("state", state)
    if decay.dim() != 3 or decay.shape[2] not in (1, d_k):
        raise ValueError(f"{op}: decay must be [R, H, 1 or D_K={d_k}], got shape {list(decay.shape)}")
    check_tensor(op, "decay", decay, (rows, heads, decay.shape[2]), f32, on_state)
    check_tensor(op, "beta", beta, (rows, heads), f32, on_state, layout="[R, H]")
    check_ragged(op, seq_slots, cu_rows, on_state)


def _launch(state, query, key, value, decay, beta, seq_slots, cu_rows, consumed, out, snapshots, fold: bool,
            scratch_slot: int | None, carried: torch.Tensor | None = None, carry: tuple | None = None,
            config: DeltaRuleConfig | None = None, commit: bool = False) -> None:
    n_seqs, (_, heads, d_k, d_v) = seq_slots.shape[0], state.shape
    if n_seqs == 0 or key.shape[0] == 0:
        return
    cfg = config or delta_rule_config(d_k, d_v, n_seqs, key.shape[0])
    grid = (n_seqs, heads, triton.cdiv(d_v, cfg.BLOCK_V))
    _delta_rule_kernel[grid](
        state, query.contiguous(), key.contiguous(), value.contiguous(), decay.contiguous(), beta.contiguous(),
        seq_slots, cu_rows, consumed, out, snapshots if snapshots is not None else out,  # never stored when None
        -1 if scratch_slot is None else scratch_slot,
        *((carried, *carry) if carry is not None else (cu_rows, state, state, state, state)),  # never read without a carry
        H=heads, D_K=d_k, D_V=d_v, DECAY_K=decay.shape[2], BLOCK_K=cfg.BLOCK_K, BLOCK_V=cfg.BLOCK_V,
        FOLD=fold, STORE_SNAPSHOTS=snapshots is not None, COMMIT=commit, CARRY_ROWS=0 if carry is None else carry[0].shape[1],
        INTERPRET=interpreting(),
        num_warps=cfg.num_warps, num_stages=1, enable_fp_fusion=False, **launch_options(state.device),
    )


def delta_rule_verify(state: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      decay: torch.Tensor, beta: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor,
                      snapshots: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      scratch_slot: int | None = None, carried: torch.Tensor | None = None,
                      carry: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                      config: DeltaRuleConfig | None = None, *, commit: bool = False) -> torch.Tensor:
    """Every row of a ragged batch through the delta rule from its slot's committed state -> out
    [R, H, D_V] fp32. state is written only by one-row sequences (their row is committed), except
    in scratch_slot (None: no slot is exempt); commit (prefill, every row consumed): every sequence
    stores its state after its last row, the bits delta_rule_fold of all its rows stores, in one walk. snapshots, if given, receives the state after each
    row. out: an optional contiguous [R, H, D_V] fp32 or bf16 buffer to write into; it is returned.
    carry: (keys [n_slots, C, H, D_K], values [.., D_V], decays [.., DECAY_K], betas [n_slots, C, H])
    fp32 with carried int32 [S]: sequence s first applies its slot's first carried[s] carry rows
    and commits the result (verifier/model/rollback.py); its rows then start from there.
    config: another tile than delta_rule_config's (tests: every tile gives the same bits); its
    BLOCK_K must be delta_rule_config's, the one that fixes the sums' order."""
    op = "delta_rule_verify"
    _check(op, state, key, value, decay, beta, seq_slots, cu_rows)
    rows, heads, d_k = key.shape
    d_v = state.shape[3]
    on_state = ("state", state)
    check_tensor(op, "query", query, (rows, heads, d_k), torch.float32, on_state, layout="[R, H, D_K]")
    if out is not None:
        out_dtype = torch.bfloat16 if out.dtype == torch.bfloat16 else torch.float32
        check_tensor(op, "out", out, (rows, heads, d_v), out_dtype, on_state, layout="[R, H, D_V]", contiguous=True)
    if snapshots is not None:
        check_tensor(op, "snapshots", snapshots, (rows, heads, d_k, d_v), torch.float32, on_state,
                     layout="[R, H, D_K, D_V]", contiguous=True)
    if (carry is None) != (carried is None):
        raise ValueError(f"{op}: carry and carried come together")
    if commit and carry is not None:
        raise ValueError(f"{op}: commit is prefill's, which carries no rows: pass no carry with it")
    if carry is not None:
        _check_carry(op, carry, carried, state, decay.shape[2], seq_slots)
    if config is not None and config.BLOCK_K != delta_rule_config(d_k, d_v).BLOCK_K:
        raise ValueError(f"{op}: config BLOCK_K {config.BLOCK_K} is not the {delta_rule_config(d_k, d_v).BLOCK_K} "
                         f"that D_K {d_k} sums over")
    if out is None:
        out = torch.empty(rows, heads, d_v, dtype=torch.float32, device=state.device)
    # consumed is never read in verify: cu_rows stands in for it
    _launch(state, query, key, value, decay, beta, seq_slots, cu_rows, cu_rows, out, snapshots, fold=False,
            scratch_slot=scratch_slot, carried=carried, carry=carry, config=config, commit=commit)
    return out


def carry_shapes(n_slots: int, rows: int, heads: int, d_k: int, d_v: int, decay_k: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of a pool's carried rows (keys, values, decays, betas), C = `rows` a slot: what a
    verify with a carry reads and verifier/model/state.py allocates."""
    return (n_slots, rows, heads, d_k), (n_slots, rows, heads, d_v), (n_slots, rows, heads, decay_k), (n_slots, rows, heads)


def _check_carry(op: str, carry: tuple, carried: torch.Tensor, state: torch.Tensor, decay_k: int, seq_slots: torch.Tensor) -> None:
    n_slots, heads, d_k, d_v = state.shape
    if len(carry) != 4 or carry[0].dim() != 4:
        raise ValueError(f"{op}: carry must be (keys [n_slots, C, H, D_K], values, decays, betas)")
    on_state = ("state", state)
    shapes = carry_shapes(n_slots, carry[0].shape[1], heads, d_k, d_v, decay_k)
    for name, t, shape in zip(("carry keys", "carry values", "carry decays", "carry betas"), carry, shapes):
        check_tensor(op, name, t, shape, torch.float32, on_state, contiguous=True)
    check_tensor(op, "carried", carried, seq_slots.shape, torch.int32, on_state, layout="[S]")


def delta_rule_fold(state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                    seq_slots: torch.Tensor, cu_rows: torch.Tensor, consumed: torch.Tensor) -> None:
    """In place: state[seq_slots[s]] advanced by the first consumed[s] rows of sequence s, with the
    update verify applies (consumed[s] = 0, or s of one row, which its verify committed:
    state[seq_slots[s]] untouched). consumed[s] in 0 .. rows of s is not checked (that would sync)."""
    op = "delta_rule_fold"
    _check(op, state, key, value, decay, beta, seq_slots, cu_rows)
    check_tensor(op, "consumed", consumed, seq_slots.shape, torch.int32, ("state", state), layout="[S]")
    # query and out are never touched in a fold: key and value stand in for them
    _launch(state, key, key, value, decay, beta, seq_slots, cu_rows, consumed, value, None, fold=True, scratch_slot=None)


def update_state(state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """state [heads, d_k, d_v]; key [heads, d_k]; value [heads, d_v]; decay [heads, d_k or 1, 1]; beta [heads].
    The reference backend's update of one row, all heads at once: `_update_state`'s ops in its order."""
    state = state * decay
    recalled = (state * key[..., None]).sum(dim=-2)  # [heads, d_v]
    delta = (value - recalled) * beta[..., None]
    return state + key[..., None] * delta[..., None, :]


def read_state(state: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """state [heads, d_k, d_v]; query [heads, d_k] -> [heads, d_v]: `_read_state` in torch."""
    return (state * query[..., None]).sum(dim=-2)


def delta_rule_verify_ref(state: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          decay: torch.Tensor, beta: torch.Tensor, seq_slots: torch.Tensor, cu_rows: torch.Tensor,
                          snapshots: torch.Tensor | None = None, out: torch.Tensor | None = None,
                          scratch_slot: int | None = None, carried: torch.Tensor | None = None,
                          carry: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                          config: DeltaRuleConfig | None = None, *, commit: bool = False) -> torch.Tensor:
    """delta_rule_verify in torch: each sequence's rows one at a time from its slot's state (after
    its carried rows, committed); a one-row sequence outside scratch_slot commits its row, and
    with commit every sequence its last. config: taken for the launcher's signature (a tile
    changes no value)."""
    if commit and carry is not None:
        raise ValueError("delta_rule_verify: commit is prefill's, which carries no rows: pass no carry with it")
    rows, heads, d_v = value.shape
    if out is None:
        out = torch.empty(rows, heads, d_v, dtype=torch.float32, device=state.device)
    bounds = cu_rows.tolist()
    carried = [0] * len(bounds) if carried is None else carried.tolist()
    for s, slot in enumerate(seq_slots.tolist()):
        s_state = state[slot]
        if carried[s] and bounds[s + 1] > bounds[s]:
            keys, values, decays, betas = carry
            for i in range(carried[s]):
                s_state = update_state(s_state, keys[slot, i], values[slot, i], decays[slot, i][..., None], betas[slot, i])
            if bounds[s + 1] - bounds[s] > 1:
                state[slot] = s_state
        for i in range(bounds[s], bounds[s + 1]):
            s_state = update_state(s_state, key[i], value[i], decay[i][..., None], beta[i])
            out[i] = read_state(s_state, query[i])
            if snapshots is not None:
                snapshots[i] = s_state
        if (commit and bounds[s + 1] > bounds[s]) or (bounds[s + 1] - bounds[s] == 1 and slot != scratch_slot):
            state[slot] = s_state
    return out


def delta_rule_fold_ref(state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                        seq_slots: torch.Tensor, cu_rows: torch.Tensor, consumed: torch.Tensor) -> None:
    """delta_rule_fold in torch: WOA rollback's loop over the stash rows 0 .. consumed[s]-1."""
    bounds = cu_rows.tolist()
    for s, (slot, n) in enumerate(zip(seq_slots.tolist(), consumed.tolist())):
        if n == 0 or bounds[s + 1] - bounds[s] == 1:  # a padding sequence, or one whose verify committed its row
            continue
        s_state = state[slot]
        for i in range(bounds[s], bounds[s] + n):
            s_state = update_state(s_state, key[i], value[i], decay[i][..., None], beta[i])
        state[slot] = s_state
