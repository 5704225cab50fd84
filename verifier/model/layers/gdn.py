"""Gated DeltaNet (Qwen3-Next / Qwen3.5).

Tensors under `{prefix}.linear_attn.`, in one of two projection layouts:
  separate (Qwen3.5):      in_proj_qkv [2*key_dim + value_dim, H] (q | k | v), in_proj_z [value_dim, H],
                           in_proj_b [Hv, H], in_proj_a [Hv, H]
  interleaved (Qwen3-Next): in_proj_qkvz [2*key_dim + 2*value_dim, H] grouped per key head g as
                           q_g, k_g, v and z of value heads g*r .. g*r+r-1; in_proj_ba [2*Hv, H] grouped
                           per key head as b of its r value heads, then a of them.
The interleaved weights are permuted at load into the separate layout (same rows, other order).
Also conv1d.weight [conv_dim, 1, W] over channels q | k | v, dt_bias [Hv], A_log [Hv],
norm.weight [d_v], out_proj.weight [H, value_dim].
"""

from __future__ import annotations

import torch

from hybrid_kernels import gdn_heads
from hybrid_kernels.linear import SplitSums
from hybrid_kernels.runtime import pick

from ..checkpoint import TensorSource
from ..config import ModelConfig
from ..fp8 import cat_out_features, select_rows
from ..ops import linear, linear_columns, silu_gated_rms_norm
from .linear_attention import DeltaRuleMixer


class GatedDeltaNet(DeltaRuleMixer):
    def __init__(self, config: ModelConfig, src: TensorSource, prefix: str):
        g = config.gdn
        self.cfg = g
        self.eps = config.rms_norm_eps
        H = config.hidden_size
        p = f"{prefix}.linear_attn."
        if g.interleaved_projection:
            w_qkv, w_z, w_b, w_a = _deinterleave(
                g, src.take(p + "in_proj_qkvz.weight", (2 * g.key_dim + 2 * g.value_dim, H)), src.take(p + "in_proj_ba.weight", (2 * g.n_v_heads, H))
            )
        else:
            w_qkv = src.take(p + "in_proj_qkv.weight", (g.conv_dim, H))
            w_z = src.take(p + "in_proj_z.weight", (g.value_dim, H))
            w_b = src.take(p + "in_proj_b.weight", (g.n_v_heads, H))
            w_a = src.take(p + "in_proj_a.weight", (g.n_v_heads, H))
        # One GEMM for the four input projections: the weight is read in one launch, and a
        # column's sum does not depend on which other columns share the launch.
        self.w_in = cat_out_features(w_qkv, w_z, w_b, w_a)  # [conv_dim + value_dim + 2*Hv, H]
        self.in_splits = (g.conv_dim, g.value_dim, g.n_v_heads, g.n_v_heads)
        self.conv_w = src.take(p + "conv1d.weight", (g.conv_dim, 1, g.conv_width))[:, 0, :]
        self.dt_bias = src.take(p + "dt_bias", (g.n_v_heads,))
        self.A_log = src.take(p + "A_log", (g.n_v_heads,))
        self.norm_w = src.take(p + "norm.weight", (g.d_v,))
        self.w_out = src.take(p + "out_proj.weight", (H, g.value_dim))

    def _project(self, x: torch.Tensor):
        """x [n, H] -> raw conv inputs [n, conv_dim], z [n, Hv, d_v], and the gates' raw columns: b, a
        [n, Hv], or on CUDA beside a block-FP8 projection the unfinished split-K sums of the bf16
        b | a GEMM (ops.linear_columns), which the head split finishes."""
        g, n = self.cfg, x.shape[0]
        qkvz, ba = linear_columns(x, self.w_in, 2 * g.n_v_heads)
        qkv, z = qkvz.split(self.in_splits[:2], dim=1)
        gate_inputs = (ba, None) if isinstance(ba, SplitSums) else ba.split(self.in_splits[2:], dim=1)
        return qkv, z.reshape(n, g.n_v_heads, g.d_v), *gate_inputs

    def _split_heads(self, mixed: torch.Tensor, b: torch.Tensor | SplitSums, a: torch.Tensor | None):
        """Conv output [n, conv_dim] and the gates' columns b, a [n, Hv] (or b | a's split sums and
        None) -> fp32 q, k [n, Hv, d_k] (normalised, repeated per value head), v [n, Hv, d_v], decay
        [n, Hv, 1], beta [n, Hv]: one launch on CUDA (kernels/gdn_heads.py with its gates: the sigmoid,
        softplus and exps of kernels/gdn_gates.py in the same programs); the reference is this
        layer's torch code."""
        g = self.cfg
        split = pick(gdn_heads.gdn_heads, gdn_heads.gdn_heads_ref, mixed)
        return split(mixed, g.n_k_heads, g.n_v_heads, g.d_k, g.d_v, gates=(b, a, self.A_log, self.dt_bias))

    def _output(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Recurrence output [n, Hv, d_v] and z [n, Hv, d_v], both in the activation dtype -> [n, H]."""
        normed = silu_gated_rms_norm(out, z, self.norm_w, self.eps)
        return linear(normed.reshape(out.shape[0], self.cfg.value_dim), self.w_out, into_add_norm=True)


def _deinterleave(g, w_qkvz, w_ba):
    """Qwen3-Next's grouped rows -> (w_qkv [q|k|v], w_z, w_b, w_a), each row kept intact (tensors,
    or BlockFP8Weight whose rows keep their scales)."""
    r = g.n_v_heads // g.n_k_heads
    groups = torch.arange(w_qkvz.shape[0]).view(g.n_k_heads, 2 * g.d_k + 2 * r * g.d_v)  # row ids per key-head group
    q = groups[:, : g.d_k]
    k = groups[:, g.d_k : 2 * g.d_k]
    v = groups[:, 2 * g.d_k : 2 * g.d_k + r * g.d_v]
    z = groups[:, 2 * g.d_k + r * g.d_v :]
    ba = torch.arange(w_ba.shape[0]).view(g.n_k_heads, 2 * r)
    w_qkv = select_rows(w_qkvz, torch.cat((q.flatten(), k.flatten(), v.flatten())))
    return w_qkv, select_rows(w_qkvz, z.flatten()), select_rows(w_ba, ba[:, :r].flatten()), select_rows(w_ba, ba[:, r:].flatten())
