"""A step's inputs packed in one int64 buffer, so one copy moves all of them to the device.
The design in full: DESIGN.md section 3, "Step inputs".
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch


class StepRows(Protocol):
    """What `fill` reads of a batch of rows (verifier/model/rows.py's RowBatch, which builds its
    device tensors through this buffer: the protocol keeps the two modules from importing each other)."""

    slots: Sequence[int]  # [S] each sequence's slot
    starts: Sequence[int]  # [S] each sequence's committed position
    counts: Sequence[int]  # [S] each sequence's rows
    carried: Sequence[int]  # [S] rows each sequence's slot carries from its last step
    n_rows: int

_WORDS_PER_ALIGN = 2  # int64 words per 16 bytes


def _aligned(words: int) -> int:
    return -(-words // _WORDS_PER_ALIGN) * _WORDS_PER_ALIGN


def _cu_rows_at(sequences: int) -> int:
    """Where cu_rows starts in the int32 section: after seq_slots, on a 16-byte (4 int32) boundary."""
    return -(-sequences // 4) * 4


def _carried_at(sequences: int) -> int:
    """Where carried starts in the int32 section: after cu_rows, on a 16-byte boundary."""
    return _cu_rows_at(sequences) + -(-(sequences + 1) // 4) * 4


class StepInputs:
    def __init__(self, rows: int, sequences: int, device: torch.device | str, pin: bool = False):
        """A zeroed buffer for R = `rows` rows in S = `sequences` sequences on `device` (pinned host
        memory with pin=True, so a copy to the GPU can run asynchronously)."""
        self.rows, self.sequences = rows, sequences
        int32_words = _aligned((_carried_at(sequences) + sequences + 1) // 2)
        self.buffer = torch.zeros(3 * _aligned(rows) + int32_words, dtype=torch.int64, device=device, pin_memory=pin)
        self._bind_views()

    def batch_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(seq_slots, cu_rows, row_slots, positions, carried): what RowBatch.attach takes."""
        return self.seq_slots, self.cu_rows, self.row_slots, self.positions, self.carried

    def fill(self, tokens: torch.Tensor | Sequence[int] | None, batch: StepRows) -> StepInputs:
        """Write `batch` (exactly this buffer's R rows and S sequences: pad it first, see padding.py)
        and its first len(tokens) row tokens (a host int64 tensor or a list of ints; the rest 0, a
        valid id for padding rows) on the host, with a handful of numpy ops per step on views made
        once (the step's host time is on a batch-1 step's critical path), none per token. Returns self."""
        views = self._host_views
        assert views is not None, "StepInputs.fill writes a host buffer"
        assert len(batch.slots) == self.sequences and batch.n_rows == self.rows, \
            f"StepInputs of {self.rows} rows in {self.sequences} sequences, batch of {batch.n_rows} in {len(batch.slots)}"
        token_view, row_slots, positions, seq_slots, cu_rows, carried = views
        n_tokens = 0 if tokens is None else len(tokens)
        if n_tokens:
            token_view[:n_tokens] = tokens.cpu().numpy() if isinstance(tokens, torch.Tensor) else tokens
        if n_tokens < self.rows:
            token_view[n_tokens:] = 0
        carried[:] = batch.carried if batch.carried else 0
        if self.rows == self.sequences and min(batch.counts, default=1) == 1:
            # one row a sequence (a decode, padded with one-row sequences or not): row s is
            # sequence s's, so the rows' slots and positions are the sequences' own (half the ops)
            row_slots[:] = seq_slots[:] = batch.slots
            positions[:] = batch.starts
            cu_rows[:] = self._row_index
            self._layout = None
            return self
        layout = (batch.slots, batch.counts)
        if layout != self._layout:
            # the rows' slots and sequences: written when they change, which a bucket's steps seldom
            # do (the same sequences at the same K); a fill runs with the GPU idle. H200 host, a batch-1
            # K = 8 fill takes a few microseconds this way, several times less than refilling all
            counts = np.asarray(batch.counts, dtype=np.int64)
            ends = np.cumsum(counts)
            row_sequence = np.repeat(np.arange(len(counts)), counts)  # [R]: each row's sequence
            row_slots[:] = np.asarray(batch.slots, dtype=np.int64)[row_sequence]
            seq_slots[:] = batch.slots
            cu_rows[0] = 0
            cu_rows[1:] = ends
            # [R]: each row's index within its sequence
            self._row_sequence, self._row_within = row_sequence, self._row_index[:-1] - (ends - counts)[row_sequence]
            self._layout = layout
        positions[:] = np.asarray(batch.starts, dtype=np.int64)[self._row_sequence] + self._row_within
        return self

    def to(self, device: torch.device | str, non_blocking: bool = False) -> StepInputs:
        """A copy on `device` with the same layout: one copy of the whole buffer."""
        out = StepInputs.__new__(StepInputs)
        out.__dict__.update(self.__dict__)
        out.buffer = self.buffer.to(device, non_blocking=non_blocking)
        out._bind_views()
        return out

    def copy_(self, source: StepInputs, non_blocking: bool = False) -> None:
        """Overwrite this buffer with `source` (same layout): one copy; the views stay valid."""
        self.buffer.copy_(source.buffer, non_blocking=non_blocking)
        self._layout = None  # a host buffer's layout is now source's, which fill does not know

    def _bind_views(self) -> None:
        r = _aligned(self.rows)
        self.tokens = self.buffer[: self.rows]
        self.row_slots = self.buffer[r : r + self.rows]
        self.positions = self.buffer[2 * r : 2 * r + self.rows]
        int32 = self.buffer[3 * r :].view(torch.int32)
        cu_at = _cu_rows_at(self.sequences)
        self.seq_slots = int32[: self.sequences]
        self.cu_rows = int32[cu_at : cu_at + self.sequences + 1]
        carried_at = _carried_at(self.sequences)
        self.carried = int32[carried_at : carried_at + self.sequences]
        # numpy views of a host buffer, made once: fill writes through them
        self._host_views = None
        if self.buffer.device.type == "cpu":
            self._host_views = tuple(t.numpy() for t in (self.tokens, self.row_slots, self.positions, self.seq_slots,
                                                          self.cu_rows, self.carried))
            # 0 .. R: each row's index within the step ([:-1]), and a one-row-a-sequence batch's cu_rows
            self._row_index = np.arange(self.rows + 1)
            # (slots, counts) of the batch whose rows' slots, seq_slots and cu_rows the buffer holds
            # (None: unknown), with its rows' sequence and index within it: fill rewrites them on a change only
            self._layout = None
