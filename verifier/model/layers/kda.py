"""Kimi Delta Attention.

Tensors under `{prefix}.self_attn.` (P = heads * D): q_proj, k_proj, v_proj [P, H]; the short convs
either fused (conv1d.weight [3P, 1, W], channels q | k | v) or separate (q_conv1d, k_conv1d, v_conv1d
[P, 1, W]); f_a_proj [D, H], f_b_proj [P, D], dt_bias [P], A_log (heads values, any shape);
b_proj [heads, H]; g_a_proj [D, H], g_b_proj [P, D]; o_norm [D]; o_proj [H, P].
Per row: q, k, v = silu(conv(proj(x))); decay g [heads, D] from the forget gate (softplus or
bounded law); beta = sigmoid(b_proj(x)); delta rule; o = o_norm(o) * sigmoid(g_b(g_a(x))); o_proj.
"""

from __future__ import annotations

import torch

from ..checkpoint import TensorSource
from ..config import ModelConfig
from ..fp8 import cat_out_features
from ..ops import kimi_softplus, l2norm, linear, sigmoid_gated_rms_norm
from .linear_attention import DeltaRuleMixer


class KimiDeltaAttention(DeltaRuleMixer):
    def __init__(self, config: ModelConfig, src: TensorSource, prefix: str):
        c = config.kda
        self.cfg = c
        self.eps = config.rms_norm_eps
        H, P, D, W = config.hidden_size, c.proj_dim, c.head_dim, c.conv_width
        p = f"{prefix}.self_attn."
        # q | k | v | beta | f_a | g_a: every projection of x in one GEMM (one launch, one weight read)
        self.w_in = cat_out_features(*[src.take(p + f"{n}_proj.weight", (P, H)) for n in "qkv"],
                                     src.take(p + "b_proj.weight", (c.n_heads, H)), src.take(p + "f_a_proj.weight", (D, H)),
                                     src.take(p + "g_a_proj.weight", (D, H)))
        self.in_splits = (3 * P, c.n_heads, D, D)
        if src.has(p + "conv1d.weight"):
            self.conv_w = src.take(p + "conv1d.weight", (3 * P, 1, W))[:, 0, :]
        else:
            self.conv_w = torch.cat([src.take(p + f"{n}_conv1d.weight", (P, 1, W))[:, 0, :] for n in "qkv"], dim=0)
        self.w_f_b = src.take(p + "f_b_proj.weight", (P, D))
        self.dt_bias = src.take(p + "dt_bias", (P,), fp32=True)
        self.A_log = src.take_flat(p + "A_log", c.n_heads, fp32=True).reshape(c.n_heads, 1)  # [heads, 1]
        self.w_g_b = src.take(p + "g_b_proj.weight", (P, D))
        self.o_norm = src.take(p + "o_norm.weight", (D,))
        self.w_o = src.take(p + "o_proj.weight", (H, P))

    def _project(self, x: torch.Tensor):
        """x [n, H] -> raw conv inputs [n, 3P], output gate [n, heads, D], decay [n, heads, D], beta [n, heads] (fp32)."""
        c, n = self.cfg, x.shape[0]
        qkv, b, f_a, g_a = linear(x, self.w_in).split(self.in_splits, dim=1)
        raw = linear(f_a, self.w_f_b)
        raw = (raw.float() + self.dt_bias).view(n, c.n_heads, c.head_dim)
        if c.gate_law == "softplus":
            log_decay = -self.A_log.exp() * kimi_softplus(raw)
        else:
            log_decay = c.gate_lower_bound * torch.sigmoid(self.A_log.exp() * raw)
        beta = torch.sigmoid(b).float()
        gate = linear(g_a, self.w_g_b).view(n, c.n_heads, c.head_dim)
        return qkv, gate, log_decay.exp(), beta

    def _split_heads(self, mixed: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor):
        """Conv output [n, 3P] and the projection's decay, beta -> fp32 q, k (normalised; q scaled)
        and v, each [n, heads, D], then decay and beta as they came."""
        c, n, P = self.cfg, mixed.shape[0], self.cfg.proj_dim
        q, k, v = (mixed[:, i * P : (i + 1) * P].reshape(n, c.n_heads, c.head_dim).float() for i in range(3))
        return l2norm(q, "div") * (1 / c.head_dim**0.5), l2norm(k, "div"), v, decay, beta

    def _output(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Recurrence output [n, heads, D] and output gate [n, heads, D], both in the activation dtype -> [n, H]."""
        normed = sigmoid_gated_rms_norm(out, gate, self.o_norm, self.eps)
        return linear(normed.reshape(out.shape[0], self.cfg.proj_dim), self.w_o, into_add_norm=True)
