"""Multi-head latent attention without rotary (Kimi Linear).

Tensors under `{prefix}.self_attn.`: q_proj [heads*(nope+rope), H] (or q_a_proj, q_a_layernorm,
q_b_proj when q_lora_rank is set); kv_a_proj_with_mqa [rank+rope, H]; kv_a_layernorm [rank];
kv_b_proj [heads*(nope+v), rank]; o_proj [H, heads*v].
Per row: c, k_shared = split(kv_a(x)); k_nope, v = split(kv_b(norm(c))) per head;
key = [k_nope | k_shared]; the 'rope' slice is shared by all heads and never rotated.
"""

from __future__ import annotations

import torch

from ..checkpoint import TensorSource
from ..config import ModelConfig
from ..ops import each_row, linear, rms_norm
from ..rows import RowBatch
from ..state import AttentionState
from .attend import attend, write_kv

LATENT_NORM_EPS = 1e-6  # kv_a_layernorm / q_a_layernorm use the RMSNorm default, not rms_norm_eps


class LatentAttention:
    def __init__(self, config: ModelConfig, src: TensorSource, prefix: str):
        m = config.mla
        self.cfg = m
        H = config.hidden_size
        p = f"{prefix}.self_attn."
        if m.q_lora_rank is None:
            self.w_q = src.take(p + "q_proj.weight", (m.n_heads * m.qk_head_dim, H))
        else:
            self.w_q_a = src.take(p + "q_a_proj.weight", (m.q_lora_rank, H))
            self.q_a_norm = src.take(p + "q_a_layernorm.weight", (m.q_lora_rank,))
            self.w_q_b = src.take(p + "q_b_proj.weight", (m.n_heads * m.qk_head_dim, m.q_lora_rank))
        self.w_kv_a = src.take(p + "kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, H))
        self.kv_a_norm = src.take(p + "kv_a_layernorm.weight", (m.kv_lora_rank,))
        self.w_kv_b = src.take(p + "kv_b_proj.weight", (m.n_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))
        self.w_o = src.take(p + "o_proj.weight", (H, m.n_heads * m.v_head_dim))
        self.scale = m.qk_head_dim**-0.5

    def forward(self, x: torch.Tensor, batch: RowBatch, positions: torch.Tensor, state: AttentionState, *,
                row_invariant: bool, prefill: bool = False) -> tuple[torch.Tensor, None]:
        # Attention needs no rollback record: its cursor is the committed position.
        query, key, value = each_row(self._project, x, row_invariant=row_invariant)
        write_kv(batch, state, key, value)
        out = attend(batch, state, query, self.scale, row_invariant=row_invariant, prefill=prefill)
        return each_row(self._output, out, row_invariant=row_invariant), None

    def _project(self, x: torch.Tensor):
        """x [n, H] -> query, key [n, heads, nope+rope], value [n, heads, v]."""
        m, n = self.cfg, x.shape[0]
        if m.q_lora_rank is None:
            q = linear(x, self.w_q)
        else:
            q = linear(rms_norm(linear(x, self.w_q_a), self.q_a_norm, LATENT_NORM_EPS, zero_centred=False), self.w_q_b)
        kv_a = linear(x, self.w_kv_a)
        latent = rms_norm(kv_a[:, : m.kv_lora_rank], self.kv_a_norm, LATENT_NORM_EPS, zero_centred=False)
        k_shared = kv_a[:, m.kv_lora_rank :]
        kv = linear(latent, self.w_kv_b).view(n, m.n_heads, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, value = kv[..., : m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim :]
        key = torch.cat((k_nope, k_shared[:, None, :].expand(n, m.n_heads, m.qk_rope_head_dim)), dim=-1)
        return q.view(n, m.n_heads, m.qk_head_dim), key, value

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        return linear(out.reshape(out.shape[0], -1), self.w_o, into_add_norm=True)
