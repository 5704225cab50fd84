"""A MoE layer's routing in one launch: router logits -> each row's experts and weights, and the
pairs grouped by expert for kernels/moe_grouped.py.
The design in full: DESIGN.md section 6, "MoE routing".
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .checks import check_launchable, check_tensor
from .dependent_launch import after_previous, launch_options
from .linear import SplitSums
from .rounding import TL_DTYPES, cast_rtne
from .runtime import interpreting

SOFTMAX, SIGMOID = "softmax", "sigmoid"
NO_SHARED, GATED_SHARED, UNGATED_SHARED = 0, 1, 2  # the shared expert: not folded, folded with its gate logit, folded with weight 1


class Routing(NamedTuple):
    """What `route` (or kernels/moe_grouped.py's `group_pairs` for given ids) hands the grouped experts."""

    ids: torch.Tensor  # [R, S] int64
    weights: torch.Tensor  # [R, S] fp32
    counts: torch.Tensor  # [E_all] int32
    lists: torch.Tensor  # [E_all, R] int32


@triton.jit
def add_pairs(expert, counts, lists, r, o_s, m_s, R, S):
    """Row r's pairs (slots o_s [BLOCK_S] of S, their experts `expert` [BLOCK_S], mask m_s) appended to
    their experts' lists of R entries: an atomic increment per pair hands out its entry (a row's
    experts are distinct, so its pairs never share a counter)."""
    pos = tl.atomic_add(counts + expert, 1, mask=m_s)
    tl.store(lists + expert.to(tl.int64) * R + pos, (r * S + o_s).to(tl.int32), mask=m_s)


TAKEN = tl.constexpr(-(2**63))  # the key of a lane already chosen or past the experts: below every other key
NAN_KEY = tl.constexpr(-(2**31) + 1)  # the upper half of a NaN choice's key: below every number's, -inf included


@triton.jit
def choice_keys(b_choice, o_e, m_e, BLOCK_E: tl.constexpr):
    """Each lane's choice [BLOCK_E] fp32 -> an int64 key whose order is the top-k's: the upper 32 bits
    the value's bits mapped to a signed order (negatives' magnitude bits flipped; +0 for -0, so the
    two zeros tie; NaN below -inf), the lower 32 bits BLOCK_E - 1 - lane, so equal values go to the
    lowest id. Lanes past the E experts (m_e false) get TAKEN."""
    bits = b_choice.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ordered = tl.where(b_choice == 0.0, 0, ordered)
    ordered = tl.where(b_choice != b_choice, NAN_KEY, ordered)
    b_key = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - o_e).to(tl.int64)
    return tl.where(m_e, b_key, TAKEN)


@triton.jit
def key_value(key):
    """The fp32 value of a key `choice_keys` made (the order map is its own inverse); a NaN's key gives NaN."""
    ordered = (key >> 32).to(tl.int32)
    value = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    return tl.where(ordered == NAN_KEY, float("nan"), value)


@triton.jit(do_not_specialize=["R", "stride_l"])
def _route_kernel(
    logits, partial, bias, ids, weights, counts, lists,
    R, stride_l, scaling,
    E: tl.constexpr, L: tl.constexpr, T: tl.constexpr, S: tl.constexpr,
    SPLITS: tl.constexpr, LOGIT_DTYPE: tl.constexpr, SOFTMAX_ROUTER: tl.constexpr, RENORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, SHARED: tl.constexpr, WEIGHT_DTYPE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    r = tl.program_id(0).to(tl.int64)  # one program per row
    o_e = tl.arange(0, BLOCK_E)
    m_l = o_e < L
    m_e = o_e < E
    if SPLITS > 0:  # the router GEMM's split sums, added in ascending order and rounded once (its reduce)
        b_l = tl.load(partial + r * L + o_e, mask=m_l, other=0.0)
        for i_s in range(1, SPLITS):
            b_l += tl.load(partial + (i_s * R + r) * L + o_e, mask=m_l, other=0.0)
        b_l = cast_rtne(b_l, LOGIT_DTYPE, INTERPRET).to(tl.float32)
    else:
        b_l = tl.load(logits + r * stride_l + o_e, mask=m_l, other=0.0).to(tl.float32)
    if SOFTMAX_ROUTER:
        b_x = tl.where(m_e, b_l, float("-inf"))
        b_ex = tl.where(m_e, tl.exp(b_x - tl.max(b_x, axis=0)), 0.0)
        b_score = tl.math.div_rn(b_ex, tl.sum(b_ex, axis=0))
        b_choice = b_score
    else:
        b_score = tl.math.div_rn(tl.full([BLOCK_E], 1.0, tl.float32), 1.0 + tl.exp(-b_l))
        b_choice = b_score
        if HAS_BIAS:
            b_choice = b_score + tl.load(bias + o_e, mask=m_e, other=0.0)
    o_s = tl.arange(0, BLOCK_S)
    # one int64 key a lane (`choice_keys`): the T largest are T max-reductions over BLOCK_E lanes
    b_key = choice_keys(b_choice, o_e, m_e, BLOCK_E)
    b_ids = tl.zeros([BLOCK_S], dtype=tl.int32)
    b_w = tl.zeros([BLOCK_S], dtype=tl.float32)
    b_total = tl.zeros([], dtype=tl.float32)
    for t in tl.static_range(T):  # the T largest, one at a time; ties to the lowest id, NaN last
        best = tl.max(b_key, axis=0)
        i_e = (BLOCK_E - 1) - (best & 0xFFFFFFFF).to(tl.int32)
        if HAS_BIAS:  # the weight is the score, not the choice it was picked by
            w = tl.sum(tl.where(o_e == i_e, b_score, 0.0), axis=0)
        else:  # the choice is the score: its value is in the key's upper half
            w = key_value(best)
        b_key = tl.where(o_e == i_e, TAKEN, b_key)
        b_ids = tl.where(o_s == t, i_e, b_ids)
        b_w = tl.where(o_s == t, w, b_w)
        b_total = b_total + w  # left to right
    if RENORMALIZE:
        if SOFTMAX_ROUTER:
            b_w = tl.math.div_rn(b_w, tl.zeros([BLOCK_S], dtype=tl.float32) + b_total)
        else:
            b_w = tl.math.div_rn(b_w, tl.zeros([BLOCK_S], dtype=tl.float32) + (b_total + 1e-20))
    if not SOFTMAX_ROUTER:
        b_w = b_w * scaling
    b_w = cast_rtne(b_w, WEIGHT_DTYPE, INTERPRET).to(tl.float32)
    if SHARED == 1:  # the shared expert's gate: sigmoid of the last logit, in the activation dtype
        g = tl.sum(tl.where(o_e == E, b_l, 0.0), axis=0)
        gate = cast_rtne(tl.math.div_rn(tl.full([BLOCK_S], 1.0, tl.float32), 1.0 + tl.exp(-g)), WEIGHT_DTYPE, INTERPRET).to(tl.float32)
        b_ids = tl.where(o_s == T, E, b_ids)
        b_w = tl.where(o_s == T, gate, b_w)
    elif SHARED == 2:
        b_ids = tl.where(o_s == T, E, b_ids)
        b_w = tl.where(o_s == T, 1.0, b_w)
    m_s = o_s < S
    tl.store(ids + r * S + o_s, b_ids.to(tl.int64), mask=m_s)
    tl.store(weights + r * S + o_s, b_w, mask=m_s)
    add_pairs(b_ids, counts, lists, r, o_s, m_s, R, S)


def route(logits: torch.Tensor | SplitSums, n_experts: int, top_k: int, counts: torch.Tensor, *, router: str = SOFTMAX,
          renormalize: bool = True, bias: torch.Tensor | None = None, scaling: float = 1.0, shared: int = NO_SHARED,
          weight_dtype: torch.dtype = torch.bfloat16) -> Routing:
    """Router logits [R, L] (or the router GEMM's SplitSums) -> Routing, in one launch (DESIGN.md section 6, "MoE routing").

    counts: the layer's [E_all] int32 buffer, all zero (the combine leaves it so). weight_dtype:
    what the softmax router's and the shared gate's weights are rounded to (the activations'
    dtype); the sigmoid router's stay fp32 (pass torch.float32)."""
    splits = logits.partial.shape[0] if isinstance(logits, SplitSums) else 0
    rows, n_logits = logits.shape
    source = logits.partial if splits else logits
    device = source.device
    e_all = n_experts + (shared != NO_SHARED)
    slots = top_k + (shared != NO_SHARED)
    _check(rows, n_logits, n_experts, top_k, counts, e_all, shared, router, bias, source)
    ids = torch.empty((rows, slots), dtype=torch.int64, device=device)
    weights = torch.empty((rows, slots), dtype=torch.float32, device=device)
    lists = torch.empty((e_all, max(rows, 1)), dtype=torch.int32, device=device)
    if rows == 0:
        return Routing(ids, weights, counts, lists)
    check_launchable("route", "logits", source)
    logit_dtype = logits.dtype if splits else source.dtype
    if not splits and source.stride(1) != 1:
        source = source.contiguous()
    _route_kernel[(rows,)](
        source, source, bias if bias is not None else weights, ids, weights, counts, lists,
        rows, source.stride(0) if not splits else n_logits, float(scaling),
        E=n_experts, L=n_logits, T=top_k, S=slots, SPLITS=splits, LOGIT_DTYPE=TL_DTYPES[logit_dtype],
        SOFTMAX_ROUTER=router == SOFTMAX, RENORMALIZE=renormalize, HAS_BIAS=bias is not None, SHARED=shared,
        WEIGHT_DTYPE=TL_DTYPES[weight_dtype], BLOCK_E=triton.next_power_of_2(n_logits), BLOCK_S=max(2, triton.next_power_of_2(slots)),
        INTERPRET=interpreting(), num_warps=1, **launch_options(device),
    )
    return Routing(ids, weights, counts, lists)


def _check(rows: int, n_logits: int, n_experts: int, top_k: int, counts: torch.Tensor, e_all: int, shared: int, router: str,
           bias: torch.Tensor | None, source: torch.Tensor) -> None:
    if router not in (SOFTMAX, SIGMOID):
        raise ValueError(f"route: router must be {SOFTMAX!r} or {SIGMOID!r}, got {router!r}")
    if shared not in (NO_SHARED, GATED_SHARED, UNGATED_SHARED):
        raise ValueError(f"route: shared must be NO_SHARED, GATED_SHARED or UNGATED_SHARED, got {shared!r}")
    want = n_experts + (shared == GATED_SHARED)
    if n_logits != want:
        raise ValueError(f"route: logits have {n_logits} columns; {n_experts} experts{' and the shared gate' if shared == GATED_SHARED else ''} need {want}")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"route: top_k {top_k} must be in [1, {n_experts}]")
    check_tensor("route", "counts", counts, (e_all,), torch.int32, ("logits", source), layout="[E_all]", contiguous=True)
    if bias is not None:
        check_tensor("route", "bias", bias, (n_experts,), torch.float32, ("logits", source), layout="[E]", contiguous=True)


def route_ref(logits: torch.Tensor, n_experts: int, top_k: int, *, router: str = SOFTMAX, renormalize: bool = True,
              bias: torch.Tensor | None = None, scaling: float = 1.0, shared: int = NO_SHARED,
              weight_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of `route` in torch -> (ids [R, S] int64, weights [R, S] fp32): what the CPU
    backend computes (no grouping: its experts walk each row's ids)."""
    scores_in = logits[:, :n_experts].float()
    if router == SOFTMAX:
        score = torch.softmax(scores_in, dim=-1, dtype=torch.float32)
        choice = score
    else:
        score = torch.sigmoid(scores_in)
        choice = score if bias is None else score + bias
    ids = torch.topk(choice, top_k, dim=-1)[1]
    weights = score.gather(1, ids)
    if renormalize:
        total = weights[:, :1]
        for j in range(1, top_k):  # left to right, as the kernel
            total = total + weights[:, j : j + 1]
        weights = weights / (total if router == SOFTMAX else total + 1e-20)
    if router != SOFTMAX:
        weights = weights * scaling
    weights = weights.to(weight_dtype).float()
    if shared == NO_SHARED:
        return ids, weights
    gate = torch.sigmoid(logits[:, n_experts:].float()).to(weight_dtype).float() if shared == GATED_SHARED else None
    return with_shared(ids, weights, n_experts, gate)


def with_shared(ids: torch.Tensor, weights: torch.Tensor, n_experts: int, gate: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A routing's ids and fp32 weights [R, T] with the folded shared expert's slot appended: id
    n_experts, weight gate [R, 1] (None: 1, ungated) -> [R, T + 1] each."""
    rows = ids.shape[0]
    if gate is None:
        gate = torch.ones(rows, 1, dtype=torch.float32, device=weights.device)
    shared_ids = torch.full((rows, 1), n_experts, dtype=ids.dtype, device=ids.device)
    return torch.cat((ids, shared_ids), dim=1), torch.cat((weights, gate), dim=1)
