"""What a verify forward leaves behind for rollback, and the rollback itself (DESIGN.md section 4).

Verify never writes a slot's committed conv window or recurrent state. Per recurrent layer and
sequence it records, for its rows 0..K:
  both modes: the raw conv inputs [K+1, conv_dim] (rollback re-slices the window);
  snapshot:   the recurrent state after each row [K+1, heads, d_k, d_v] (rollback copies row a's);
  write-on-accept (WOA): the stash of what each row's update consumes: key [K+1, heads, d_k],
              value [K+1, heads, d_v], decay [K+1, heads, d_k or 1, 1], beta [K+1, heads]
              (rollback folds rows 0..a into the committed state with the one update function).
Attention needs no record: its cursor is the committed position, and KV rows past it are
overwritten before anything reads them.

Per sequence, recurrent layer and verify of K+1 rows (S = heads * d_k * d_v * 4 bytes of state;
g = 1 for GDN, d_k for KDA):
  snapshot: verify reads S and writes (K+1) * S; rollback reads S and writes S.
  WOA:      verify reads S and writes (K+1) * heads * (d_k + d_v + g + 1) * 4 bytes of stash;
            the fold reads (a+1) stash rows, reads S and writes S.
At Qwen3-Next sizes (32 heads of 128 x 128: S = 2 MiB) and K = 8 that is ~22 MiB per layer
for snapshot against ~6.3 MiB for WOA. bench/rollback measures both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layers.recurrence import update_state
from .state import RecurrentState, SlotPool

COMMIT = "commit"  # prefill: write the state as rows are consumed
SNAPSHOT = "snapshot"
WOA = "woa"
ROLLBACK_MODES = (WOA, SNAPSHOT)


@dataclass
class RowRecord:
    """One sequence's rows through one recurrent layer."""

    conv_inputs: torch.Tensor  # [n, conv_dim] raw inputs
    states: torch.Tensor | None = None  # snapshot: [n, heads, d_k, d_v] fp32
    keys: torch.Tensor | None = None  # WOA: [n, heads, d_k]
    values: torch.Tensor | None = None  # WOA: [n, heads, d_v]
    decays: torch.Tensor | None = None  # WOA: [n, heads, d_k or 1, 1]
    betas: torch.Tensor | None = None  # WOA: [n, heads]


class VerifyRecord:
    """Records of one verify forward: recurrent layer index -> slot -> RowRecord."""

    def __init__(self, mode: str):
        if mode not in ROLLBACK_MODES:
            raise ValueError(f"rollback mode must be one of {ROLLBACK_MODES}, got {mode!r}")
        self.mode = mode
        self.layers: dict[int, dict[int, RowRecord]] = {}

    def layer(self, index: int) -> dict[int, RowRecord]:
        return self.layers.setdefault(index, {})


def rollback(pool: SlotPool, record: VerifyRecord, slot: int, consumed: int) -> None:
    """Bring `slot` to 'rows 0 .. consumed-1 consumed' (consumed = accepted + 1)."""
    for index, per_slot in record.layers.items():
        row = per_slot[slot]
        state: RecurrentState = pool.layers[index]
        if not 1 <= consumed <= row.conv_inputs.shape[0]:
            raise ValueError(f"rollback of slot {slot}: {consumed} rows consumed, but {row.conv_inputs.shape[0]} were verified")
        keep = state.conv.shape[-1]
        window = torch.cat((state.conv[slot], row.conv_inputs[:consumed].t().to(state.conv.dtype)), dim=1)
        state.conv[slot] = window[:, window.shape[1] - keep :]
        if record.mode == SNAPSHOT:
            state.recurrent[slot] = row.states[consumed - 1]
        else:
            s = state.recurrent[slot]
            for r in range(consumed):
                s = update_state(s, row.keys[r], row.values[r], row.decays[r], row.betas[r])
            state.recurrent[slot] = s
