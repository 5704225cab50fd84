"""The one verify entry point: verify rows and roll back, eager or through CUDA graphs.

Callers (the engine's step, the model drafter) never ask which: a graph replays the eager path's
kernels with the same arguments, so both give the same bits (DESIGN.md section 6, rule 9).

Both paths pack a step's tokens and batch into one buffer (step_inputs.py) and move it to the
device in one copy. Graphed, a step of one sequence of R <= one_sequence_rows rows replays its exact
one-sequence bucket, and any other step of R rows runs padded to the smallest shared bucket of at
least R rows (padding.py); eager, it runs as it is, or padded the same way with pad_eagerly (tests: the
graphs' padding on the CPU reference backend).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .graphs import GraphedSteps, graphs_supported
from .padding import BucketShape, bucket_for, bucket_shapes, one_sequence_shapes, pad_batch, padded_kept
from .carry import note_kept, with_carried
from .rollback import WOA, VerifyRecord, apply_rollback, check_consumed
from .rows import RowBatch
from .state import SlotPool
from .step_inputs import StepInputs


@dataclass
class Verified:
    """What `StepRunner.verify` hands back for its `rollback` (and, graphed, the step's argmax ids)."""

    batch: RowBatch  # the step as the caller sent it: kept counts are checked against it
    shape: BucketShape | None  # the bucket it was padded to; None: unpadded
    record: VerifyRecord | None  # eager: the forward's record (graphed: the bucket owns it)
    bucket: object | None = None  # graphed: the bucket whose rollback graph replays
    mode: str | None = None  # the verify's rollback mode
    # graphed: rows -> the argmax of the verify's first `rows` rows as host ints, which its graph
    # computed (graphs.py, Greedy ids); None: eager (the caller computes them from the logits)
    greedy_ids: Callable[[int], list[int]] | None = None


class StepRunner:
    def __init__(self, model, pool: SlotPool, cuda_graphs: bool = True, graph_rows: tuple[int, ...] = (),
                 pad_eagerly: bool = False, one_sequence_rows: int = 0):
        """cuda_graphs: use graphs where the backend supports them (Triton on a GPU); eager otherwise.
        graph_rows: the shared buckets' row counts (checked by the caller: padding.check_graph_rows).
        one_sequence_rows: a step of one sequence of up to this many rows (the engine's max_k + 1) has
        a bucket of its own, exactly its shape (padding.py: One sequence's buckets); at most the
        largest shared bucket's rows, so that which steps run eagerly is graph_rows' choice alone."""
        self.model, self.pool = model, pool
        self.shapes = bucket_shapes(graph_rows, pool.n_slots)  # shared buckets, fewest rows first
        largest = self.shapes[-1].rows if self.shapes else 0
        # rows -> the one-sequence bucket of a step of one sequence of that many rows
        self.one_sequence = {s.rows: s for s in one_sequence_shapes(min(one_sequence_rows, largest))}
        self.pad_eagerly = pad_eagerly
        # every bucket a step may replay, each once ((1, 1) is shared and one sequence's)
        self.buckets = list(dict.fromkeys(self.shapes + list(self.one_sequence.values())))
        # None when eager
        self.graphs = GraphedSteps(model, pool, self.buckets) if cuda_graphs and self.shapes and graphs_supported(model) else None

    @property
    def graphed(self) -> bool:
        return self.graphs is not None

    @property
    def captures(self) -> int:
        return 0 if self.graphs is None else self.graphs.captures

    @property
    def max_graph_rows(self) -> int | None:
        return self.shapes[-1].rows if self.graphs is not None else None

    def capture(self, mode: str) -> None:
        """Capture every bucket's graphs for `mode` now (nothing when eager)."""
        if self.graphs is not None:
            self.graphs.capture(mode)

    def verify(self, tokens: torch.Tensor | Sequence[int], batch: RowBatch, mode: str, checked: bool = False) -> tuple[torch.Tensor, Verified]:
        """tokens [rows] int64 on the host, or a list of ints (per sequence its pending token, then its drafts) ->
        (logits [rows, vocab] fp32, what `rollback` needs). The logits may live in a graph's output:
        valid until the next verify, so copy what must outlive it. checked: the caller has run
        model.check_rows on these rows already."""
        if not checked:
            self.model.check_rows(tokens, batch, self.pool)
        caller = batch
        batch = with_carried(batch, self.pool)  # each slot's carried rows go first (carry.py)
        shape = bucket_for(self.shapes, self.one_sequence, batch)
        if self.graphs is not None and shape is not None:
            logits, bucket = self.graphs.verify(tokens, batch, shape, mode)
            return logits, Verified(caller, shape, None, bucket, mode, self.graphs.greedy_ids)
        logits, verified = self._eager(tokens, batch, shape if self.pad_eagerly else None, mode)
        return logits, Verified(caller, verified.shape, verified.record, None, mode)

    @torch.inference_mode()
    def _eager(self, tokens: torch.Tensor | Sequence[int] | None, batch: RowBatch, shape: BucketShape | None, mode: str) -> tuple[torch.Tensor, Verified]:
        padded = batch if shape is None else pad_batch(batch, shape, self.pool.scratch_slot)
        device = self.model.device
        inputs = StepInputs(padded.n_rows, len(padded.slots), "cpu").fill(tokens, padded).to(device)
        padded.attach(device, inputs.batch_tensors())
        record = VerifyRecord(mode, padded)
        logits = self.model.compute(inputs.tokens, padded, self.pool, True, False, mode, record)
        return logits[: batch.n_rows], Verified(batch, shape, record)

    def rollback(self, verified: Verified, consumed: list[int]) -> None:
        """Keep rows 0 .. consumed[s]-1 of each sequence of the last verify (consumed = accepted + 1),
        in one copy of the counts to the device."""
        check_consumed(verified.batch, consumed)
        if not verified.batch.committed_in_verify:  # decodes only: no launch, no copy (rows.py)
            kept = list(consumed) if verified.shape is None else padded_kept(list(consumed), verified.shape)
            if verified.bucket is not None:
                self.graphs.rollback(verified.bucket, kept)
            elif verified.record.layers:
                apply_rollback(self.pool, verified.record, torch.tensor(kept, dtype=torch.int32).to(self.model.device))
        note_kept(self.pool, verified.batch, consumed, carried=verified.mode == WOA)

    def step_costs(self, mode: str, repeats: int = 5, budget_s: float = 0.5) -> dict[int, float]:
        """Seconds per step (verify + rollback) of each shared bucket (a one-sequence bucket runs the
        same rows without padding: faster on the H200, bench/results/one_sequence_buckets_2026-12-03.json):
        the median of `repeats` steps of padding rows only (the scratch slot: no real state changes),
        after one untimed step. That is a realistic shape of R_b rows, not a worst case: padding comes in sequences of at
        most padding.PAD_CHUNK rows, so the recurrent kernels walk no sequence longer than a real
        verify does, as they would for a real batch of R_b rows (one sequence of R_b rows would
        make large buckets look far dearer than they are, and the goodput policy trim drafts it
        should verify). Its attention reads short prefixes (positions < R_b of the scratch slot),
        so long real contexts cost more than the table says. Graphed, every bucket's graphs replay (missing ones are captured first). Eager (the CPU
        reference, whose step time grows linearly with the rows), buckets are timed smallest first,
        3 steps each, until `budget_s` has passed, so a test server starts in well under a second;
        the table then ends early (verifier.server.goodput.StepCost extrapolates past its end)."""
        if self.graphs is None:
            repeats = min(repeats, 3)
        costs: dict[int, float] = {}
        began = time.perf_counter()
        for shape in self.shapes:
            if self.graphs is None and costs and time.perf_counter() - began > budget_s:
                break
            times = []
            for _ in range(repeats + 1):
                self._sync()
                start = time.perf_counter()
                self._padding_step(shape, mode)
                self._sync()
                times.append(time.perf_counter() - start)
            costs[shape.rows] = statistics.median(times[1:])
        return costs

    def _padding_step(self, shape: BucketShape, mode: str) -> None:
        if self.graphs is not None:
            self.graphs.replay_padding(shape, mode)
            return
        empty = RowBatch((), (), ())
        _, verified = self._eager(None, empty, shape, mode)
        self.rollback(verified, [])

    def _sync(self) -> None:
        if torch.device(self.model.device).type == "cuda":
            torch.cuda.synchronize()
