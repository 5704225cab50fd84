"""Gated full attention (Qwen3-Next / Qwen3.5): q/k RMSNorm per head, partial rotary, GQA, sigmoid output gate.

Tensors under `{prefix}.self_attn.`: q_proj [2*heads*hd, H] whose output per head is
[query (hd) | gate (hd)]; k_proj, v_proj [kv_heads*hd, H]; o_proj [H, heads*hd]; q_norm, k_norm [hd].
"""

from __future__ import annotations

import torch

from ..checkpoint import TensorSource
from ..config import ModelConfig
from ..fp8 import cat_out_features
from hybrid_kernels.attention_prep import attention_prep, output_gate, project_heads_ref
from hybrid_kernels.runtime import use_triton

from ..ops import each_row, linear, rope_cos_sin, rope_inv_freq, rope_table
from ..rows import RowBatch
from ..state import AttentionState
from .attend import attend, write_kv


class GatedAttention:
    def __init__(self, config: ModelConfig, src: TensorSource, prefix: str):
        a = config.attention
        self.cfg = a
        self.eps = config.rms_norm_eps
        H, hd = config.hidden_size, a.head_dim
        p = f"{prefix}.self_attn."
        w_q = src.take(p + "q_proj.weight", (2 * a.n_heads * hd, H))
        w_k = src.take(p + "k_proj.weight", (a.n_kv_heads * hd, H))
        w_v = src.take(p + "v_proj.weight", (a.n_kv_heads * hd, H))
        # q | k | v in one GEMM (one launch reads the three weights; columns are independent sums)
        self.w_qkv = cat_out_features(w_q, w_k, w_v)
        self.w_o = src.take(p + "o_proj.weight", (H, a.n_heads * hd))
        self.b_qkv = self.b_o = None
        if a.bias:
            self.b_qkv = torch.cat((src.take(p + "q_proj.bias", (2 * a.n_heads * hd,)), src.take(p + "k_proj.bias", (a.n_kv_heads * hd,)),
                                    src.take(p + "v_proj.bias", (a.n_kv_heads * hd,))))
            self.b_o = src.take(p + "o_proj.bias", (H,))
        self.q_norm = src.take(p + "q_norm.weight", (hd,))
        self.k_norm = src.take(p + "k_norm.weight", (hd,))
        self.scale = hd**-0.5

    def forward(self, x: torch.Tensor, batch: RowBatch, positions: torch.Tensor, state: AttentionState, *,
                row_invariant: bool, prefill: bool = False) -> tuple[torch.Tensor, None]:
        # Attention needs no rollback record: its cursor is the committed position.
        if use_triton(x):
            query, gate = self._project_and_write(x, batch, positions, state)
            gated = attend(batch, state, query, self.scale, row_invariant=row_invariant, gate=gate,
                           prefill=prefill)  # the gate applied in-kernel
            return linear(gated.reshape(x.shape[0], -1), self.w_o, self.b_o, into_add_norm=True), None
        query, key, value, gate = each_row(self._project, x, positions, row_invariant=row_invariant)
        write_kv(batch, state, key, value)
        out = attend(batch, state, query, self.scale, row_invariant=row_invariant, prefill=prefill)
        return each_row(self._output, out, gate, row_invariant=row_invariant), None

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [n, H], positions [n] -> query [n, heads, hd], key, value [n, kv_heads, hd], gate [n, heads*hd]."""
        a, n, hd = self.cfg, x.shape[0], self.cfg.head_dim
        qkv = linear(x, self.w_qkv, self.b_qkv)  # [n, 2*heads*hd + 2*kv_heads*hd]
        cos, sin = rope_cos_sin(positions, rope_inv_freq(a.rotary_dim, a.rope_theta, x.device), x.dtype)
        query, key, value = project_heads_ref(qkv, self.q_norm, self.k_norm, self.eps, cos, sin, a.n_heads, a.n_kv_heads, hd)
        return query, key, value, output_gate(qkv, a.n_heads, hd).reshape(n, a.n_heads * hd)

    def _project_and_write(self, x: torch.Tensor, batch: RowBatch, positions: torch.Tensor, state: AttentionState):
        """_project and write_kv on CUDA: the GEMM, then one kernel for the norms, the rope (from the
        tables of every position the cache holds) and the KV write (kernels/attention_prep.py)
        -> query [n, heads, hd], gate [n, heads, hd] (a view of the projection)."""
        a, hd = self.cfg, self.cfg.head_dim
        qkv = linear(x, self.w_qkv, self.b_qkv)  # [n, 2*heads*hd + 2*kv_heads*hd]
        cos, sin = rope_table(state.keys.shape[1], a.rotary_dim, a.rope_theta, x.device, x.dtype)  # [max_seq_len, rd]
        query = attention_prep(qkv, self.q_norm, self.k_norm, self.eps, cos, sin, state.keys, state.values,
                               batch.row_slots(x.device), positions, a.n_heads, a.n_kv_heads, hd)
        return query, output_gate(qkv, a.n_heads, hd)

    def _output(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """out [n, heads, hd], gate [n, heads*hd] -> [n, H]."""
        return linear(out.reshape(gate.shape) * torch.sigmoid(gate), self.w_o, self.b_o, into_add_norm=True)
