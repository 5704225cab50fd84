"""A ragged batch of rows: for each sequence its slot, committed position and number of rows; and
the one check of a batch's rows against a pool (`check_rows`)."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .step_inputs import StepInputs


@dataclass(frozen=True)
class RowBatch:
    """Rows of all sequences stacked in order; sequence s owns rows offsets[s] .. offsets[s+1].

    Row r of sequence s sits at position starts[s] + r of slot slots[s]: decode has one row per
    sequence, verify K+1, prefill the prompt (or a chunk of it).

    scratch_slot: set only on a batch padded to a graph bucket or captured for one
    (verifier/model/padding.py pad_batch, capture_batch): its padding sequences sit in that slot, may
    repeat and may have no rows. Every other sequence has its own slot and at least one row.
    """

    slots: tuple[int, ...]
    starts: tuple[int, ...]  # committed position p of each sequence before these rows
    counts: tuple[int, ...]  # rows per sequence
    scratch_slot: int | None = None
    # rows each sequence's slot carries from its last step, not yet in its committed recurrent
    # state (verifier/model/rollback.py); () for none
    carried: tuple[int, ...] = ()
    # device -> (seq_slots, cu_rows, row_slots, positions, carried): built once per batch and device, so a
    # forward makes no host-to-device copies after its first use (and a CUDA graph can own them)
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        # what the engine's step guarantees (one entry per sequence, each sequence once): a caller bug
        # otherwise. Builtins over the tuples: a batch-1 step builds three batches on its critical path.
        slots, counts, scratch = self.slots, self.counts, self.scratch_slot
        assert len(slots) == len(self.starts) == len(counts), "RowBatch: slots, starts and counts differ in length"
        if scratch is None:
            real_slots, real_counts = slots, counts
        else:
            real_slots = [slot for slot in slots if slot != scratch]
            real_counts = [c for c, slot in zip(counts, slots) if slot != scratch]
        assert len(set(real_slots)) == len(real_slots), f"RowBatch: a slot appears twice in one batch: {slots}"
        assert min(real_counts, default=1) >= 1 and min(counts, default=0) >= 0 and min(self.starts, default=0) >= 0, \
            "RowBatch: every sequence needs at least one row and a non-negative start"
        assert not self.carried or (len(self.carried) == len(slots) and min(self.carried) >= 0), \
            "RowBatch: carried needs one count >= 0 per sequence"

    @property
    def n_rows(self) -> int:
        return sum(self.counts)

    @property
    def committed_in_verify(self) -> bool:
        """Every sequence has one row: its verify committed it (kernels/one_row_commit.py), so its
        rollback has nothing to do."""
        return all(c == 1 for c in self.counts)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        """[S + 1]: sequence s owns rows offsets[s] .. offsets[s+1]-1 (made once a batch: a step's
        acceptance and its results both read them)."""
        return tuple(itertools.accumulate(self.counts, initial=0))

    def sequences(self):
        """(slot, start, row slice) for each sequence, in order."""
        offsets = self.offsets
        for s, (slot, start) in enumerate(zip(self.slots, self.starts)):
            yield slot, start, slice(offsets[s], offsets[s + 1])

    @staticmethod
    def _device_key(device) -> str:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" must share one cache entry
            device = torch.device("cuda", torch.cuda.current_device())
        return str(device)

    def attach(self, device, tensors: tuple[torch.Tensor, ...]) -> None:
        """Use these (seq_slots, cu_rows, row_slots, positions, carried) on `device`: views of a step's packed
        inputs (verifier/model/step_inputs.py), or a graph's static inputs."""
        self._on_device[self._device_key(device)] = tensors

    def _tensors(self, device) -> tuple[torch.Tensor, ...]:
        key = self._device_key(device)
        if key not in self._on_device:
            packed = StepInputs(self.n_rows, len(self.slots), "cpu").fill(None, self).to(key)
            self._on_device[key] = packed.batch_tensors()
        return self._on_device[key]

    def seq_slots(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Slot of every sequence: [sequences] int32."""
        return self._tensors(device)[0]

    def cu_rows(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Row offsets: sequence s owns rows cu_rows[s] .. cu_rows[s+1]-1. [sequences + 1] int32."""
        return self._tensors(device)[1]

    def row_slots(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Slot of every row: [n_rows] int64."""
        return self._tensors(device)[2]

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Absolute position of every row: [n_rows] int64."""
        return self._tensors(device)[3]

    def carried_rows(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows each sequence's slot carries from its last step: [sequences] int32 (zeros for none)."""
        return self._tensors(device)[4]


def check_rows(tokens: torch.Tensor | Sequence[int] | None, batch: RowBatch, max_seq_len: int, vocab_size: int) -> None:
    """Assert what callers guarantee (the server and the in-process path check their inputs, the
    engine the context room), before the batch touches any state: a failure is a caller bug. The one
    check of a batch's rows: a step's (verifier/model/step.py, once per step) and prefill's
    (HybridModel.forward). tokens: [rows] int64 on the host, or a list of ints (the engine's:
    builtins, no tensor ops); None: padding rows only (token 0)."""
    if tokens is not None:
        is_tensor = isinstance(tokens, torch.Tensor)
        shape = tuple(tokens.shape) if is_tensor else (len(tokens),)
        assert shape == (batch.n_rows,), f"tokens has shape {list(shape)}, expected [{batch.n_rows}]"
    end = max((p + c for p, c in zip(batch.starts, batch.counts)), default=0)
    assert end <= max_seq_len, f"rows reach position {end - 1}, past the pool's max_seq_len {max_seq_len}"
    if tokens is not None and batch.n_rows:
        # on the host tokens, before they move: no device sync
        low, high = (int(tokens.min()), int(tokens.max())) if is_tensor else (min(tokens), max(tokens))
        assert 0 <= low and high < vocab_size, f"token id out of range 0..{vocab_size - 1}"
