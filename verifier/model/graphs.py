"""CUDA graphs of verify and rollback, one pair per bucket (rows per sequence, rollback mode).

Eager, a step is bound by launches: ~40 Triton launches per layer at tens of microseconds of
Python each. A graph replays the same kernels with the same arguments, so its bits are the eager
path's bits; only the launch cost goes. A bucket owns static inputs (token ids, and the batch's
slot, offset and position tensors, which the forward reads from RowBatch's device cache) and
static outputs (logits, the rollback record). Before a replay the step's values are copied into
the inputs; the engine copies the logits out and replays the bucket's rollback graph before the
next verify overwrites them.

Buckets are kept in least-recently-used order, at most `max_buckets` of them: a server sees many
mixes of K across its sessions, and every graph holds its own static buffers.

First use of a bucket runs the step eagerly (it warms the Triton caches; verify writes only its
rows' KV, which the replay rewrites with the same bytes, and the eager rollback is the real one),
then captures.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .rollback import VerifyRecord, apply_rollback, check_consumed
from .rows import RowBatch


def graphs_supported(model) -> bool:
    from kernels.runtime import use_triton

    return use_triton(model.embed)


@dataclass
class _Bucket:
    batch: RowBatch  # static: its cached device tensors are the graph's inputs
    tokens: torch.Tensor  # [rows] int64, static input
    kept: torch.Tensor  # [sequences] int32, static input of the rollback graph
    record: VerifyRecord
    logits: torch.Tensor | None = None
    verify_graph: torch.cuda.CUDAGraph | None = None
    rollback_graph: torch.cuda.CUDAGraph | None = None


class GraphedSteps:
    def __init__(self, model, pool, max_buckets: int = 64):
        if max_buckets < 1:
            raise ValueError(f"max_buckets must be at least 1, got {max_buckets}")
        self.model, self.pool = model, pool
        self.device = model.device
        self.max_buckets = max_buckets
        self._buckets: OrderedDict[tuple, _Bucket] = OrderedDict()
        self._last: _Bucket | None = None

    def _load(self, bucket: _Bucket, tokens: torch.Tensor, batch: RowBatch) -> None:
        for static, value in zip(bucket.batch._tensors(self.device), batch._tensors("cpu")):
            static.copy_(value, non_blocking=False)
        bucket.tokens.copy_(tokens)

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, batch: RowBatch, mode: str) -> tuple[torch.Tensor, VerifyRecord]:
        self.model.check_rows(tokens, batch, self.pool)
        key = (batch.counts, mode)
        bucket = self._buckets.get(key)
        if bucket is None:
            static = RowBatch(batch.slots, batch.starts, batch.counts)
            static._tensors(self.device)
            bucket = _Bucket(static, torch.zeros(batch.n_rows, dtype=torch.int64, device=self.device),
                             torch.zeros(len(batch.counts), dtype=torch.int32, device=self.device), VerifyRecord(mode, static))
            self._load(bucket, tokens, batch)
            self.model.compute(bucket.tokens, static, self.pool, True, False, mode, VerifyRecord(mode, static))  # warm-up
            torch.cuda.synchronize()
            bucket.verify_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bucket.verify_graph):
                bucket.logits = self.model.compute(bucket.tokens, static, self.pool, True, False, mode, bucket.record)
            if len(static._on_device) != 1:  # a second copy of the batch would be baked into the graph
                raise RuntimeError(f"verify read its batch on more than one device key: {list(static._on_device)}")
            self._buckets[key] = bucket
            if len(self._buckets) > self.max_buckets:
                self._buckets.popitem(last=False)  # the least recently used graph pair goes
        self._buckets.move_to_end(key)
        self._load(bucket, tokens, batch)
        bucket.verify_graph.replay()
        self._last = bucket
        return bucket.logits, bucket.record

    @torch.inference_mode()
    def rollback(self, record: VerifyRecord, consumed: list[int]) -> None:
        bucket = self._last
        if bucket is None or record is not bucket.record:
            raise RuntimeError("graphed rollback must follow its own verify")
        check_consumed(record.batch, consumed)
        bucket.kept.copy_(torch.tensor(consumed, dtype=torch.int32))
        if bucket.rollback_graph is None:
            apply_rollback(self.pool, record, bucket.kept)  # the real rollback, and the warm-up
            torch.cuda.synchronize()
            bucket.rollback_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bucket.rollback_graph):
                apply_rollback(self.pool, record, bucket.kept)
            return
        bucket.rollback_graph.replay()
