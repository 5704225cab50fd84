"""A trainable MTP head in the published Qwen3.5 layout, and its unrolled forward for training.
The design in full: DESIGN.md section 9, "Training an MTP head".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _transformers_modules():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    return m


class TrainableMTP(nn.Module):
    def __init__(self, config):
        """config: the target's transformers Qwen3_5TextConfig (its MTP layer copies a full-attention layer's shape)."""
        super().__init__()
        m = _transformers_modules()
        H, eps = config.hidden_size, config.rms_norm_eps
        if "full_attention" not in config.layer_types:
            raise ValueError("the target has no full-attention layer: the published MTP layer is one")
        self.pre_fc_norm_embedding = m.Qwen3_5RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = m.Qwen3_5RMSNorm(H, eps=eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([m.Qwen3_5DecoderLayer(config, config.layer_types.index("full_attention"))])
        self.norm = m.Qwen3_5RMSNorm(H, eps=eps)

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Start from the target's last full-attention layer and final norm, with fc passing the
        normed hidden row through (its embedding half small): step 0 then begins as one more
        target layer over the target's own features."""
        layers = target.model.layers
        last = max(i for i, layer in enumerate(layers) if hasattr(layer, "self_attn"))
        self.layers[0].load_state_dict(layers[last].state_dict())
        self.norm.load_state_dict(target.model.norm.state_dict())
        H = self.fc.weight.shape[0]
        self.fc.weight.zero_()
        self.fc.weight[:, :H].normal_(0.0, 0.02)
        self.fc.weight[:, H:].copy_(torch.eye(H))

    def fuse(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, H] each -> fc(cat(norm_emb(embedded), norm_hidden(hidden))) [B, T, H]."""
        return self.fc(torch.cat((self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)), dim=-1))

    def layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_k: list, past_v: list,
              mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decoder layer over x [B, T, H] whose attention also sees earlier steps' K/V
        (past_k/past_v: [B, kv_heads, T, hd] each) under mask [T, T * (len(past_k) + 1)] (True:
        attend). Returns (x [B, T, H], this step's k, v)."""
        m = _transformers_modules()
        layer = self.layers[0]
        attn = layer.self_attn
        B, T, _ = x.shape
        hd = attn.head_dim
        h = layer.input_layernorm(x)
        q, gate = torch.chunk(attn.q_proj(h).view(B, T, -1, 2 * hd), 2, dim=-1)  # [B, T, heads, hd] each
        gate = gate.reshape(B, T, -1)
        q = attn.q_norm(q).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(h).view(B, T, -1, hd)).transpose(1, 2)
        v = attn.v_proj(h).view(B, T, -1, hd).transpose(1, 2)
        q, k = m.apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = torch.cat([*past_k, k], dim=2), torch.cat([*past_v, v], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
        out = out.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x, k, v

    def unrolled(self, target, tokens: torch.Tensor, hidden: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens [B, T] int64 (a window), hidden [B, T, H] the target's final-normed rows of it.
        Returns each step's final-normed output [B, T, H]: step s's row q (valid for q + s + 1 < T)
        predicts token q + s + 2 through the LM head (DESIGN.md section 9, "Training an MTP head")."""
        B, T = tokens.shape
        embed = target.get_input_embeddings()
        rotary = target.model.rotary_emb
        causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
        eye = torch.eye(T, dtype=torch.bool, device=tokens.device)
        # step s's token at origin q is token q + s + 1: shift left, padding the end (those rows carry no loss)
        padded = F.pad(tokens, (0, steps), value=0)
        outputs, past_k, past_v = [], [], []
        h = hidden
        for s in range(steps):
            # [3, B, T]: the text model's three identical position rows (its rotary takes either form)
            positions = (torch.arange(T, device=tokens.device) + s)[None, None].expand(3, B, T)
            cos, sin = rotary(h, positions)
            x = self.fuse(embed(padded[:, s + 1 : s + 1 + T]), h)
            mask = torch.cat([causal] + [eye] * s, dim=1)
            x, k, v = self.layer(x, cos, sin, past_k, past_v, mask)
            past_k.append(k)
            past_v.append(v)
            h = self.norm(x)
            outputs.append(h)
        return outputs

    def published_tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The head's tensors under their checkpoint names (`mtp.*`), contiguous, on the CPU, in dtype."""
        return {f"mtp.{name}": t.detach().to("cpu", dtype).contiguous() for name, t in self.state_dict().items()}
