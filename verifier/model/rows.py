"""A ragged batch of rows: for each sequence its slot, committed position and number of rows; the
one check of a batch's rows against a pool (`check_rows`); and a step's inputs packed in one int64
buffer, so one copy moves all of them to the device (`StepInputs`: DESIGN.md section 3, "Step inputs")."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from hybrid_kernels.delta_rule_chunked import chunk_table


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor's copy on `device` that does not wait for the device: on CUDA through pinned
    memory, asynchronously (a copy from pageable memory waits for every kernel queued before it, so
    the host could not launch a forward while the one before still runs). The same values either way."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


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
    # (what, device) -> prefill's chunked delta rule's inputs (seq_starts, chunk_table): apart from
    # _on_device, whose one entry per device a step's graph holds
    _prefill_on_device: dict = field(default_factory=dict, compare=False, repr=False)

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
        inputs (StepInputs, below), or a graph's static inputs."""
        self._on_device[self._device_key(device)] = tensors

    def _tensors(self, device) -> tuple[torch.Tensor, ...]:
        key = self._device_key(device)
        if key not in self._on_device:
            on_cuda = torch.device(key).type == "cuda"
            packed = StepInputs(self.n_rows, len(self.slots), "cpu", pin=on_cuda).fill(None, self).to(key, non_blocking=on_cuda)
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

    def seq_starts(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Committed position of every sequence before these rows: [sequences] int32 (prefill's
        chunked delta rule aligns its sub-chunks to them; made once per batch and device)."""
        key = ("starts", self._device_key(device))
        if key not in self._prefill_on_device:
            self._prefill_on_device[key] = to_device(torch.tensor(self.starts, dtype=torch.int32), key[1])
        return self._prefill_on_device[key]

    def chunk_table(self, chunk: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The sub-chunks of these rows at absolute multiples of `chunk` (prefill's chunked delta
        rule: kernels/delta_rule_chunked.py's chunk_table), made once per batch, chunk and device."""
        key = (chunk, self._device_key(device))
        if key not in self._prefill_on_device:
            self._prefill_on_device[key] = to_device(chunk_table(self.starts, self.counts, chunk), key[1])
        return self._prefill_on_device[key]

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

    def fill(self, tokens: torch.Tensor | Sequence[int] | None, batch: RowBatch) -> StepInputs:
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
