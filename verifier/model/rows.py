"""A ragged batch of rows: for each sequence its slot, committed position and number of rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RowBatch:
    """Rows of all sequences stacked in order; sequence s owns rows offsets[s] .. offsets[s+1].

    Row r of sequence s sits at position starts[s] + r of slot slots[s]: decode has one row per
    sequence, verify K+1, prefill the prompt (or a chunk of it).
    """

    slots: tuple[int, ...]
    starts: tuple[int, ...]  # committed position p of each sequence before these rows
    counts: tuple[int, ...]  # rows per sequence
    # device -> (seq_slots, cu_rows, row_slots, positions): built once per batch and device, so a
    # forward makes no host-to-device copies after its first use (and a CUDA graph can own them)
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        # what the engine's step guarantees (one entry per sequence, each sequence once): a caller bug otherwise
        assert len(self.slots) == len(self.starts) == len(self.counts), "RowBatch: slots, starts and counts differ in length"
        assert len(set(self.slots)) == len(self.slots), f"RowBatch: a slot appears twice in one batch: {self.slots}"
        assert all(c >= 1 for c in self.counts) and all(p >= 0 for p in self.starts), \
            "RowBatch: every sequence needs at least one row and a non-negative start"

    @property
    def n_rows(self) -> int:
        return sum(self.counts)

    @property
    def offsets(self) -> list[int]:
        out = [0]
        for c in self.counts:
            out.append(out[-1] + c)
        return out

    def sequences(self):
        """(slot, start, row slice) for each sequence, in order."""
        offsets = self.offsets
        for s, (slot, start) in enumerate(zip(self.slots, self.starts)):
            yield slot, start, slice(offsets[s], offsets[s + 1])

    def _tensors(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" must share one cache entry
            device = torch.device("cuda", torch.cuda.current_device())
        key = str(device)
        if key not in self._on_device:
            rows = [(s, p + r) for s, p, c in zip(self.slots, self.starts, self.counts) for r in range(c)]
            host = (
                torch.tensor(self.slots, dtype=torch.int32),
                torch.tensor(self.offsets, dtype=torch.int32),
                torch.tensor([s for s, _ in rows], dtype=torch.int64),
                torch.tensor([p for _, p in rows], dtype=torch.int64),
            )
            self._on_device[key] = tuple(t.to(device) for t in host)
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
