"""The engine step's one home: a Step (one verify and its rollback) and the StepRunner that makes them.
The design in full: DESIGN.md section 6, "The engine step".
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hybrid_kernels.fused_rollback import TableStore

from .graphs import GraphedSteps, captured, graphs_supported
from .padding import BucketShape, bucket_for, bucket_shapes, buckets, capture_batch, pad_batch, padded_kept
from .rollback import ROLLBACKS, WOA, Rollback, RollbackPlan, check_consumed
from .rows import RowBatch, StepInputs, check_rows, to_device
from .state import RecurrentState, SlotPool


@dataclass
class PromptRows:
    """Prompt rows a step takes in with its verify (HybridModel.compute's prompts; DESIGN.md
    section 9, "Prompts inside a step"): every row committed, each with the bits of its own prefill
    forward. groups: the prompt chunks' RowBatches, each what one prefill forward would hold;
    tokens: their rows' tokens in order [rows] int64 on the host; hidden: an optional [rows, H]
    buffer for their final-normed hidden rows. After the step's verify, logits holds each prompt
    sequence's last row [sequences, vocab] fp32."""

    groups: tuple[RowBatch, ...]
    tokens: torch.Tensor
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    @property
    def n_rows(self) -> int:
        return sum(group.n_rows for group in self.groups)


class Step:
    """One verify of a ragged batch and its rollback (DESIGN.md section 6, "The engine step"). Made by StepRunner.step."""

    def __init__(self, runner: StepRunner, tokens: torch.Tensor | Sequence[int] | None, batch: RowBatch, rows: RowBatch,
                 shape: BucketShape | None, prompts: PromptRows | None = None):
        self.runner = runner
        self.prompts = prompts  # prompt rows its verify takes in (eager; their rows are committed, not rolled back)
        self.tokens = tokens  # [rows] int64 on the host or a list of ints: per sequence its pending token, then its drafts
        self.batch = batch  # the step as the caller sent it: kept counts are checked against it
        self.rows = rows  # what the forward runs: `batch` as the runner's Rollback has it (with its slots' carried rows)
        self.shape = shape  # the bucket it fits (None: past the largest, or no buckets)
        self.logits: torch.Tensor | None = None  # after verify: [rows, vocab] fp32, valid until the next verify
        self.greedy_ids: Callable[[int], list[int]] | None = None
        self._padded_to: BucketShape | None = None  # the shape its verify ran padded to (None: as it is)
        self._record = None  # eager: the forward's VerifyRecord (graphed: the bucket owns it)
        self._bucket = None  # graphed: the bucket whose rollback graph replays
        self._rolled_back = False

    def verify(self, hidden_out: torch.Tensor | None = None) -> torch.Tensor:
        """Run the verify -> logits [rows, vocab] fp32. They may live in a graph's output buffer:
        valid until the next verify, so copy what must outlive it.
        hidden_out: an optional [rows, H] buffer the final-normed hidden rows (the LM head's input,
        which an MTP head reads: verifier/model/mtp.py) are copied into; graphed, from the graphs'
        shared hidden output, which every verify replay writes (the same values: the same forward)."""
        if self.logits is not None:
            raise RuntimeError("a step verifies once")
        runner = self.runner
        if runner.graphs is not None and self.shape is not None:
            self.logits, self._bucket = runner.graphs.verify(self.tokens, self.rows, self.shape)
            self.greedy_ids = runner.graphs.greedy_ids
            self._padded_to = self.shape
            if hidden_out is not None:
                hidden_out.copy_(runner.graphs.hidden(self.rows.n_rows))
        else:
            self._padded_to = self.shape if runner.pad_eagerly else None
            self.logits, self._record = runner.eager(self.tokens, self.rows, self._padded_to, hidden_out, self.prompts)
        return self.logits

    def rollback(self, consumed: list[int]) -> None:
        """Keep rows 0 .. consumed[s]-1 of each sequence (consumed = accepted + 1), in one copy of
        the counts to the device; a step of decodes only has nothing to roll back (its verify
        committed every row: kernels/one_row_commit.py)."""
        if self.logits is None or self._rolled_back:
            raise RuntimeError("a step rolls back once, after its verify")
        check_consumed(self.batch, consumed)
        runner = self.runner
        if not self.batch.committed_in_verify:
            kept = list(consumed) if self._padded_to is None else padded_kept(list(consumed), self._padded_to)
            if self._bucket is not None:
                runner.graphs.rollback(self._bucket, kept)
            elif self._record.layers:
                runner.rollback.plan(runner.pool, self._record).apply(torch.tensor(kept, dtype=torch.int32).to(runner.model.device))
        self._rolled_back = True
        runner.rollback.kept(runner.pool, self.batch, consumed)


class StepRunner:
    def __init__(self, model, pool: SlotPool, rollback: Rollback = ROLLBACKS[WOA], cuda_graphs: bool = True,
                 graph_rows: tuple[int, ...] = (), pad_eagerly: bool = False, one_sequence_rows: int = 0):
        """rollback: how every step's recurrent state goes back to the accepted rows (the pool's
        carried rows are sized for it: Rollback.carry_rows).
        cuda_graphs: use graphs where the backend supports them (Triton on a GPU); eager otherwise.
        graph_rows: the shared buckets' row counts (checked by the caller: padding.check_graph_rows).
        one_sequence_rows: a step of one sequence of up to this many rows (the engine's max_k + 1) has
        a bucket of its own, exactly its shape (padding.py: One sequence's buckets)."""
        self.model, self.pool, self.rollback = model, pool, rollback
        self.shared = bucket_shapes(graph_rows, pool.n_slots)  # the step-cost table's buckets, fewest rows first
        self.buckets = buckets(graph_rows, pool.n_slots, one_sequence_rows)  # every bucket a step may replay
        self.pad_eagerly = pad_eagerly
        # None when eager
        self.graphs = GraphedSteps(model, pool, self.buckets, rollback) if cuda_graphs and self.buckets and graphs_supported(model) else None

    @property
    def graphed(self) -> bool:
        return self.graphs is not None

    @property
    def captures(self) -> int:
        """Graph buckets (a verify and a rollback graph each) captured since construction."""
        return 0 if self.graphs is None else self.graphs.captures

    @property
    def max_graph_rows(self) -> int | None:
        """The largest bucket's rows (a step with more runs eagerly); None when not graphed."""
        return self.buckets[-1].rows if self.graphs is not None else None

    def capture(self) -> None:
        """Capture every bucket's graphs now (nothing when eager)."""
        if self.graphs is not None:
            self.graphs.capture()

    def step(self, tokens: torch.Tensor | Sequence[int] | None, batch: RowBatch, prompts: PromptRows | None = None) -> Step:
        """The Step of `batch` (tokens [rows] int64 on the host or a list of ints; None: padding
        rows, token 0): its rows checked, its slots' carried rows attached; no state touched.
        prompts: prompt rows its verify takes in; such a step runs eagerly (its shape is no bucket's)."""
        check_rows(tokens, batch, self.pool.max_seq_len, self.model.config.vocab_size)
        for group in prompts.groups if prompts is not None else ():
            check_rows(None, group, self.pool.max_seq_len, self.model.config.vocab_size)
        rows = self.rollback.rows(batch, self.pool)  # each slot's carried rows go first (rollback.py, Carried rows)
        shape = bucket_for(self.buckets, rows) if prompts is None and (self.graphs is not None or self.pad_eagerly) else None
        return Step(self, tokens, batch, rows, shape, prompts)

    @torch.inference_mode()
    def eager(self, tokens: torch.Tensor | Sequence[int] | None, batch: RowBatch, shape: BucketShape | None,
              hidden_out: torch.Tensor | None = None, prompts: PromptRows | None = None):
        """The eager verify of a checked batch (padded to `shape` unless None) -> (logits of its
        own rows, the VerifyRecord its rollback reads). hidden_out: Step.verify's, [batch rows, H].
        prompts: prompt rows after the batch's (shape None), whose logits and hidden rows it fills."""
        padded = batch if shape is None else pad_batch(batch, shape, self.pool.scratch_slot)
        device = self.model.device
        inputs = StepInputs(padded.n_rows, len(padded.slots), "cpu").fill(tokens, padded).to(device)
        padded.attach(device, inputs.batch_tensors())
        record = self.rollback.record(padded)
        width = self.model.config.hidden_size
        if hidden_out is not None:
            assert hidden_out.shape == (batch.n_rows, width), \
                f"hidden_out has shape {list(hidden_out.shape)}, expected [{batch.n_rows}, {width}]"
        row_tokens, groups, total = inputs.tokens, (), padded.n_rows
        if prompts is not None:
            assert shape is None, "a step that takes prompts in is not padded"
            row_tokens = torch.cat((inputs.tokens, to_device(prompts.tokens, device)))
            groups, total = prompts.groups, total + prompts.n_rows
        hidden = hidden_out
        if (hidden_out is not None or (prompts is not None and prompts.hidden is not None)) and total != batch.n_rows:
            # padding rows, or prompt rows, come after the batch's own (as the logits' slice says)
            hidden = torch.empty(total, width, dtype=self.model.dtype, device=device)
        logits = self.model.compute(row_tokens, padded, self.pool, row_invariant=True, last_only=False, record=record,
                                    hidden_out=hidden, prompts=groups)
        if hidden is not hidden_out:
            if hidden_out is not None:
                hidden_out.copy_(hidden[: batch.n_rows])
            if prompts is not None and prompts.hidden is not None:
                prompts.hidden.copy_(hidden[padded.n_rows :])
        if prompts is not None:
            prompts.logits = logits[padded.n_rows :]
        return logits[: batch.n_rows], record

    def padding_step(self, shape: BucketShape) -> None:
        """A step of padding rows only, of `shape`, in the scratch slot (no real state changes): what
        a bucket's capture runs (padding.capture_batch, a rollback keeping nothing), through the
        bucket's graphs where graphed, else eagerly."""
        if self.graphs is not None:
            self.graphs.replay_padding(shape)
            return
        _, record = self.eager(None, capture_batch(shape, self.pool.scratch_slot), None)
        if record.layers:
            self.rollback.plan(self.pool, record).apply(torch.zeros(shape.sequences, dtype=torch.int32, device=self.model.device))

    def step_costs(self, repeats: int = 5, budget_s: float = 0.5) -> dict[int, float]:
        """Seconds per step (verify + rollback) of each shared bucket (a one-sequence bucket runs the
        same rows without padding, faster: it times a batch-1 step, not R rows of any batch):
        the median of `repeats` padding steps (`padding_step`: no real state changes),
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
        for shape in self.shared:
            if self.graphs is None and costs and time.perf_counter() - began > budget_s:
                break
            times = []
            for _ in range(repeats + 1):
                self._sync()
                start = time.perf_counter()
                self.padding_step(shape)
                self._sync()
                times.append(time.perf_counter() - start)
            costs[shape.rows] = statistics.median(times[1:])
        return costs

    def _sync(self) -> None:
        if torch.device(self.model.device).type == "cuda":
            torch.cuda.synchronize()


def verify(model, pool: SlotPool, tokens: torch.Tensor | Sequence[int], batch: RowBatch,
           rollback: Rollback = ROLLBACKS[WOA]) -> Step:
    """An eager Step outside an engine (tests, benches), verified: its `logits`, then its `rollback`."""
    step = StepRunner(model, pool, rollback, cuda_graphs=False).step(tokens, batch)
    step.verify()
    return step


def decode(model, pool: SlotPool, slots: list[int], positions: list[int], tokens: list[int]) -> torch.Tensor:
    """One token for each of several slots, each at its own position -> logits [len(slots), vocab].
    Decode is verify with no drafts: one row per slot, then the rollback keeps that row."""
    batch = RowBatch(slots=tuple(slots), starts=tuple(positions), counts=(1,) * len(slots))
    step = verify(model, pool, list(tokens), batch)
    step.rollback([1] * len(slots))
    return step.logits


class FixedStep:
    """Steps of one sequence of `rows` rows in `slot` whose inputs sit at fixed device addresses,
    written by device ops between steps (`tokens`, `positions`: [rows] int64 views of one device
    StepInputs): the steps a CUDA graph chains (the model drafter's draft chain,
    verifier/proposers/draft_chain.py). `run` is the eager Step's forward and rollback plan, so its
    bits are the engine's. A pool that carries no rows only (the drafter's engine, max_k 0): a
    chained step has no host count of its slot's carried rows to attach."""

    def __init__(self, model, pool: SlotPool, slot: int, rows: int, rollback: Rollback = ROLLBACKS[WOA]):
        if pool.carry_rows:
            raise ValueError(f"FixedStep: the pool carries {pool.carry_rows} rows a slot; chained steps run on a pool that carries none")
        self.model, self.pool, self.slot, self.rows, self.rollback = model, pool, slot, rows, rollback
        self.device = torch.device(model.device)
        batch = RowBatch(slots=(slot,), starts=(0,), counts=(rows,))
        self.inputs = StepInputs(rows, 1, "cpu").fill(None, batch).to(self.device)
        self.tokens, self.positions = self.inputs.tokens, self.inputs.positions  # [rows] int64, the caller writes them

    def run(self, start: int, kept: torch.Tensor, logits_out: torch.Tensor, graph: StepGraph | None = None) -> None:
        """Verify the rows (writing logits_out [rows, vocab] fp32), then roll back to kept [1] int32
        rows. start: the sequence's position on the host, for the batch's host fields (the CPU
        reference's attention reads them; kernels read only the device tensors, so a capture may pass
        any value). graph: the StepGraph being captured, whose store holds the rollback's tables."""
        batch = RowBatch(slots=(self.slot,), starts=(start,), counts=(self.rows,))
        batch.attach(self.device, self.inputs.batch_tensors())
        record = self.rollback.record(batch)
        self.model.compute(self.inputs.tokens, batch, self.pool, row_invariant=True, last_only=False, record=record,
                           logits_out=logits_out)
        # every recurrent layer's window in one launch and state in another, as a graph bucket rolls
        # back; in a capture the tables are written when it ends (StepGraph.capture)
        plan = self.rollback.plan(self.pool, record, None if graph is None else graph.store)
        if graph is not None:
            graph.plans.append(plan)
        plan.apply(kept)
        # a batch read under another device key would be built from its host fields: stale positions in a graph
        assert len(batch._on_device) == 1, f"a fixed step's batch was read on more than one device key: {list(batch._on_device)}"


class StepGraph:
    """One CUDA graph of up to `steps` FixedStep runs (and whatever device ops the caller puts
    between them), captured into the graph memory pool `memory`. A rollback plan's pointer table is
    written by a host to device copy, never inside a capture, so each run's plan takes its table from
    `store` (allocated here, before the capture) and the tables are written once the capture has
    ended; the graph reads them in every replay, so whoever keeps the graph keeps this object."""

    def __init__(self, pool: SlotPool, steps: int, memory, device: torch.device):
        recurrent = sum(isinstance(layer, RecurrentState) for layer in pool.layers)
        self.graph: torch.cuda.CUDAGraph | None = None  # captured by `capture`
        self.store = TableStore(steps * recurrent, device)  # a table row per recurrent layer and step
        self.memory = memory
        self.plans: list[RollbackPlan] = []  # during the capture: its plans, tables unwritten

    def capture(self, body: Callable[[], None]) -> None:
        """Capture body() (its FixedStep runs pass graph=self), then write their tables."""
        try:
            self.graph = captured(body, self.memory)
            for plan in self.plans:
                plan.fill_tables()
        finally:
            self.plans = []

    def replay(self) -> None:
        self.graph.replay()
