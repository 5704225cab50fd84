"""Gated attention's pre-processing in one launch: per row, every query head
normalised and rotated, every key head normalised, rotated and written to the KV cache beside its
value head.
The design in full: DESIGN.md section 6, "Gated attention's pre-processing".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_launchable, check_operand, check_tensor, contiguous_aligned
from .dependent_launch import after_previous, launch_options
from .norms import MAX_BLOCK_D, RMS_ZERO_CENTRED, normalise_block, rms_norm_ref
from .rounding import cast_rtne
from .runtime import interpreting

DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _attention_prep_kernel(
    qkv, q_weight, k_weight, cos, sin, keys, values, row_slots, positions, query,
    eps, length,
    H: tl.constexpr, KV: tl.constexpr, HD: tl.constexpr, RD: tl.constexpr,
    BLOCK_D: tl.constexpr, EMULATE_BF16_RTNE: tl.constexpr,
    PDL: tl.constexpr,
):
    after_previous(PDL)  # first: kernels/dependent_launch.py
    i_m = tl.program_id(0).to(tl.int64)  # the row
    i_h = tl.program_id(1)  # a query head (< H), else key head i_h - H
    position = tl.load(positions + i_m)
    DTYPE: tl.constexpr = query.dtype.element_ty
    W: tl.constexpr = 2 * H * HD + 2 * KV * HD
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HD
    p_row = qkv + i_m * W
    if i_h < H:
        p_head = p_row + i_h * 2 * HD
        p_w = q_weight
    else:
        p_head = p_row + 2 * H * HD + (i_h - H) * HD
        p_w = k_weight
    b_x = tl.load(p_head + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BLOCK_D]
    b_ss = tl.sum(b_x * b_x, axis=0)
    b_y = normalise_block(b_x, b_ss, p_w, p_w + o_d, m_d, HD, eps, RMS_ZERO_CENTRED, DTYPE, EMULATE_BF16_RTNE)
    b_y = cast_rtne(b_y, DTYPE, EMULATE_BF16_RTNE).to(tl.float32)  # the normed head, as rms_norm stores it
    if RD > 0:
        HALF: tl.constexpr = RD // 2
        m_rot = o_d < RD
        o_partner = tl.where(o_d < HALF, o_d + HALF, tl.where(m_rot, o_d - HALF, o_d))
        b_xp = tl.load(p_head + o_partner, mask=m_d, other=0.0).to(tl.float32)
        b_yp = normalise_block(b_xp, b_ss, p_w, p_w + o_partner, m_d, HD, eps, RMS_ZERO_CENTRED, DTYPE, EMULATE_BF16_RTNE)
        b_yp = cast_rtne(b_yp, DTYPE, EMULATE_BF16_RTNE).to(tl.float32)
        b_half = tl.where(o_d < HALF, -b_yp, b_yp)  # rotate_half, exact
        b_cos = tl.load(cos + position * RD + o_d, mask=m_rot, other=0.0).to(tl.float32)
        b_sin = tl.load(sin + position * RD + o_d, mask=m_rot, other=0.0).to(tl.float32)
        b_a = cast_rtne(b_y * b_cos, DTYPE, EMULATE_BF16_RTNE).to(tl.float32)
        b_b = cast_rtne(b_half * b_sin, DTYPE, EMULATE_BF16_RTNE).to(tl.float32)
        b_y = tl.where(m_rot, b_a + b_b, b_y)
    b_out = cast_rtne(b_y, DTYPE, EMULATE_BF16_RTNE)
    if i_h < H:
        tl.store(query + (i_m * H + i_h) * HD + o_d, b_out, mask=m_d)
    else:
        i_kv = i_h - H
        slot = tl.load(row_slots + i_m)
        at = ((slot * length + position) * KV + i_kv) * HD  # int64: the cache can pass 2^31 elements
        tl.store(keys + at + o_d, b_out, mask=m_d)
        b_v = tl.load(p_row + 2 * H * HD + KV * HD + i_kv * HD + o_d, mask=m_d, other=0.0)
        tl.store(values + at + o_d, b_v, mask=m_d)


def _check(qkv, q_weight, k_weight, cos, sin, keys, values, row_slots, positions, n_heads, n_kv_heads, head_dim) -> None:
    op = "attention_prep"
    check_operand(op, "qkv", qkv, "[n, W]", DTYPES)
    if min(n_heads, n_kv_heads, head_dim) < 1:
        raise ValueError(f"{op}: n_heads ({n_heads}), n_kv_heads ({n_kv_heads}) and head_dim ({head_dim}) must be positive")
    if head_dim > MAX_BLOCK_D:
        raise ValueError(f"{op}: head_dim ({head_dim}) over {MAX_BLOCK_D}: a head must fit one register block")
    n, width = qkv.shape[0], 2 * n_heads * head_dim + 2 * n_kv_heads * head_dim
    if qkv.shape[1] != width:
        raise ValueError(f"{op}: qkv must be [n, 2*H*hd + 2*KV*hd] = [n, {width}], got shape {list(qkv.shape)}")
    operand = ("qkv", qkv)
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_tensor(op, name, w, (head_dim,), qkv.dtype, operand)
    rd = cos.shape[-1] if cos.dim() == 2 and cos.shape[0] > 0 else -1
    if rd < 0 or rd % 2 or rd > head_dim:
        raise ValueError(f"{op}: cos must be [T, rd], T >= 1, with rd even and <= head_dim {head_dim}, got shape {list(cos.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(op, name, t, cos.shape, qkv.dtype, operand, layout="[T, rd]")
    if keys.dim() != 4 or tuple(keys.shape[2:]) != (n_kv_heads, head_dim):
        raise ValueError(f"{op}: keys must be [slots, length, {n_kv_heads}, {head_dim}], got shape {list(keys.shape)}")
    for name, t in (("keys", keys), ("values", values)):
        check_tensor(op, name, t, keys.shape, qkv.dtype, operand, layout="[slots, length, KV, hd]", contiguous=True)
    for name, t in (("row_slots", row_slots), ("positions", positions)):
        check_tensor(op, name, t, (n,), torch.int64, operand, layout="[n]", contiguous=True)
    check_launchable(op, "qkv", qkv)


def attention_prep(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row_slots: torch.Tensor,
                   positions: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """-> query [n, H, hd]; writes each row's key and value heads into keys / values (DESIGN.md section 6, "Gated attention's pre-processing")."""
    _check(qkv, q_weight, k_weight, cos, sin, keys, values, row_slots, positions, n_heads, n_kv_heads, head_dim)
    n = qkv.shape[0]
    query = torch.empty((n, n_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return query
    block_d = triton.next_power_of_2(head_dim)
    _attention_prep_kernel[(n, n_heads + n_kv_heads)](
        contiguous_aligned(qkv), contiguous_aligned(q_weight), contiguous_aligned(k_weight), contiguous_aligned(cos), contiguous_aligned(sin), keys, values,
        row_slots, positions, query,
        eps, keys.shape[1],
        H=n_heads, KV=n_kv_heads, HD=head_dim, RD=cos.shape[1],
        BLOCK_D=block_d, EMULATE_BF16_RTNE=interpreting(),
        num_warps=min(4, max(1, block_d // 128)), num_stages=1, enable_fp_fusion=False, **launch_options(qkv.device),
    )
    return query


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x [rows, heads, head_dim]; cos, sin [rows, rotary_dim]."""
    rd = cos.shape[-1]
    if rd == 0:
        return x
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def attention_prep_ref(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, row_slots: torch.Tensor,
                       positions: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """The torch code the kernel replaces: project_heads_ref at each row's rope, then the KV write."""
    query, key, value = project_heads_ref(qkv, q_weight, k_weight, eps, cos[positions], sin[positions],
                                          n_heads, n_kv_heads, head_dim)
    keys[row_slots, positions] = key
    values[row_slots, positions] = value
    return query


def project_heads_ref(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GatedAttention's projection -> heads, in torch (the CPU reference backend's code): qkv [n, W]
    as DESIGN.md section 6, "Gated attention's pre-processing" lays it out, cos, sin [n, rd] of each row's position -> the normed and
    rotated query [n, H, hd] and key [n, KV, hd], and the value [n, KV, hd]."""
    n, hd = qkv.shape[0], head_dim
    q_and_gate, key, value = qkv.split((2 * n_heads * hd, n_kv_heads * hd, n_kv_heads * hd), dim=1)
    query = q_and_gate.reshape(n, n_heads, 2 * hd)[..., :hd]
    query = rms_norm_ref(query.reshape(-1, hd), q_weight, eps, True).reshape(n, n_heads, hd)
    key = rms_norm_ref(key.reshape(-1, hd), k_weight, eps, True).reshape(n, n_kv_heads, hd)
    return apply_partial_rope(query, cos, sin), apply_partial_rope(key, cos, sin), value.reshape(n, n_kv_heads, hd)


def output_gate(qkv: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """The output gate's columns of qkv [n, W]: a view [n, H, hd] (attend_rows reads it strided)."""
    return qkv[:, : 2 * n_heads * head_dim].view(qkv.shape[0], n_heads, 2 * head_dim)[..., head_dim:]
