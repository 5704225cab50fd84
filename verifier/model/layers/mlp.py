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

from hybrid_kernels import linear as linear_kernel
from hybrid_kernels import moe_route, swiglu
from hybrid_kernels.linear import SplitSums
from hybrid_kernels.moe_grouped import PendingCombine
from hybrid_kernels.runtime import pick, use_triton

from ..checkpoint import TensorSource
from ..fp8 import append_expert, cat_out_features, same_kind, select_rows, stack_experts
from ..ops import linear, routed_experts
from ..config import ModelConfig, MoEConfig


# A prefill's block-FP8 experts in blocks of 64 pairs (kernels/moe_grouped.py, PREFILL_LAUNCH)
# instead of decode's 16; False: decode's launches (`python -m bench.prefill --[no-]expert-tiles`).
# Decode, verify and the MTP head never take it.
PREFILL_EXPERT_TILES = False


def prefill_kernels_differ() -> bool:
    """Whether a prefill forward's row-wise kernels are other than a step's (PREFILL_EXPERT_TILES):
    then a prompt's rows cannot join a step (its row-wise ops run once over all rows) and keep the
    bits of their own prefill forward."""
    return PREFILL_EXPERT_TILES


class DenseMLP:
    def __init__(self, src: TensorSource, prefix: str, hidden: int, intermediate: int):
        # gate | up in one GEMM: one launch reads both weights
        self.w_gate_up = cat_out_features(src.take(prefix + "gate_proj.weight", (intermediate, hidden)),
                                          src.take(prefix + "up_proj.weight", (intermediate, hidden)))
        self.intermediate = intermediate
        self.w_down = src.take(prefix + "down_proj.weight", (hidden, intermediate))

    def forward(self, x: torch.Tensor, *, into_add_norm: bool = False, prefill: bool = False) -> torch.Tensor | SplitSums:
        """into_add_norm: the output goes only to the residual stream's add_rms_norm (a block's MLP,
        not a shared expert), so a split-K down projection may hand over its sums (ops.linear).
        prefill: the rows are a prefill's (the same arithmetic here)."""
        silu_mul = pick(swiglu.silu_mul, swiglu.silu_mul_ref, x)  # silu(gate) * up in one launch on CUDA
        return linear(silu_mul(linear(x, self.w_gate_up), self.intermediate), self.w_down, into_add_norm=into_add_norm)


class MoE:
    """A sparse MLP: a router, routed experts and optional shared experts.

    When the shared expert has the routed experts' intermediate size (Qwen3-Next, Qwen3.5/3.6-MoE,
    Kimi Linear with one shared expert) it is folded in as expert E: every row's last pair, with
    the weight sigmoid(shared gate . x) (Kimi: 1), so one set of grouped launches runs it with the
    routed experts and one fp32 sum in ascending id order adds them all (kernels/moe_route.py).
    On CUDA the router's GEMM (the shared gate's row appended to the router's) and one routing
    launch replace softmax, top-k and torch's sort; then three grouped launches. Otherwise the
    shared expert runs as a DenseMLP beside the routed experts."""

    def __init__(self, config: ModelConfig, src: TensorSource, prefix: str):
        m: MoEConfig = config.moe
        self.cfg = m
        H, E, I = config.hidden_size, m.n_experts, m.expert_intermediate_size
        p = f"{prefix}.mlp."
        shared_name = "shared_expert." if m.shared_gate else "shared_experts."
        self.shared_folded = bool(m.shared_intermediate_size) and m.shared_intermediate_size == I
        shared_weights = None
        if self.shared_folded:
            shared_weights = tuple(src.take(p + shared_name + f"{name}.weight", shape)
                                   for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))))
        if m.router == "sigmoid":  # Kimi keeps the router in fp32
            self.w_router = src.take(p + "gate.weight", (E, H), fp32=True)
            self.score_bias = src.take(p + "gate.e_score_correction_bias", (E,), fp32=True)
        else:
            self.w_router = src.take(p + "gate.weight", (E, H))
            self.score_bias = None
        # the routed experts, then the folded shared expert as expert E
        self.w_gate, self.w_up, self.w_down = self._experts(src, p + "experts.", E, H, I, shared_weights)
        self.shared = None
        self.shared_mode = moe_route.NO_SHARED
        if m.shared_intermediate_size and not self.shared_folded:
            self.shared = DenseMLP(src, p + shared_name, H, m.shared_intermediate_size)
        if m.shared_gate:
            w_shared_gate = src.take(p + "shared_expert_gate.weight", (1, H))
            if self.shared_folded:  # its logit is the router GEMM's last column
                self.w_router = torch.cat((self.w_router, w_shared_gate.to(self.w_router.dtype))).contiguous()
            else:
                self.w_shared_gate = w_shared_gate
        if self.shared_folded:
            self.shared_mode = moe_route.GATED_SHARED if m.shared_gate else moe_route.UNGATED_SHARED
        n_all = E + self.shared_folded
        # the routing kernel's pair counts, all zero between forwards (the grouped experts' last launch resets them)
        self.counts = torch.zeros(n_all, dtype=torch.int32, device=self.w_router.device)

    @staticmethod
    def _experts(src: TensorSource, p: str, E: int, H: int, I: int, extra: tuple | None) -> tuple:
        """Stacked expert weights: gate [E', I, H], up [E', I, H], down [E', H, I] (tensors, or all
        three BlockFP8Weight from an FP8 checkpoint on CUDA); extra: one more expert's (gate, up,
        down), stacked last (E' = E + 1)."""
        if src.has(p + "gate_up_proj"):
            gate_up = src.take(p + "gate_up_proj", (E, 2 * I, H))
            down = src.take(p + "down_proj", (E, H, I))
            stacks = (select_rows(gate_up, slice(0, I)), select_rows(gate_up, slice(I, 2 * I)), down)
            if extra is not None:
                stacks = tuple(append_expert(stack, w) for stack, w in zip(stacks, extra))
            return same_kind(*stacks)
        names = ("gate_proj", "up_proj", "down_proj") if src.has(p + "0.gate_proj.weight") else ("w1", "w3", "w2")
        shapes = ((I, H), (I, H), (H, I))
        stacks = []
        for j, (name, shape) in enumerate(zip(names, shapes)):
            weights = [src.take(f"{p}{e}.{name}.weight", shape) for e in range(E)]
            stacks.append(stack_experts(weights + ([extra[j]] if extra is not None else [])))
        return same_kind(*stacks)

    def route(self, x: torch.Tensor) -> moe_route.Routing | tuple[torch.Tensor, torch.Tensor]:
        """-> (expert ids [rows, S], weights [rows, S] fp32): slots 0 .. top_k - 1 the routed
        experts, slot top_k the folded shared expert (id E) if there is one; on CUDA the whole
        Routing (kernels/moe_route.py), the pairs grouped by expert."""
        m = self.cfg
        common = dict(router=m.router, renormalize=m.renormalize, bias=self.score_bias, scaling=m.routed_scaling_factor,
                      shared=self.shared_mode, weight_dtype=x.dtype if m.router == "softmax" else torch.float32)
        x_router = x if m.router == "softmax" else x.float()
        if use_triton(x) and m.n_group <= 1:
            logits = linear_kernel.linear(x_router, self.w_router, defer_split=True)  # its split finished by the routing
            return moe_route.route(logits, m.n_experts, m.top_k, self.counts, **common)
        logits = linear(x_router, self.w_router)
        if m.n_group <= 1:
            return moe_route.route_ref(logits, m.n_experts, m.top_k, **common)
        return self._grouped_route(logits, common["weight_dtype"])

    def _grouped_route(self, logits: torch.Tensor, weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The sigmoid router with expert groups (n_group > 1) in torch: the best topk_group groups
        by their two largest choices, then the top_k within them."""
        m = self.cfg
        scores = torch.sigmoid(logits[:, : m.n_experts].float())  # [rows, E]
        choice = scores + self.score_bias
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
        weights = (weights * m.routed_scaling_factor).to(weight_dtype).float()
        return moe_route.with_shared(ids, weights, m.n_experts, None) if self.shared_folded else (ids, weights)

    def forward(self, x: torch.Tensor, *, into_add_norm: bool = False, prefill: bool = False) -> torch.Tensor | PendingCombine:
        """into_add_norm: the output goes only to the residual stream's add_rms_norm: on CUDA, with
        no unfolded shared expert to add, the experts' weighted sum is left to that norm's kernel
        (ops.routed_experts).
        prefill: the rows are a prefill's: the experts may take prefill's launch (PREFILL_EXPERT_TILES)."""
        routing = self.route(x)
        # Per row, its experts in ascending id order, fp32 accumulation (kernels/moe.py): no host
        # sync on the routing, so a CUDA graph can capture it.
        try:
            out = routed_experts(x, routing, self.w_gate, self.w_up, self.w_down, into_add_norm=into_add_norm and self.shared is None,
                                 prefill=prefill and PREFILL_EXPERT_TILES)
        except BaseException:  # the combine never ran: the counts go back to zero here, or the next routing starts off them
            self.counts.zero_()
            raise
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
