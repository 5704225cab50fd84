"""The one verify entry point: verify rows and roll back, eager or through CUDA graphs.

Callers (the engine's step, the model drafter) never ask which: a graph replays the eager path's
kernels with the same arguments, so both give the same bits (DESIGN.md section 6, rule 9).
"""

from __future__ import annotations

import torch

from .graphs import GraphedSteps, graphs_supported
from .rollback import VerifyRecord, rollback
from .rows import RowBatch
from .state import SlotPool


class StepRunner:
    def __init__(self, model, pool: SlotPool, cuda_graphs: bool = True):
        """cuda_graphs: use graphs where the backend supports them (Triton on a GPU); eager otherwise."""
        self.model, self.pool = model, pool
        # None when eager; tests reach the bucket cache through it
        self.graphs = GraphedSteps(model, pool) if cuda_graphs and graphs_supported(model) else None

    @property
    def graphed(self) -> bool:
        return self.graphs is not None

    def verify(self, tokens: torch.Tensor, batch: RowBatch, mode: str) -> tuple[torch.Tensor, VerifyRecord]:
        """tokens [rows] int64 (per sequence its pending token, then its drafts) -> (logits [rows, vocab]
        fp32, the record `rollback` needs). Graphed, the logits live in the graph's static output:
        valid until the next verify, so copy what must outlive it."""
        if self.graphs is not None:
            return self.graphs.verify(tokens, batch, mode)
        return self.model.verify(tokens, batch, self.pool, mode)

    def rollback(self, record: VerifyRecord, consumed: list[int]) -> None:
        """Keep rows 0 .. consumed[s]-1 of each sequence of the last verify (consumed = accepted + 1)."""
        if self.graphs is not None:
            self.graphs.rollback(record, consumed)
        else:
            rollback(self.pool, record, consumed)
