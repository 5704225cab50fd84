"""Channel mixers: the dense SwiGLU MLP and the two MoE routers.

Dense (`{prefix}.mlp.`): gate_proj, up_proj [I, H]; down_proj [H, I]; out = down(silu(gate(x)) * up(x)).

MoE (`{prefix}.mlp.`): router gate.weight [E, H]; experts stored per expert
(experts.{e}.gate_proj/up_proj/down_proj, or Kimi's w1/w3/w2) or fused
(experts.gate_up_proj [E, 2I, H] gate then up, experts.down_proj [E, H, I]).
Qwen3-Next: shared_expert.* plus shared_expert_gate.weight [1, H]. Kimi: gate.e_score_correction_bias [E]
and shared_experts.*. Routed outputs are summed per row in ascending expert order in fp32 and cast
once (kernels/moe.py); HF casts each expert's output to the activation dtype before summing, which
differs only in bf16 rounding.
"""

from __future__ import annotations

import torch

from hybrid_kernels import swiglu
from hybrid_kernels.linear import SplitSums
from hybrid_kernels.runtime import pick

from ..checkpoint import TensorSource
from ..fp8 import cat_out_features, same_kind, select_rows, stack_experts
from ..ops import linear, routed_experts
from ..config import ModelConfig, MoEConfig


class DenseMLP:
    def __init__(self, src: TensorSource, prefix: str, hidden: int, intermediate: int):
        # gate | up in one GEMM: one launch reads both weights
        self.w_gate_up = cat_out_features(src.take(prefix + "gate_proj.weight", (intermediate, hidden)),
                                          src.take(prefix + "up_proj.weight", (intermediate, hidden)))
        self.intermediate = intermediate
        self.w_down = src.take(prefix + "down_proj.weight", (hidden, intermediate))

    def forward(self, x: torch.Tensor, *, into_add_norm: bool = False) -> torch.Tensor | SplitSums:
        """into_add_norm: the output goes only to the residual stream's add_rms_norm (a block's MLP,
        not a shared expert), so a split-K down projection may hand over its sums (ops.linear)."""
        silu_mul = pick(swiglu.silu_mul, swiglu.silu_mul_ref, x)  # silu(gate) * up in one launch on CUDA
        return linear(silu_mul(linear(x, self.w_gate_up), self.intermediate), self.w_down, into_add_norm=into_add_norm)


class MoE:
    def __init__(self, config: ModelConfig, src: TensorSource, prefix: str):
        m: MoEConfig = config.moe
        self.cfg = m
        H, E, I = config.hidden_size, m.n_experts, m.expert_intermediate_size
        p = f"{prefix}.mlp."
        if m.router == "sigmoid":  # Kimi keeps the router in fp32
            self.w_router = src.take(p + "gate.weight", (E, H), fp32=True)
            self.score_bias = src.take(p + "gate.e_score_correction_bias", (E,), fp32=True)
        else:
            self.w_router = src.take(p + "gate.weight", (E, H))
        self.w_gate, self.w_up, self.w_down = self._experts(src, p + "experts.", E, H, I)
        self.shared = None
        if m.shared_intermediate_size:
            name = "shared_expert." if m.shared_gate else "shared_experts."
            self.shared = DenseMLP(src, p + name, H, m.shared_intermediate_size)
        if m.shared_gate:
            self.w_shared_gate = src.take(p + "shared_expert_gate.weight", (1, H))

    @staticmethod
    def _experts(src: TensorSource, p: str, E: int, H: int, I: int) -> tuple:
        """Stacked expert weights: gate [E, I, H], up [E, I, H], down [E, H, I] (tensors, or all
        three BlockFP8Weight from an FP8 checkpoint on CUDA)."""
        if src.has(p + "gate_up_proj"):
            gate_up = src.take(p + "gate_up_proj", (E, 2 * I, H))
            down = src.take(p + "down_proj", (E, H, I))
            return same_kind(select_rows(gate_up, slice(0, I)), select_rows(gate_up, slice(I, 2 * I)), down)
        names = ("gate_proj", "up_proj", "down_proj") if src.has(p + "0.gate_proj.weight") else ("w1", "w3", "w2")
        shapes = ((I, H), (I, H), (H, I))
        return same_kind(*(stack_experts([src.take(f"{p}{e}.{name}.weight", shape) for e in range(E)]) for name, shape in zip(names, shapes)))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (expert ids [rows, top_k], weights [rows, top_k])."""
        m = self.cfg
        if m.router == "softmax":
            logits = linear(x, self.w_router)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, m.top_k, dim=-1)
            if m.renormalize:
                weights = weights / _column_sum(weights)
            return ids, weights.to(x.dtype)
        scores = torch.sigmoid(linear(x.float(), self.w_router))  # [rows, E]
        choice = scores + self.score_bias
        if m.n_group > 1:
            per_group = m.n_experts // m.n_group
            top2 = choice.view(-1, m.n_group, per_group).topk(2, dim=-1)[0]
            group_scores = top2[..., 0] + top2[..., 1]  # [rows, groups]
            keep = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, m.topk_group, dim=-1, sorted=False)[1], 1.0)
            keep = keep[:, :, None].expand(-1, m.n_group, per_group).reshape(-1, m.n_experts)
            choice = choice.masked_fill(keep == 0, float("-inf"))
        ids = torch.topk(choice, m.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if m.renormalize:
            weights = weights / (_column_sum(weights) + 1e-20)
        return ids, weights * m.routed_scaling_factor

    def forward(self, x: torch.Tensor, *, into_add_norm: bool = False) -> torch.Tensor:
        """into_add_norm is DenseMLP's; a sum of experts is always finished here."""
        ids, weights = self.route(x)
        # Per row, its experts in ascending id order, fp32 accumulation (kernels/moe.py): no host
        # sync on the routing, so a CUDA graph can capture it.
        out = routed_experts(x, ids, weights.float(), self.w_gate, self.w_up, self.w_down)
        if self.shared is not None:
            shared = self.shared.forward(x)
            if self.cfg.shared_gate:
                shared = torch.sigmoid(linear(x, self.w_shared_gate)) * shared
            out = out + shared
        return out


def _column_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last (small) dim in a fixed left-to-right order: [rows, k] -> [rows, 1].
    A reduction kernel may pick its order from the tensor's shape; a chain of adds cannot."""
    total = x[:, :1]
    for j in range(1, x.shape[1]):
        total = total + x[:, j : j + 1]
    return total
