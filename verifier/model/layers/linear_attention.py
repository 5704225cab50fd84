"""The body GDN and KDA share: the short conv, then the delta rule, sequence by sequence, row by row.

In COMMIT mode (prefill) the slot's conv window and recurrent state advance as rows are consumed.
In SNAPSHOT and WOA modes (verify) they are only read; what rollback needs goes to a RowRecord.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..ops import causal_conv_row
from ..rollback import COMMIT, SNAPSHOT, RowRecord
from ..rows import RowBatch
from ..state import RecurrentState
from .recurrence import read_state, update_state


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
                  split_heads: Heads, decay: torch.Tensor, beta: torch.Tensor, d_v: int,
                  mode: str = COMMIT, record: dict[int, RowRecord] | None = None) -> torch.Tensor:
    """conv_inputs [rows, conv_dim] raw; split_heads maps one conv output row [1, conv_dim] to fp32
    (query, key [1, heads, d_k], value [1, heads, d_v]); decay [rows, heads, d_k or 1, 1];
    beta [rows, heads] -> fp32 outputs [rows, heads, d_v]. Verify modes fill record[slot]."""
    out = torch.empty(conv_inputs.shape[0], beta.shape[1], d_v, dtype=torch.float32, device=conv_inputs.device)
    for slot, _, span in batch.sequences():
        mixed, next_window = conv_sequence(state.conv[slot], conv_inputs[span], conv_weight)
        s = state.recurrent[slot]
        states, keys, values = [], [], []
        for r in range(span.stop - span.start):
            q, k, v = split_heads(mixed[r : r + 1].clone())
            i = span.start + r
            s = update_state(s, k[0], v[0], decay[i], beta[i])
            out[i] = read_state(s, q[0])
            states.append(s)
            keys.append(k[0])
            values.append(v[0])
        if mode == COMMIT:
            state.conv[slot] = next_window
            state.recurrent[slot] = s
        elif mode == SNAPSHOT:
            record[slot] = RowRecord(conv_inputs=conv_inputs[span], states=torch.stack(states))
        else:
            record[slot] = RowRecord(conv_inputs=conv_inputs[span], keys=torch.stack(keys), values=torch.stack(values),
                                     decays=decay[span], betas=beta[span])
    return out
