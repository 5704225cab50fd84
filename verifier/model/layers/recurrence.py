"""The gated delta rule, shared by GDN (scalar decay per head) and KDA (decay per key channel).

`update_state` is the one function that applies a row to a recurrent state: prefill, decode,
verify and the write-on-accept fold all call it, so every path applies a row with the same
arithmetic. fp32 throughout.

Per row, per head, state S [d_k, d_v]:
    S = S * decay                      decay = exp(g): [heads, 1, 1] (GDN) or [heads, d_k, 1] (KDA)
    u = sum_k S[k, :] * key[k]
    S = S + key (outer) (beta * (value - u))
    out = sum_k S[k, :] * query[k]
"""

from __future__ import annotations

import torch


def update_state(state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """state [heads, d_k, d_v]; key [heads, d_k]; value [heads, d_v]; decay [heads, d_k or 1, 1]; beta [heads]."""
    state = state * decay
    recalled = (state * key[..., None]).sum(dim=-2)  # [heads, d_v]
    delta = (value - recalled) * beta[..., None]
    return state + key[..., None] * delta[..., None, :]


def read_state(state: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """state [heads, d_k, d_v]; query [heads, d_k] -> [heads, d_v]."""
    return (state * query[..., None]).sum(dim=-2)
