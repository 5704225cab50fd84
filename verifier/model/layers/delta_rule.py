"""The short conv and the gated delta rule shared by GDN (scalar decay per head) and KDA (decay per key channel).

One state update function serves prefill, decode, verify and (later) the write-on-accept fold,
so every path applies a row to the state with the same arithmetic. Recurrent state is fp32.

Per row, per head, state S [d_k, d_v]:
    S = S * decay                      decay = exp(g): [heads, 1, 1] (GDN) or [heads, d_k, 1] (KDA)
    u = sum_k S[k, :] * key[k]
    S = S + key (outer) (beta * (value - u))
    out = sum_k S[k, :] * query[k]
"""

from __future__ import annotations

from typing import Callable

import torch

from ..ops import causal_conv_row
from ..rows import RowBatch
from ..state import RecurrentState


def update_state(state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """state [heads, d_k, d_v]; key [heads, d_k]; value [heads, d_v]; decay [heads, d_k or 1, 1]; beta [heads]."""
    state = state * decay
    recalled = (state * key[..., None]).sum(dim=-2)  # [heads, d_v]
    delta = (value - recalled) * beta[..., None]
    return state + key[..., None] * delta[..., None, :]


def read_state(state: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """state [heads, d_k, d_v]; query [heads, d_k] -> [heads, d_v]."""
    return (state * query[..., None]).sum(dim=-2)


def conv_sequence(window: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's rows through the short conv, one row at a time.

    window [channels, W-1] raw inputs before the first row; inputs [n, channels]; weight [channels, W]
    -> (outputs [n, channels] after SiLU, the next window [channels, W-1]).
    """
    width, n = weight.shape[1], inputs.shape[0]
    seq = torch.cat((window.t().to(inputs.dtype), inputs), dim=0)  # [W-1+n, channels]
    out = torch.cat([causal_conv_row(seq[r : r + width], weight) for r in range(n)])
    return out, seq[n:].t()


Heads = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def mix_sequences(batch: RowBatch, state: RecurrentState, conv_inputs: torch.Tensor, conv_weight: torch.Tensor,
                  split_heads: Heads, decay: torch.Tensor, beta: torch.Tensor, d_v: int) -> torch.Tensor:
    """Conv then delta rule, sequence by sequence and row by row, committing each slot's state.

    conv_inputs [rows, conv_dim] raw; split_heads maps one conv output row [1, conv_dim] to fp32
    (query, key [1, heads, d_k], value [1, heads, d_v]); decay [rows, heads, d_k or 1, 1];
    beta [rows, heads] -> fp32 outputs [rows, heads, d_v].
    """
    out = torch.empty(conv_inputs.shape[0], beta.shape[1], d_v, dtype=torch.float32, device=conv_inputs.device)
    for slot, _, span in batch.sequences():
        mixed, state.conv[slot] = conv_sequence(state.conv[slot], conv_inputs[span], conv_weight)
        s = state.recurrent[slot]
        for i in range(span.start, span.stop):
            q, k, v = split_heads(mixed[i - span.start : i - span.start + 1].clone())
            s = update_state(s, k[0], v[0], decay[i], beta[i])
            out[i] = read_state(s, q[0])
        state.recurrent[slot] = s
    return out
