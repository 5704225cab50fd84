"""CUDA graphs of verify and rollback, one pair per bucket, captured at startup.
Buckets, inputs and outputs, greedy ids, the rollback graph and capture: DESIGN.md section 6,
"CUDA graph buckets".
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from hybrid_kernels import dependent_launch
from hybrid_kernels.sampling import argmax_rows

from .padding import BucketShape, capture_batch, pad_batch
from .rollback import Rollback
from .rows import RowBatch, StepInputs
from .sizes import FULL_BATCH_ROWS

# Total verify rows per shared bucket (one session's steps have buckets of their own: padding.py, One
# sequence's buckets). Decode at batch b is b rows, so the small counts are dense (1..6); past 8 the
# steps grow by at most 1.25x to 2 x 256 (padding wastes at most a fifth of a step there), then
# 1.33x to 512 and by 64 rows (one more draft for 64 sessions) up to FULL_BATCH_ROWS (sizes.py:
# 64 sessions at K = 8, the default max_k), the largest: a step past it runs eagerly, launch by
# launch, and then the host's launches, not the kernels, set its time (`python -m bench.gpu` times
# the graphed steps; its step_timeline splits a step's wall time into GPU-busy time and host). With
# one shared graph memory pool the graph memory is that of the largest bucket, so the list costs
# capture time (two graphs each at startup), not memory.
_LADDER = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 448, 512, 576, 640,
           704, 768)
DEFAULT_GRAPH_ROWS = tuple(r for r in _LADDER if r < FULL_BATCH_ROWS) + (FULL_BATCH_ROWS,)


def reachable_rows(buckets: tuple[int, ...], most: int) -> tuple[int, ...]:
    """The buckets (ascending) a step of at most `most` rows can replay: those up to `most`, and the
    smallest one past it (a step between the last of those and `most` pads up to it). An engine of
    8 slots at K = 8 (at most 72 rows) captures none of the buckets of 96 .. 576 rows."""
    past = [r for r in buckets if r >= most]
    return tuple(r for r in buckets if r < most) + tuple(past[:1])


# Buckets of more rows are captured without programmatic dependent launch (kernels/dependent_launch.py):
# their kernels run in several waves, and early-resident waiting blocks slow the step (H200, 2B
# model, timed in turns with and without it; smaller buckets gain from it)
PDL_MAX_ROWS = 96


def graphs_supported(model) -> bool:
    """Whether a model's steps may be graphed: the Triton backend, and no tensor parallelism (a
    rank's steps run eagerly: capturing its collectives in a graph is not written yet)."""
    from hybrid_kernels.runtime import use_triton

    return use_triton(model.embed) and getattr(model, "parallel", None) is None


@contextlib.contextmanager
def collector_paused():
    """Python's cycle collector off for a CUDA graph capture, back on after. A collection inside a
    capture may free an unreachable engine's graphs or events (objects in reference cycles, freed
    only by the collector), and destroying one while a stream captures invalidates the capture.
    torch collects before a capture only when asked to (torch.compiler.config.force_cudagraph_gc,
    off by default). The H200's GPU tests failed so ("operation failed due to a previous error
    during capture") in three of four runs where the engine tests, which make and drop many
    engines, ran first, with PDL on and off; this is the likely cause, not a proven one. Holding the
    collector off costs nothing: the garbage is collected after the capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def captured(body: Callable[[], None], memory) -> torch.cuda.CUDAGraph:
    """A CUDA graph of body() captured into graph memory pool `memory`, with the cycle collector
    paused: the one capture of every graph here (the engine's buckets, the draft chain's and the
    MTP chain's steps)."""
    graph = torch.cuda.CUDAGraph()
    with collector_paused(), torch.cuda.graph(graph, pool=memory):
        body()
    return graph


@dataclass
class _Bucket:
    shape: BucketShape
    inputs: StepInputs  # on the device: the verify graph's static inputs
    host: StepInputs  # pinned twin the step is packed into
    kept: torch.Tensor  # [S_b] int32 on the device: the rollback graph's static input
    host_kept: torch.Tensor  # [S_b] int32, pinned
    # each graph's first node copies its pinned inputs: the verify's (and its last node the ids
    # back), the rollback's kept counts. A verify waits for the bucket's last verify before
    # rewriting its inputs (not for the rollback after it: a step's inputs are written while the last
    # step's rollback graph still runs); a rollback for its own verify, which the stream ran after
    # the bucket's last rollback (one event: a rollback's own record is a driver call on the step's
    # host critical path while the GPU waits, and its verify's ids have been waited for already;
    # `python -m bench.gpu` times the steps).
    verified: torch.cuda.Event  # recorded after the verify replay
    verify_graph: torch.cuda.CUDAGraph
    rollback_graph: torch.cuda.CUDAGraph
    rollback_tables: list[torch.Tensor]  # the rollback graph reads these pointer tables in every replay
    # whether `verified` was recorded since the host last waited on it (a wait on a passed event
    # still costs a driver call: a step waits on its verify three times, for the ids, before its
    # rollback and before the bucket's next verify)
    verify_pending: bool = False
    host_kept_view: np.ndarray = field(init=False)  # host_kept as numpy, made once

    def __post_init__(self):
        self.host_kept_view = self.host_kept.numpy()

    def wait_verified(self) -> None:
        """Wait for the bucket's last verify replay (at once when it has been waited for since)."""
        if self.verify_pending:
            self.verified.synchronize()
            self.verify_pending = False


class GraphedSteps:
    def __init__(self, model, pool, shapes: list[BucketShape], rollback: Rollback):
        if not shapes:
            raise ValueError("GraphedSteps needs at least one bucket")
        self.model, self.pool, self.way_back = model, pool, rollback  # not `rollback`: that is the method below
        self.device = model.device
        self.shapes = shapes
        self.captures = 0  # bucket pairs captured since construction
        self._buckets: dict[BucketShape, _Bucket] = {}
        self._memory = torch.cuda.graph_pool_handle()
        most_rows = max(shape.rows for shape in shapes)
        self._logits = torch.empty(most_rows, model.config.vocab_size, dtype=torch.float32, device=self.device)
        # every verify's final-normed hidden rows (the LM head's input, an MTP head's), shared as the
        # logits are: one [rows, H] copy per replay, read by a step that asks (Step.verify(hidden_out))
        self._hidden = torch.empty(most_rows, model.config.hidden_size, dtype=model.dtype, device=self.device)
        # each row's argmax, computed in the verify graph and copied to pinned memory by its last node
        self._ids = torch.empty(most_rows, dtype=torch.int64, device=self.device)
        self._host_ids = torch.empty(most_rows, dtype=torch.int64).pin_memory()
        self._host_ids_view = self._host_ids.numpy()  # read as numpy, made once: slicing a tensor costs more host time
        self._last: _Bucket | None = None

    def capture(self) -> None:
        """Capture every bucket's verify and rollback graphs (those not captured yet)."""
        for shape in self.shapes:
            self._bucket(shape)

    def _bucket(self, shape: BucketShape) -> _Bucket:
        """`shape`'s bucket, captured first if it is not yet. A captured one is a dict
        lookup: inference mode, whose entry and exit are host work on a batch-1 step's critical
        path (`python -m bench.gpu` times that step), wraps the capture only."""
        bucket = self._buckets.get(shape)
        if bucket is not None:
            return bucket
        pdl = contextlib.nullcontext() if shape.rows <= PDL_MAX_ROWS else dependent_launch.suspended()
        with torch.inference_mode(), pdl:
            return self._new_bucket(shape)

    def _new_bucket(self, shape: BucketShape) -> _Bucket:
        scratch = self.pool.scratch_slot
        static = capture_batch(shape, scratch)  # padding only: what the graph is captured on
        host = StepInputs(shape.rows, shape.sequences, "cpu", pin=True).fill(None, static)
        inputs = host.to(self.device)
        static.attach(self.device, inputs.batch_tensors())
        kept = torch.zeros(shape.sequences, dtype=torch.int32, device=self.device)
        logits_out, hidden_out = self._logits[: shape.rows], self._hidden[: shape.rows]
        ids_out, host_ids = self._ids[: shape.rows], self._host_ids[: shape.rows]
        # eager once, outside the capture: compiles every kernel of this shape (rollback keeps 0 rows)
        rollback = self.way_back
        warm = rollback.record(static)
        self.model.compute(inputs.tokens, static, self.pool, row_invariant=True, last_only=False, record=warm,
                           logits_out=logits_out, hidden_out=hidden_out)
        argmax_rows(logits_out, out=ids_out)
        rollback.plan(self.pool, warm).apply(kept)
        torch.cuda.synchronize()
        record = rollback.record(static)
        host_kept = torch.zeros(shape.sequences, dtype=torch.int32).pin_memory()

        def verify_step():
            inputs.copy_(host, non_blocking=True)  # captured: the replay reads the pinned buffer
            self.model.compute(inputs.tokens, static, self.pool, row_invariant=True, last_only=False, record=record,
                               logits_out=logits_out, hidden_out=hidden_out)
            argmax_rows(logits_out, out=ids_out)  # greedy choices (DESIGN.md section 6, "CUDA graph buckets": greedy ids)
            host_ids.copy_(ids_out, non_blocking=True)

        verify_graph = self._capture(verify_step)
        # the record's addresses are the verify graph's from here on: its pointer tables are built once, here
        plan = rollback.plan(self.pool, record)
        def rollback_step():
            kept.copy_(host_kept, non_blocking=True)  # captured, as the verify's inputs
            plan.apply(kept)

        rollback_graph = self._capture(rollback_step)
        if len(static._on_device) != 1:  # a second copy of the batch would be baked into the graph
            raise RuntimeError(f"verify read its batch on more than one device key: {list(static._on_device)}")
        self._release(record)
        bucket = _Bucket(shape, inputs, host, kept, host_kept, torch.cuda.Event(), verify_graph,
                         rollback_graph, plan.tables)
        self._buckets[shape] = bucket
        self.captures += 1
        return bucket

    def _capture(self, step) -> torch.cuda.CUDAGraph:
        return captured(step, self._memory)

    @staticmethod
    def _release(record) -> None:
        """Drop the captured record's tensors: a record lives from a verify replay to its rollback
        replay and nothing replays between them, so its memory goes back to the shared pool for the
        next bucket's capture (the graphs keep their addresses)."""
        record.layers.clear()

    def verify(self, tokens: torch.Tensor | Sequence[int], batch: RowBatch, shape: BucketShape) -> tuple[torch.Tensor, _Bucket]:
        """Replay `shape`'s verify graph on the step (tokens [R] int64 on the host or a list of ints, batch checked)
        -> (logits [R, vocab] fp32, a view of the shared logits buffer valid until the next verify;
        the bucket, for `rollback`)."""
        bucket = self._bucket(shape)
        bucket.wait_verified()
        bucket.host.fill(tokens, pad_batch(batch, shape, self.pool.scratch_slot))
        bucket.verify_graph.replay()  # its first node copies bucket.host to bucket.inputs
        bucket.verified.record()
        bucket.verify_pending = True
        self._last = bucket
        return self._logits[: batch.n_rows], bucket

    def hidden(self, rows: int) -> torch.Tensor:
        """The last verify's final-normed hidden rows [rows, H]: a view of the shared buffer, valid
        until the next verify (its replay writes them; copy them out on the stream)."""
        return self._hidden[:rows]

    def greedy_ids(self, rows: int) -> list[int]:
        """The argmax of each of the last verify's first `rows` rows, as host ints: waits for its
        graph (whose last node copies them to pinned memory), then reads them."""
        if self._last is None:
            raise RuntimeError("greedy_ids must follow a verify, before its rollback")
        self._last.wait_verified()
        return self._host_ids_view[:rows].tolist()

    def rollback(self, bucket: _Bucket, kept: list[int]) -> None:
        """Replay the bucket's rollback graph with per-sequence kept counts (padding sequences' 0 included)."""
        if bucket is not self._last:
            raise RuntimeError("graphed rollback must follow its own verify")
        bucket.wait_verified()  # its verify done, so the bucket's last rollback (before it) too
        bucket.host_kept_view[:] = kept
        bucket.rollback_graph.replay()  # its first node copies bucket.host_kept to bucket.kept
        self._last = None

    def replay_padding(self, shape: BucketShape) -> None:
        """A step of padding rows only through `shape`'s graphs: what a step of that bucket costs."""
        self.verify(torch.zeros(0, dtype=torch.int64), RowBatch((), (), ()), shape)
        self.rollback(self._last, [0] * shape.sequences)
