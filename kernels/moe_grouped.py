"""The routed experts grouped by expert: each expert's weight tiles are read once per block of the
(row, slot) pairs routed to it, for every row count (decode included). kernels/moe.py states the
formulas and the contract and checks the arguments; this module computes them.
The design in full: DESIGN.md section 6, "The grouped experts".
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .dependent_launch import after_previous, launch_options
from .linear import dot_acc
from .linear_fp8 import BlockScales, dequantize_tile, raw_bf16, scale_row_offsets, scale_step
from .moe_route import Routing, add_pairs
from .rounding import cast_rtne
from .runtime import interpreting

NO_EXPERT = tl.constexpr(2**62)  # above every expert id: masked slots and "no id left"


# experts per routing slot from which blocks are 16 rows whatever the dtype (grouped_config)
MANY_EXPERTS_PER_SLOT = 8

# Up to FEW_ROWS rows (a decode, or a verify of up to FEW_ROWS - 1 drafts, of one sequence) block-FP8
# experts of many take FEW_ROWS_LAUNCH's launch fields (`launch_for_rows`): the grid follows the
# row count, the arithmetic does not. From `python -m bench.fp8_configs --screen rows`: 32-feature
# stage-1 tiles with four warps and four stages, 64-feature stage-2 tiles with four warps, and
# 128-feature combine programs (a row's combine over 16 programs, not 2). On the H200 it beat the
# earlier pin (three stages, 128-feature stage-2 tiles) by 18% at one row and 5% at four
# (bench/results/fp8_configs_2026-12-07_Qwen3.6-35B-A3B_few-rows-warps-h200.json), and more warps
# (8 in either stage) lost; in the engine it took a decode of one row from 3.37 to 3.05 ms with the
# gate green (fp8_real_size_2026-12-07_qwen3.6-35b-a3b_few-rows-candidates-h200.json). The H100's screen
# prefers 32-feature stage-2 tiles by 3% at one row, within its noise, and the engine there with this
# pin decodes one row in 3.24 ms against 3.49 (fp8_configs_2026-12-07_Qwen3.6-35B-A3B_few-rows-warps-h100.json,
# fp8_real_size_2026-12-07_qwen3.6-35b-a3b_h100-few-rows-pin.json): one pin serves both.
FEW_ROWS = 16
LAUNCH_FIELDS = ("BLOCK_N", "BLOCK_N2", "BLOCK_H", "num_warps", "num_stages", "num_warps2", "num_stages2")
FEW_ROWS_LAUNCH: dict[str, int] = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4, "BLOCK_N2": 64, "num_warps2": 4, "BLOCK_H": 128}
# From MANY_ROWS rows on (64 decoding sequences, verifies of a full batch) MANY_ROWS_LAUNCH's fields,
# which may also take blocks of 32 pairs (MMA_SYNC_ROWS): each expert tile is then dequantized once
# per 32 pairs instead of 16, with the same mma.sync instruction (16 rows each) and K walks. Empty:
# the screen found none faster than the pinned launch at 64 and 576 rows (32-pair blocks were 4-34%
# slower on the H100, whatever their warps and feature tiles).
MANY_ROWS = 64
MANY_ROWS_LAUNCH: dict[str, int] = {}
MMA_SYNC_ROWS = 32  # the most pairs a block may take: past it Triton multiplies with wgmma, whose bits differ here
# A prefill's block-FP8 experts of many (`grouped_experts(prefill=True)`): blocks of 64 pairs and
# wider feature tiles, so a chunk of a few thousand rows reads each expert's tiles a few times, not
# once per 16 pairs. The blocks multiply with wgmma, whose sums are not mma.sync's: a prefill row's
# bits are then not a decode's, which prefill need not give (DESIGN.md section 6), but the same under
# any batching of prompts (the instruction and the K walks are fixed; a pair's block does not change
# its arithmetic). Every prefill launch takes it, whatever its rows, where the model asks for it
# (verifier/model/layers/mlp.py, PREFILL_EXPERT_TILES).
PREFILL_LAUNCH: dict[str, int] = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_N2": 128, "num_warps": 4, "num_stages": 3,
                                  "num_warps2": 4, "num_stages2": 3}


class GroupedConfig(NamedTuple):
    BLOCK_M: int  # pairs per block (16: mma.sync, 64: wgmma); MANY_ROWS_LAUNCH may raise 16 to MMA_SYNC_ROWS
    BLOCK_N: int  # stage 1: hidden features per program
    BLOCK_K: int  # stage 1: the step of the walk over H
    BLOCK_N2: int  # stage 2: output features per program
    BLOCK_K2: int  # stage 2: the step of the walk over I
    BLOCK_H: int  # combine: output features per program
    num_warps: int  # stage 1 and the combine
    num_stages: int  # stage 1
    num_warps2: int  # stage 2
    num_stages2: int  # stage 2


def _fit(block: int, n: int) -> int:
    """A tile of `block` along a dimension of n: at most the next power of two of n, at least 16 (tl.dot's minimum)."""
    return max(16, min(block, triton.next_power_of_2(n)))


def many_experts(n_experts: int, top_k: int) -> bool:
    """Routers of many experts per slot (the published Qwen3-Next, Qwen3.5-MoE and Kimi Linear ones)."""
    return bool(n_experts and top_k and n_experts >= MANY_EXPERTS_PER_SLOT * top_k)


def grouped_config(h: int, i: int, dtype: torch.dtype, n_experts: int = 0, top_k: int = 0, fp8: bool = False) -> GroupedConfig:
    """The pinned config for experts of hidden size h and intermediate size i; never a function of
    the row count.

    Chosen by the reasoning below, not by a sweep of candidates: before changing it, compare
    BLOCK_M 64/128, BLOCK_N 32/64, num_stages 3/4 in the grouped kernels' GPU time from
    `python -m bench.gpu --models qwen3next_moe,kimi_moe` (its kernel breakdown) and
    `python -m bench.fp8_real_size` (its kernel_breakdowns), which run them as the engine does.
    bf16: BLOCK_M 64 rows is one wgmma warpgroup tile; at a batch-64 K = 8 verify of 2-of-8
    experts (~144 pairs an expert) an expert's tiles are read 3 times, not 144. The feature
    tiles are narrow (32) so that a decode, 2 pairs in 2 blocks, still spreads an expert's
    weights over 2 * 2048 / 32 = 128 programs to stream them. fp32 (tests, the interpreter) uses
    the FMA dot of input_precision="ieee": BLOCK_M 16 keeps its tiles in registers.
    Small H or I shrink the tiles to the next power of two, at least 16 (tl.dot's minimum).
    Changing a config changes the CUDA backend's bits (another association of the K sums), never
    the row-invariance contract.
    Many experts (n_experts >= MANY_EXPERTS_PER_SLOT x top_k: the published Qwen3-Next, Qwen3.5-MoE
    and Kimi Linear routers, 256-512 experts for 8-10 slots) get 16-row blocks in bf16 too: a
    batch-64 K = 8 verify gives an expert ~18 pairs there, and a 64-row block padded from a few
    pairs spends the MMAs on padding (on the 35B FP8 config, 256 experts, top 8, 64-row blocks
    were slower at batch 1 and at batch 64; `python -m bench.fp8_real_size` times it). The block is
    still a function of the weights' shapes only.
    FP8 weights with many experts take 128-wide K steps in both stages (64 features in stage 1, 128
    in stage 2): a tile dequantized in registers wants more bytes per step than the bf16 one.
    `python -m bench.fp8_configs` screened each stage's tiles at 1, 9, 64 and 576 rows in CUDA
    graphs over distinct layers (bench/results/fp8_configs_2026-12-06_Qwen3.6-35B-A3B.json), and
    `python -m bench.fp8_real_size --candidates` chose in the engine on an H100: stage 1 at 32
    features was faster at one row and slower at 576 rows; 64 features with the 128-feature
    stage 2 was faster at every step than 64/64 with 64-wide K steps (bench/results/
    fp8_real_size_2026-12-06_qwen3.6-35b-a3b.json). Loading the next K step's weight tiles ahead
    by hand, tried in that screen, was slower at every row count: Triton already pipelines them
    (cp.async), and a hand-loaded tile takes that away. x's rows are pipelined the same way: x is
    16-byte aligned (kernels/moe.py copies it otherwise: `contiguous_aligned`) and specialised on it, so its gather is
    asynchronous too (the same bits: the same values reach the same dots), and whole tiles load
    without masks: stage 1 spent 17% and 21% less at a batch-64 decode and K = 8 verify, 1-8% less at
    1 to 9 rows but for the 4-row verify (10% more), on one H200 against the masked, hand-loaded
    stage 1 (bench/results/fp8_real_size_2026-12-06_qwen3.6-35b-a3b_h200*.json). There a padded
    pair (past its expert's count) read row 0 of x, and stage 2 without masks read pair 0's hidden
    row in its place and was 3-25% slower at 1 to 64 rows (..._h200-unmasked-stage-2.json): a block of one pair read its row 16
    times. Both stages now mask the pairs only (cp.async fills a masked row with zeros, reading
    nothing) and whole tiles drop the masks along K and the features.
    """
    block_m, block_k, num_stages = (64, 64, 3) if dtype == torch.bfloat16 else (16, 32, 2)
    block_n = block_n2 = 32
    if many_experts(n_experts, top_k):
        block_m = 16
        if fp8 and dtype == torch.bfloat16:
            block_n, block_k, block_n2 = 64, 128, 128
    return GroupedConfig(
        BLOCK_M=block_m, BLOCK_N=_fit(block_n, i), BLOCK_K=_fit(block_k, h), BLOCK_N2=_fit(block_n2, h), BLOCK_K2=_fit(block_k, i),
        BLOCK_H=min(1024, triton.next_power_of_2(h)), num_warps=4, num_stages=num_stages, num_warps2=4, num_stages2=num_stages,
    )


def launch_for_rows(cfg: GroupedConfig, rows: int, h: int, i: int, few_rows_launch: dict[str, int] | None = None,
                    many_rows_launch: dict[str, int] | None = None) -> GroupedConfig:
    """The pinned config `cfg` of experts [E, i, h] with its launch for a batch of `rows` rows: up to
    FEW_ROWS rows FEW_ROWS_LAUNCH's feature tiles, warps and stages (or few_rows_launch's), from
    MANY_ROWS on MANY_ROWS_LAUNCH's (or many_rows_launch's, which may set BLOCK_M: 16 or
    MMA_SYNC_ROWS pairs a block, each 16 of them one mma.sync), fitted to the shape as
    grouped_config fits its own.

    Why the bits stay: what a pair computes is fixed by the MMA instruction (mma.sync, 16 rows, for
    blocks of 16 or 32 pairs), BLOCK_K and BLOCK_K2 (the K walks), none of which a launch changes
    (these launches are for block-FP8 experts of many, whose pinned blocks are 16 pairs). A feature tile
    decides which output features one program computes, the warps how the program's MMAs are laid
    out over them, the stages when tiles are loaded: each output element is still the same 16-wide
    K chunks added in the same order into one fp32 register. A block of 32 pairs is two 16-row
    mma.sync tiles of the same instruction. That is swept, not assumed: `python -m bench.fp8_configs
    --screen rows` keeps only candidates whose outputs equal the pinned launch's (torch.equal) at
    every row count it times, and `python -m bench.row_invariance` compares each row alone with the
    first M rows across FEW_ROWS and MANY_ROWS."""
    if rows <= FEW_ROWS:
        launch, fields_allowed = FEW_ROWS_LAUNCH if few_rows_launch is None else few_rows_launch, LAUNCH_FIELDS
    elif rows >= MANY_ROWS:
        launch, fields_allowed = MANY_ROWS_LAUNCH if many_rows_launch is None else many_rows_launch, ("BLOCK_M", *LAUNCH_FIELDS)
    else:
        return cfg
    if not launch:
        return cfg
    if launch.get("BLOCK_M", 16) not in (16, MMA_SYNC_ROWS):
        raise ValueError(f"a launch's BLOCK_M must be 16 or {MMA_SYNC_ROWS} (mma.sync), got {launch['BLOCK_M']}")
    return _with_launch(cfg, {f: v for f, v in launch.items() if f in fields_allowed}, h, i)


def _with_launch(cfg: GroupedConfig, fields: dict[str, int], h: int, i: int) -> GroupedConfig:
    """cfg with a launch's fields, its feature tiles fitted to the shape as grouped_config fits its own."""
    fields = dict(fields)
    for field, n in (("BLOCK_N", i), ("BLOCK_N2", h)):
        if field in fields:
            fields[field] = _fit(fields[field], n)
    if "BLOCK_H" in fields:
        fields["BLOCK_H"] = min(fields["BLOCK_H"], triton.next_power_of_2(h))
    return cfg._replace(**fields)


def prefill_config(cfg: GroupedConfig, h: int, i: int) -> GroupedConfig:
    """The pinned config `cfg` of block-FP8 experts of many [E, i, h] with PREFILL_LAUNCH's blocks,
    tiles, warps and stages, fitted to the shape as grouped_config fits its own; the K walks are cfg's."""
    return _with_launch(cfg, PREFILL_LAUNCH, h, i)


# Block-FP8 experts apply each block scale to a K step's fp32 sum of raw weights (`raw_bf16`)
# instead of dequantizing every weight, where the shapes allow (`scale_after`): about 1.5
# instructions a weight against 3.5, which the few-row steps are bound by (DESIGN.md section 6,
# "Where the FP8 step's time goes"). False: every shape dequantizes (the walk to compare with).
SCALE_AFTER_ON = True


def scale_after(k: int, n: int, block_k: int, scale_block_k: int) -> bool:
    """Whether a stage of K = k and n features applies its scales after each K step: whole K steps,
    each in one scale column, and features a multiple of 128 (whole tiles for every launch's feature
    tile). A function of the shapes and the pinned K step."""
    return k % block_k == 0 and scale_block_k % block_k == 0 and n % 128 == 0


# The scale-after walk of stage 1 sums H in this many parts apart and adds them in ascending order
# (`k_parts`: 1 or 2; 1 walks H as one sum). With two, a launch of up to FEW_ROWS rows splits each
# feature tile's parts over two programs (grid axis 2), the second to finish adding the first's
# sums to its own, and every other launch walks both parts in one program: the same bits either
# way (a sum of two cannot depend on its order), so a row's bits stay its own at every row count.
# The aim: at a few rows stage 1 is bound by its warps' chains of dependent instructions, one warp
# per scheduler (DESIGN.md section 6, "Why a few-row program is slow"), and two programs a tile
# give twice the warps, each with half the chain. Off until the engine shows it faster
# (`python -m bench.fp8_real_size --expert-k-parts 2`, `python -m bench.row_invariance --expert-k-parts 2`).
SCALE_AFTER_PARTS = 1


def k_parts(h: int, block_k: int, after: bool) -> int:
    """The parts stage 1's K walk over h sums apart: SCALE_AFTER_PARTS where the walk is scale-after
    and the parts are whole K steps, else 1. A function of the shapes."""
    return SCALE_AFTER_PARTS if after and h % (SCALE_AFTER_PARTS * block_k) == 0 else 1


class _PartBuffers:
    """Per device, the split stage 1's partial sums and tickets, grown as needed and kept: a ticket
    is 0 between launches (the second program to arrive sets it back), so one set serves every layer
    and every step on the device's stream. Made before a CUDA graph captures a launch that uses it
    (the engine runs each launch once before it captures)."""

    def __init__(self):
        self._by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device, partial_numel: int, tickets: int) -> tuple[torch.Tensor, torch.Tensor]:
        held = self._by_device.get(device)
        if held is None or held[0].numel() < partial_numel or held[1].numel() < tickets:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("grouped experts: the split stage 1's buffers must be made before a CUDA graph captures "
                                   "its launch (run the launch once first)")
            held = (torch.empty(max(partial_numel, 0 if held is None else held[0].numel()), dtype=torch.float32, device=device),
                    torch.zeros(max(tickets, 0 if held is None else held[1].numel()), dtype=torch.int32, device=device))
            self._by_device[device] = held
        return held


_PART_BUFFERS = _PartBuffers()


def block_bound(n_pairs: int, n_experts: int, block_m: int) -> int:
    """The most blocks n_pairs pairs over n_experts experts can need: with n experts owning pairs,
    sum of cdiv(count_e, block_m) <= n + (n_pairs - n) // block_m, largest at n = min(E, P)."""
    n = min(n_experts, n_pairs)
    return n + (n_pairs - n) // block_m


@triton.jit
def _expert_block(counts, lists, R, E_ALL: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    """A grouped kernel's opening: this program's block (program id 0) -> (its expert: an int32
    scalar, >= E_ALL past the last block; the pairs of the block: [BLOCK_M] int32; their mask:
    false past the expert's last pair). Expert e owns cdiv(counts[e], BLOCK_M) blocks, numbered in
    ascending expert order; block j of e holds entries j * BLOCK_M .. of its list (kernels/moe_route.py).
    It first waits for the kernel before (after_previous, before any global memory is touched:
    kernels/dependent_launch.py), whose output the lists are."""
    after_previous(PDL)
    i_b = tl.program_id(0)
    o_e = tl.arange(0, BLOCK_E)  # [BLOCK_E] one lane per expert (lanes >= E_ALL own no pair)
    b_count = tl.load(counts + o_e, mask=o_e < E_ALL, other=0)
    b_blocks = (b_count + BLOCK_M - 1) // BLOCK_M  # [BLOCK_E] blocks of each expert
    b_blocks_end = tl.cumsum(b_blocks, axis=0)  # [BLOCK_E] one past each expert's last block
    i_e = tl.sum((b_blocks_end <= i_b).to(tl.int32), axis=0)  # experts whose blocks all come before
    m_e = o_e == i_e
    first_block = tl.sum(tl.where(m_e, b_blocks_end - b_blocks, 0), axis=0)
    count = tl.sum(tl.where(m_e, b_count, 0), axis=0)
    o_q = (i_b - first_block) * BLOCK_M + tl.arange(0, BLOCK_M)  # entries of the expert's list
    m_p = o_q < count
    pairs = tl.load(lists + i_e.to(tl.int64) * R + o_q, mask=m_p, other=0)  # past the last block: count 0, nothing read
    return i_e, pairs, m_p


@triton.jit
def _scaled_dot(b_x, p_w, scale_inv, p_s, k0, b_acc, SCALE_BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """b_acc + (b_x @ raw(w tile)) * (its scale * 2^120): one K step of a walk that applies the block
    scale to the step's fp32 sum instead of to each weight (the step lies in one scale column)."""
    b_s = tl.load(scale_inv + p_s + k0 // SCALE_BLOCK_K)  # [1, BLOCK_N]
    b_w = raw_bf16(tl.load(p_w), INTERPRET)
    return scale_step(b_acc, dot_acc(b_x, b_w, tl.zeros([b_x.shape[0], b_w.shape[1]], dtype=tl.float32), INTERPRET), b_s)


@triton.jit
def _weight_tile(p_w, m_w, i_e, scale_inv, p_srow, m_srow, k0, o_kk,
                 stride_se, DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
                 FP8: tl.constexpr, SCALE_BLOCK_K: tl.constexpr, ONE_SCALE_COLUMN: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] tile of an expert's weight^T in DTYPE (FP8: dequantized in registers;
    p_srow [1, BLOCK_N]: each column's scale row offset within an expert's scales)."""
    if m_w is None:
        b_w = tl.load(p_w)
    else:
        b_w = tl.load(p_w, mask=m_w, other=0.0)
    if FP8:
        b_w = dequantize_tile(b_w, scale_inv, i_e * stride_se + p_srow, m_srow, k0, o_kk, m_w,
                              SCALE_BLOCK_K, ONE_SCALE_COLUMN, DTYPE, INTERPRET)
    return b_w


@triton.jit
def _scale_after_walk(p_x, p_g, p_u, p_gs, p_us, m_p, k_begin, k_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SCALE_BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """Stage 1's scale-after walk over K = k_begin .. k_end from zero sums: x's [BLOCK_M, BLOCK_K]
    and the gate's and up's [BLOCK_K, BLOCK_N] tiles of k_begin at p_x, p_g, p_u, their scale rows'
    offsets p_gs, p_us -> the fp32 sums (gate, up) [BLOCK_M, BLOCK_N]."""
    b_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        b_x = tl.load(p_x, mask=m_p[:, None], other=0.0)
        b_g = _scaled_dot(b_x, p_g, p_gs, 0, k0, b_g, SCALE_BLOCK_K, INTERPRET)
        b_u = _scaled_dot(b_x, p_u, p_us, 0, k0, b_u, SCALE_BLOCK_K, INTERPRET)
        p_x += BLOCK_K
        p_g += BLOCK_K
        p_u += BLOCK_K
    return b_g, b_u


@triton.jit
def _add_other_part(b_g, b_u, partials, tickets, b_pair, o_n, m_t, i_s, PARTIAL_ROWS: tl.constexpr, I: tl.constexpr):
    """Stage 1 with H in two parts walked by two programs (grid axis 2): this program's sums of its
    part (b_g, b_u [BLOCK_M, BLOCK_N]) go to partials [2 parts, 2 (gate, up), PARTIAL_ROWS pairs, I];
    the tile's ticket counts the programs done, and the second to arrive reads the other's sums and
    returns (own + other, for gate and up; a sum of two whose order cannot matter, so it equals the
    one-program walk's part 0 + part 1) and a mask of trues, after setting the ticket back to 0 for
    the next launch. The first returns a mask of falses: it stores nothing. Stores are made visible before the ticket's release (a
    barrier, then the acquire-release add); the other's sums are read past L1 (".cg")."""
    o_t = b_pair[:, None].to(tl.int64) * I + o_n[None, :]  # [BLOCK_M, BLOCK_N] within one part's gate or up
    p_own = partials + i_s * (2 * PARTIAL_ROWS * I) + o_t
    tl.store(p_own, b_g, mask=m_t)
    tl.store(p_own + PARTIAL_ROWS * I, b_u, mask=m_t)
    tl.debug_barrier()
    p_ticket = tickets + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    arrived = tl.atomic_add(p_ticket, 1, sem="acq_rel")
    last = (tl.zeros(m_t.shape, dtype=tl.int32) + arrived) == 1  # [BLOCK_M, BLOCK_N], a mask's shape
    if arrived == 1:
        p_other = partials + (1 - i_s) * (2 * PARTIAL_ROWS * I) + o_t
        b_g = b_g + tl.load(p_other, mask=m_t, other=0.0, cache_modifier=".cg")
        b_u = b_u + tl.load(p_other + PARTIAL_ROWS * I, mask=m_t, other=0.0, cache_modifier=".cg")
        tl.store(p_ticket, 0)
    return b_g, b_u, last


@triton.jit(do_not_specialize=["R"])
def _grouped_hidden_kernel(
    x, counts, lists, w_gate, w_up, hidden,
    gate_scale, gate_scale_row, up_scale, up_scale_row,  # FP8 only (else unused)
    stride_se, stride_sn,  # FP8: scale_inv strides per expert and per scale row (gate's = up's)
    R,
    H: tl.constexpr, I: tl.constexpr, S: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr,
    INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr = False, SCALE_BLOCK_K: tl.constexpr = 1, ONE_SCALE_COLUMN: tl.constexpr = False,
    SCALE_AFTER: tl.constexpr = False, PDL: tl.constexpr = False,
    partials=None, tickets=None, PARTIAL_ROWS: tl.constexpr = 1,  # K parts across programs: their sums and arrivals
    K_PARTS: tl.constexpr = 1, K_SPLITS: tl.constexpr = 1,
):
    # first (it calls after_previous: kernels/dependent_launch.py); o_p, m_p: [BLOCK_M]
    i_e, b_pair, m_p = _expert_block(counts, lists, R, E, BLOCK_E, BLOCK_M, PDL)
    if i_e >= E:
        return
    b_row = (b_pair // S).to(tl.int64)  # [BLOCK_M] each pair's row of x
    o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] hidden features
    o_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    m_n = o_n < I
    p_x = x + b_row[:, None] * H + o_k[None, :]  # [BLOCK_M, BLOCK_K]
    # int64: an expert stack can pass 2**31 elements (Qwen3.5-397B-A17B with its shared slot: 513 x 1024 x 4096)
    o_w = i_e.to(tl.int64) * (I * H) + o_n[None, :].to(tl.int64) * H + o_k[:, None]  # [BLOCK_K, BLOCK_N]: w[e]^T
    p_g = w_gate + o_w
    p_u = w_up + o_w
    m_srow = m_n[None, :]
    p_sg = o_n[None, :]  # FP8: [1, BLOCK_N] scale row offsets of each feature (else unused)
    p_su = p_sg
    if FP8:
        p_sg = scale_row_offsets(gate_scale_row, o_n, m_n, stride_sn)
        p_su = scale_row_offsets(up_scale_row, o_n, m_n, stride_sn)

    b_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SCALE_AFTER:  # whole tiles, one scale column a step (`scale_after`); H in K_PARTS parts summed apart (`k_parts`)
        p_gs = gate_scale + i_e * stride_se + p_sg
        p_us = up_scale + i_e * stride_se + p_su
        i_s = tl.program_id(2)  # with K_SPLITS programs a tile, the part this one walks
        for q in tl.static_range(K_PARTS // K_SPLITS):  # this program's parts, in ascending order
            k_begin = 0  # one part: the walk from 0 with constant bounds, as its loop always compiled
            if K_PARTS > 1:
                k_begin = (i_s + q * K_SPLITS) * (H // K_PARTS)
            b_pg, b_pu = _scale_after_walk(p_x + k_begin, p_g + k_begin, p_u + k_begin, p_gs, p_us, m_p, k_begin,
                                           k_begin + H // K_PARTS, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BLOCK_K, INTERPRET)
            if q == 0:  # a program's first part: its sums as they are
                b_g, b_u = b_pg, b_pu
            else:
                b_g, b_u = b_g + b_pg, b_u + b_pu
    m_h = m_p[:, None] & m_n[None, :]  # the tile's stored elements
    if SCALE_AFTER & (K_SPLITS > 1):  # two programs, a part each: the last to finish adds the other's sums to its own
        b_g, b_u, last = _add_other_part(b_g, b_u, partials, tickets, b_pair, o_n, m_h, tl.program_id(2), PARTIAL_ROWS, I)
        m_h = m_h & last  # the first to finish stores nothing
    # x is 16-byte aligned (kernels/moe.py copies it otherwise), so Triton pipelines its gather with
    # the weights' tiles; padded pairs (past the expert's count) are masked, read nothing, never stored.
    # Whole tiles (a function of the shapes) drop the masks along K and the features
    for k0 in range(0, 0 if SCALE_AFTER else H, BLOCK_K):
        if (H % BLOCK_K == 0) & (I % BLOCK_N == 0):
            b_x = tl.load(p_x, mask=m_p[:, None], other=0.0)
            b_wg = _weight_tile(p_g, None, i_e, gate_scale, p_sg, None, k0, None, stride_se, x.dtype.element_ty, INTERPRET,
                                FP8, SCALE_BLOCK_K, ONE_SCALE_COLUMN)
            b_wu = _weight_tile(p_u, None, i_e, up_scale, p_su, None, k0, None, stride_se, x.dtype.element_ty, INTERPRET,
                                FP8, SCALE_BLOCK_K, ONE_SCALE_COLUMN)
        else:
            m_k = (k0 + o_k) < H
            b_x = tl.load(p_x, mask=m_k[None, :], other=0.0)
            m_w = m_k[:, None] & m_n[None, :]
            o_kk = (k0 + o_k)[:, None]
            b_wg = _weight_tile(p_g, m_w, i_e, gate_scale, p_sg, m_srow, k0, o_kk, stride_se, x.dtype.element_ty, INTERPRET,
                                FP8, SCALE_BLOCK_K, ONE_SCALE_COLUMN)
            b_wu = _weight_tile(p_u, m_w, i_e, up_scale, p_su, m_srow, k0, o_kk, stride_se, x.dtype.element_ty, INTERPRET,
                                FP8, SCALE_BLOCK_K, ONE_SCALE_COLUMN)
        b_g = dot_acc(b_x, b_wg, b_g, INTERPRET)
        b_u = dot_acc(b_x, b_wu, b_u, INTERPRET)
        p_x += BLOCK_K
        p_g += BLOCK_K
        p_u += BLOCK_K
    b_h = tl.math.div_rn(b_g, 1.0 + tl.exp(-b_g)) * b_u  # silu(g) * u as torch: g / (1 + exp(-g))
    p_h = hidden + b_pair[:, None].to(tl.int64) * I + o_n[None, :]  # by pair
    tl.store(p_h, cast_rtne(b_h, hidden.dtype.element_ty, INTERPRET), mask=m_h)


@triton.jit(do_not_specialize=["R"])
def _grouped_down_kernel(
    hidden, counts, lists, w_down, expert_out,
    down_scale, down_scale_row,  # FP8 only (else unused)
    stride_se, stride_sn,  # FP8: scale_inv strides per expert and per scale row
    R,
    H: tl.constexpr, I: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr = False, SCALE_BLOCK_K: tl.constexpr = 1, ONE_SCALE_COLUMN: tl.constexpr = False,
    SCALE_AFTER: tl.constexpr = False, PDL: tl.constexpr = False,
):
    # first (it calls after_previous: kernels/dependent_launch.py); o_p, m_p: [BLOCK_M]
    i_e, b_pair, m_p = _expert_block(counts, lists, R, E, BLOCK_E, BLOCK_M, PDL)
    if i_e >= E:
        return
    b_pair = b_pair.to(tl.int64)
    o_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    o_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    m_n = o_n < H
    p_h = hidden + b_pair[:, None] * I + o_k[None, :]  # [BLOCK_M, BLOCK_K]
    # int64: as stage 1's
    p_w = w_down + i_e.to(tl.int64) * (H * I) + o_n[None, :].to(tl.int64) * I + o_k[:, None]  # [BLOCK_K, BLOCK_N]: w_down[e]^T
    m_srow = m_n[None, :]
    p_srow = o_n[None, :]  # FP8: [1, BLOCK_N] scale row offsets of each output feature (else unused)
    if FP8:
        p_srow = scale_row_offsets(down_scale_row, o_n, m_n, stride_sn)

    b_y = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SCALE_AFTER:  # whole tiles, one scale column a step (`scale_after`)
        p_ds = down_scale + i_e * stride_se + p_srow
        for k0 in range(0, I, BLOCK_K):
            b_h = tl.load(p_h, mask=m_p[:, None], other=0.0)
            b_y = _scaled_dot(b_h, p_w, p_ds, 0, k0, b_y, SCALE_BLOCK_K, INTERPRET)
            p_h += BLOCK_K
            p_w += BLOCK_K
    for k0 in range(0, 0 if SCALE_AFTER else I, BLOCK_K):
        if (I % BLOCK_K == 0) & (H % BLOCK_N == 0):
            b_h = tl.load(p_h, mask=m_p[:, None], other=0.0)
            b_w = _weight_tile(p_w, None, i_e, down_scale, p_srow, None, k0, None, stride_se,
                               hidden.dtype.element_ty, INTERPRET, FP8, SCALE_BLOCK_K, ONE_SCALE_COLUMN)
        else:
            m_k = (k0 + o_k) < I
            b_h = tl.load(p_h, mask=m_p[:, None] & m_k[None, :], other=0.0)
            b_w = _weight_tile(p_w, m_k[:, None] & m_n[None, :], i_e, down_scale, p_srow, m_srow, k0, (k0 + o_k)[:, None], stride_se,
                               hidden.dtype.element_ty, INTERPRET, FP8, SCALE_BLOCK_K, ONE_SCALE_COLUMN)
        b_y = dot_acc(b_h, b_w, b_y, INTERPRET)
        p_h += BLOCK_K
        p_w += BLOCK_K
    tl.store(expert_out + b_pair[:, None] * H + o_n[None, :], b_y, mask=m_p[:, None] & m_n[None, :])


@triton.jit
def combine_block(expert_out, expert_ids, expert_weights, i_r, o_h, m_h, H, T: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """Row i_r's weighted sum of its T pairs' outputs over features o_h [BLOCK_H] (mask m_h), fp32:
    from zero, the pairs in ascending expert id order, weight * output added one pair at a time.
    Its callers compile without contraction (enable_fp_fusion=False): each product and each sum is
    rounded on its own, so the combine kernel and a norm that finishes a PendingCombine agree."""
    o_t = tl.arange(0, BLOCK_T)  # [BLOCK_T] slots
    b_ids = tl.load(expert_ids + i_r * T + o_t, mask=o_t < T, other=NO_EXPERT)  # [BLOCK_T] int64
    b_out = tl.zeros([BLOCK_H], dtype=tl.float32)
    i_prev = tl.full([], -1, dtype=tl.int64)
    for _ in tl.static_range(T):  # unrolled: a slot's loads need not wait behind the previous slot's add
        # the next expert in ascending id order, and the slot that lists it
        i_e = tl.min(tl.where(b_ids > i_prev, b_ids, NO_EXPERT), axis=0)
        i_t = tl.min(tl.where(b_ids == i_e, o_t, BLOCK_T), axis=0)
        b_w = tl.load(expert_weights + i_r * T + i_t)  # fp32 routing weight
        b_y = tl.load(expert_out + (i_r * T + i_t) * H + o_h, mask=m_h, other=0.0)  # [BLOCK_H] fp32
        b_out += b_w * b_y
        i_prev = i_e
    return b_out


@triton.jit
def release_counts(counts, E_ALL: tl.constexpr, BLOCK_E: tl.constexpr):
    """The grouping's counts back to zero (by the last reader of the grouping), for the next routing."""
    o_e = tl.arange(0, BLOCK_E)
    tl.store(counts + o_e, tl.zeros([BLOCK_E], dtype=tl.int32), mask=o_e < E_ALL)


@triton.jit(do_not_specialize_on_alignment=["expert_ids", "expert_weights", "out"])
def _combine_kernel(
    expert_out, expert_ids, expert_weights, out, counts,
    H: tl.constexpr, T: tl.constexpr, BLOCK_T: tl.constexpr, E_ALL: tl.constexpr, BLOCK_E: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_r = tl.program_id(0).to(tl.int64)  # the row
    i_h = tl.program_id(1)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] output features
    m_h = o_h < H
    b_out = combine_block(expert_out, expert_ids, expert_weights, i_r, o_h, m_h, H, T, BLOCK_T, BLOCK_H)
    tl.store(out + i_r * H + o_h, cast_rtne(b_out, out.dtype.element_ty, INTERPRET), mask=m_h)
    if (i_r == 0) & (i_h == 0):  # the last reader of the grouping
        release_counts(counts, E_ALL, BLOCK_E)


class PendingCombine(NamedTuple):
    """The grouped experts before their combine (`grouped_experts(..., defer_combine=True)`): what
    `_combine_kernel` would add up, for a consumer that adds it up itself with `combine_block`
    (kernels/norms.py's add_rms_norm: one launch fewer per MoE layer). A row's finished value is
    `combine_block`'s sum rounded once to dtype; whoever finishes it sets counts back to zero."""

    expert_out: torch.Tensor  # [R * S, H] fp32: each (row, slot) pair's output
    ids: torch.Tensor  # [R, S] int64
    weights: torch.Tensor  # [R, S] fp32
    counts: torch.Tensor  # [E_all] int32: the grouping's, zero again once finished
    dtype: torch.dtype  # what the finished rows round to (x's dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.ids.shape[0], self.expert_out.shape[1]))

    def finish(self, out: torch.Tensor | None = None, block_h: int | None = None, num_warps: int = 4) -> torch.Tensor:
        """The combine: [R, H] in dtype, bitwise what grouped_experts without defer_combine returns
        (block_h and num_warps split the features among programs: speed only)."""
        r, h = self.shape
        if out is None:
            out = torch.empty((r, h), dtype=self.dtype, device=self.expert_out.device)
        if r == 0:
            return out
        slots, e = self.ids.shape[1], self.counts.shape[0]
        block_h = block_h or min(1024, triton.next_power_of_2(h))
        _combine_kernel[(r, triton.cdiv(h, block_h))](
            self.expert_out, self.ids, self.weights, out, self.counts,
            H=h, T=slots, BLOCK_T=triton.next_power_of_2(slots), E_ALL=e, BLOCK_E=triton.next_power_of_2(e), INTERPRET=interpreting(),
            BLOCK_H=block_h, num_warps=num_warps, enable_fp_fusion=False, **launch_options(self.expert_out.device),
        )
        return out


@triton.jit(do_not_specialize=["R"])
def _group_kernel(expert_ids, counts, lists, R, S: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """Given ids [R, S] (a caller's own routing) -> counts and lists, as kernels/moe_route.py's routing
    leaves them: one program per row."""
    after_previous(PDL)  # first: kernels/dependent_launch.py
    r = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < S
    b_ids = tl.load(expert_ids + r * S + o_s, mask=m_s, other=0).to(tl.int32)
    add_pairs(b_ids, counts, lists, r, o_s, m_s, R, S)


def group_pairs(expert_ids: torch.Tensor, expert_weights: torch.Tensor, n_experts: int) -> Routing:
    """A caller's routing (ids [R, S] int64, distinct in [0, n_experts) per row; fp32 weights [R, S])
    -> the Routing the grouped experts read, with fresh zeroed counts (a layer's routing kernel
    writes its own: kernels/moe_route.py)."""
    rows, slots = expert_ids.shape
    counts = torch.zeros(n_experts, dtype=torch.int32, device=expert_ids.device)
    lists = torch.empty((n_experts, max(rows, 1)), dtype=torch.int32, device=expert_ids.device)
    if rows:
        _group_kernel[(rows,)](expert_ids, counts, lists, rows, S=slots, BLOCK_S=max(2, triton.next_power_of_2(slots)),
                               num_warps=1, **launch_options(expert_ids.device))
    return Routing(expert_ids, expert_weights, counts, lists)


def grouped_experts(x: torch.Tensor, routing: Routing, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                    out: torch.Tensor | None, scales: tuple[BlockScales, BlockScales, BlockScales] | None,
                    config: GroupedConfig | None = None, *, defer_combine: bool = False,
                    prefill: bool = False) -> torch.Tensor | PendingCombine:
    """The three launches on arguments kernels/moe.py has checked (x contiguous and 16-byte aligned:
    stage 1 is specialised on it; ids and weights contiguous,
    out [R, H] contiguous, R >= 1; routing's counts and lists as kernels/moe_route.py leaves them);
    scales None: weights in x's dtype. Fills and returns out, and sets routing.counts back to zero.
    config: overrides `grouped_config` and `launch_for_rows` (bench.fp8_configs times candidates):
    that one config then runs every row count, so the rows stay invariant under it too.
    defer_combine: return the PendingCombine (out unused) for a consumer that finishes it itself.
    prefill: the rows are a prefill's: block-FP8 experts of many take PREFILL_LAUNCH (`prefill_config`)."""
    r, h = x.shape
    slots = routing.ids.shape[1]
    e, i, _ = w_gate.shape
    n_pairs = r * slots
    cfg = config
    if cfg is None:
        cfg = grouped_config(h, i, x.dtype, e, slots, fp8=scales is not None)
        if scales is not None and x.dtype == torch.bfloat16 and many_experts(e, slots):
            cfg = prefill_config(cfg, h, i) if prefill else launch_for_rows(cfg, r, h, i)
    hidden = torch.empty((n_pairs, i), dtype=x.dtype, device=x.device)  # [P, I] by pair
    expert_out = torch.empty((n_pairs, h), dtype=torch.float32, device=x.device)  # [P, H] by pair
    n_blocks = block_bound(n_pairs, e, cfg.BLOCK_M)
    grouping = dict(R=routing.lists.shape[1], E=e, BLOCK_E=triton.next_power_of_2(e),
                    INTERPRET=interpreting(), BLOCK_M=cfg.BLOCK_M)
    # scale pointers, strides and flags per stage (unused placeholders without FP8)
    hidden_fp8, down_fp8 = (x, x, x, x, 0, 0), (x, x, 0, 0)
    hidden_flags, down_flags = {}, {}
    splits = 1  # programs a stage-1 tile
    if scales is not None:
        gate, up, down = scales
        hidden_fp8 = (gate.scale_inv, gate.scale_row, up.scale_inv, up.scale_row, gate.scale_inv.stride(0), gate.scale_inv.stride(1))
        down_fp8 = (down.scale_inv, down.scale_row, down.scale_inv.stride(0), down.scale_inv.stride(1))
        after = (SCALE_AFTER_ON and scale_after(h, i, cfg.BLOCK_K, gate.block_k),
                 SCALE_AFTER_ON and scale_after(i, h, cfg.BLOCK_K2, down.block_k))
        parts = k_parts(h, cfg.BLOCK_K, after[0])
        hidden_flags = dict(FP8=True, SCALE_BLOCK_K=gate.block_k, ONE_SCALE_COLUMN=gate.block_k % cfg.BLOCK_K == 0,
                            SCALE_AFTER=after[0], K_PARTS=parts)
        if parts > 1 and r <= FEW_ROWS:  # a few rows: the parts over two programs a tile (`SCALE_AFTER_PARTS`)
            most_pairs = FEW_ROWS * slots  # sized for every few-row launch: one compile, one allocation
            tiles = block_bound(most_pairs, e, cfg.BLOCK_M) * triton.cdiv(i, cfg.BLOCK_N)
            partials, tickets = _PART_BUFFERS.get(x.device, parts * 2 * most_pairs * i, tiles)
            splits = parts
            hidden_flags.update(partials=partials, tickets=tickets, PARTIAL_ROWS=most_pairs, K_SPLITS=parts)
        down_flags = dict(FP8=True, SCALE_BLOCK_K=down.block_k, ONE_SCALE_COLUMN=down.block_k % cfg.BLOCK_K2 == 0,
                          SCALE_AFTER=after[1])
    _grouped_hidden_kernel[(n_blocks, triton.cdiv(i, cfg.BLOCK_N), splits)](
        x, routing.counts, routing.lists, w_gate, w_up, hidden, *hidden_fp8,
        H=h, I=i, S=slots, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, **grouping, **hidden_flags,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device),
    )
    _grouped_down_kernel[(n_blocks, triton.cdiv(h, cfg.BLOCK_N2))](
        hidden, routing.counts, routing.lists, w_down, expert_out, *down_fp8,
        H=h, I=i, BLOCK_N=cfg.BLOCK_N2, BLOCK_K=cfg.BLOCK_K2, **grouping, **down_flags,
        num_warps=cfg.num_warps2, num_stages=cfg.num_stages2, **launch_options(x.device),
    )
    pending = PendingCombine(expert_out, routing.ids, routing.weights, routing.counts, x.dtype)
    return pending if defer_combine else pending.finish(out, cfg.BLOCK_H, cfg.num_warps)
