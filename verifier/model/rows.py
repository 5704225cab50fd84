"""A ragged batch of rows: for each sequence its slot, committed position and number of rows."""

from __future__ import annotations

from dataclasses import dataclass

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

    def __post_init__(self):
        if not (len(self.slots) == len(self.starts) == len(self.counts)):
            raise ValueError("RowBatch: slots, starts and counts differ in length")
        if len(set(self.slots)) != len(self.slots):
            raise ValueError(f"RowBatch: a slot appears twice in one batch: {self.slots}")
        if any(c < 1 for c in self.counts) or any(p < 0 for p in self.starts):
            raise ValueError("RowBatch: every sequence needs at least one row and a non-negative start")

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

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Absolute position of every row: [n_rows] int64."""
        return torch.cat(
            [torch.arange(p, p + c, dtype=torch.int64) for p, c in zip(self.starts, self.counts)]
        ).to(device)
