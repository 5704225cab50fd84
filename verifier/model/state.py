"""Slot state: a pool of `n_slots` sequences of up to `max_seq_len` positions,
plus one scratch slot.
The design in full: DESIGN.md section 4, "Slot state".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_kernels.delta_rule import carry_shapes

from .config import ATTENTION, GDN, KDA, MLA, ModelConfig


@dataclass
class AttentionState:
    keys: torch.Tensor
    values: torch.Tensor

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the layer's slot state, by name (all slots on dim 0)."""
        return {"keys": self.keys, "values": self.values}


@dataclass
class CarriedRows:
    """Per slot, the stash rows of its last step that its committed recurrent state does not hold
    yet (verifier/model/rollback.py): rows 0 .. SlotPool.carried[slot] - 1 of each, C = max_k + 1 rows."""

    keys: torch.Tensor  # [n_slots + 1, C, heads, d_k] fp32
    values: torch.Tensor  # [n_slots + 1, C, heads, d_v] fp32
    decays: torch.Tensor  # [n_slots + 1, C, heads, 1 (GDN) or d_k (KDA)] fp32
    betas: torch.Tensor  # [n_slots + 1, C, heads] fp32

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.keys, self.values, self.decays, self.betas


@dataclass
class RecurrentState:
    conv: torch.Tensor
    recurrent: torch.Tensor
    carry: CarriedRows | None = None  # a pool made with carry_rows (write-on-accept engines)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the layer's slot state, by name (all slots on dim 0): the carried rows too."""
        named = {"conv": self.conv, "recurrent": self.recurrent}
        if self.carry is not None:
            named.update(zip(("carry keys", "carry values", "carry decays", "carry betas"), self.carry.tensors))
        return named

    @property
    def scratch_slot(self) -> int:
        """The pool's scratch slot (its last), which a one-row verify never commits to (kernels/delta_rule.py)."""
        return self.recurrent.shape[0] - 1


class PoolFullError(RuntimeError):
    """No free slot."""


class SlotPool:
    def __init__(self, config: ModelConfig, n_slots: int, max_seq_len: int, device: torch.device | str, dtype: torch.dtype,
                 carry_rows: int = 0):
        """carry_rows: C > 0 gives every recurrent layer CarriedRows of C rows a slot (a
        write-on-accept engine of max_k = C - 1: verifier/model/rollback.py); 0: rollback folds."""
        if n_slots < 1 or max_seq_len < 1 or carry_rows < 0:
            raise ValueError(f"SlotPool: n_slots {n_slots} and max_seq_len {max_seq_len} must be positive, carry_rows "
                             f"{carry_rows} not negative")
        self.n_slots = n_slots
        self.max_seq_len = max_seq_len
        self.scratch_slot = n_slots  # padding rows only; never admitted
        self.carry_rows = carry_rows
        self.carried = [0] * (n_slots + 1)  # per slot: its CarriedRows' rows in use (host bookkeeping)
        self.layers: list[AttentionState | RecurrentState] = [
            self._layer_state(config, kind, n_slots + 1, max_seq_len, device, dtype, carry_rows) for kind in config.mixers
        ]
        self._free = list(range(n_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @staticmethod
    def _layer_state(config, kind, n_slots, max_seq_len, device, dtype, carry_rows):
        if kind == ATTENTION:
            a = config.attention
            shape = (n_slots, max_seq_len, a.n_kv_heads, a.head_dim)
            return AttentionState(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        if kind == MLA:
            m = config.mla
            return AttentionState(
                torch.zeros(n_slots, max_seq_len, m.n_heads, m.qk_head_dim, dtype=dtype, device=device),
                torch.zeros(n_slots, max_seq_len, m.n_heads, m.v_head_dim, dtype=dtype, device=device),
            )
        if kind == GDN:
            g = config.gdn
            conv_dim, width, heads, d_k, d_v = g.conv_dim, g.conv_width, g.n_v_heads, g.d_k, g.d_v
        elif kind == KDA:
            k = config.kda
            conv_dim, width, heads, d_k, d_v = k.conv_dim, k.conv_width, k.n_heads, k.head_dim, k.head_dim
        else:
            raise ValueError(f"unknown mixer {kind!r}")
        carry = None
        if carry_rows:
            shapes = carry_shapes(n_slots, carry_rows, heads, d_k, d_v, 1 if kind == GDN else d_k)
            carry = CarriedRows(*(torch.zeros(shape, dtype=torch.float32, device=device) for shape in shapes))
        return RecurrentState(
            torch.zeros(n_slots, conv_dim, width - 1, dtype=dtype, device=device),
            torch.zeros(n_slots, heads, d_k, d_v, dtype=torch.float32, device=device),
            carry,
        )

    @property
    def n_free(self) -> int:
        return len(self._free)

    def admit(self) -> int:
        """Take a free slot; its conv windows and recurrent states start at zero (they accumulate)."""
        if not self._free:
            raise PoolFullError(f"all {self.n_slots} slots are in use")
        slot = self._free.pop()
        self.carried[slot] = 0
        for layer in self.layers:
            if isinstance(layer, RecurrentState):
                layer.conv[slot].zero_()
                layer.recurrent[slot].zero_()
        return slot

    def write_recurrent(self, slot: int, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The slot's conv window and committed recurrent state set to saved[i] in its i-th recurrent
        layer (attention needs nothing: its rows past a position are overwritten before they are
        read); the slot then carries no rows."""
        layers = [layer for layer in self.layers if isinstance(layer, RecurrentState)]
        for layer, (conv, recurrent) in zip(layers, saved, strict=True):
            layer.conv[slot].copy_(conv)
            layer.recurrent[slot].copy_(recurrent)
        self.carried[slot] = 0

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} is outside the pool of {self.n_slots}")
        if slot in self._free:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)
