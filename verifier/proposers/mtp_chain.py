"""One sequence's MTP proposal in one CUDA graph replay: the head's analogue of draft_chain.py.
The design in full: DESIGN.md section 9, "The MTP chain".
"""

from __future__ import annotations

import torch

from ..model.graphs import captured
from ..model.mtp import MTPHead
from ..model.rows import RowBatch
from ..model.state import SlotPool
from ..model.rows import StepInputs
from ..params import SamplingParams
from .draft_chain import DeviceChoice

MTP_CHAIN_MAX_K = 8  # drafts per proposal a chain covers (the server's default max_k); more run eagerly


class MTPChain:
    def __init__(self, head: MTPHead, pool: SlotPool, slot: int, max_k: int, params: SamplingParams, graphed: bool,
                 memory=None):
        """Chains of 1 .. max_k drafts after a catch-up of 1 .. max_k + 1 rows (the rows one verify
        consumes: its accepted drafts and the bonus) for `slot` of `pool`, choosing as `params` says.
        memory: the CUDA graph memory pool to capture into (shared by chains that never replay at
        once); None: one of its own."""
        if max_k < 1:
            raise ValueError(f"max_k must be at least 1, got {max_k}")
        self.head, self.pool, self.slot, self.max_k = head, pool, slot, max_k
        self.max_catch = max_k + 1
        self.graphed = graphed
        device = self.device = torch.device(head.device)
        vocab, H = head.vocab_size, head.config.hidden_size
        self.choose = DeviceChoice(params, vocab, device)
        self._host_control = torch.zeros(1 + self.max_catch, dtype=torch.int64, pin_memory=graphed)
        self._host_control_view = self._host_control.numpy()  # written per proposal with no tensor made
        self._control = torch.zeros(1 + self.max_catch, dtype=torch.int64, device=device)  # [s, c tokens]
        self._start = self._control[0:1]
        self._offsets = torch.arange(self.max_catch, dtype=torch.int64, device=device)
        self._hidden = torch.zeros(self.max_catch, H, dtype=head.dtype, device=device)  # the catch-up's hidden rows
        self._catch = {c: self._inputs(c) for c in range(1, self.max_catch + 1)}
        self._one = self._inputs(1)
        self._catch_logits = torch.zeros(self.max_catch, vocab, dtype=torch.float32, device=device)
        self._logits = torch.zeros(1, vocab, dtype=torch.float32, device=device)
        self._position = torch.zeros(1, dtype=torch.int64, device=device)  # the chosen token's position
        self._drafts = torch.zeros(max_k, dtype=torch.int64, device=device)
        self._host_drafts = torch.zeros(max_k, dtype=torch.int64, pin_memory=graphed)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._memory = (memory if memory is not None else torch.cuda.graph_pool_handle()) if graphed else None
        self._done = torch.cuda.Event() if graphed else None
        self.captures = 0  # graphs captured since construction

    def _inputs(self, rows: int) -> StepInputs:
        """A device StepInputs of `rows` rows of this chain's slot (tokens and positions written in-graph)."""
        return StepInputs(rows, 1, "cpu").fill(None, RowBatch((self.slot,), (0,), (rows,))).to(self.device)

    def fits(self, catch_rows: int, k: int) -> bool:
        return 1 <= catch_rows <= self.max_catch and 1 <= k <= self.max_k

    @torch.inference_mode()
    def propose(self, start: int, tokens: list[int], hidden: torch.Tensor, k: int) -> list[int]:
        """k drafts after a catch-up of the rows start .. start + c - 1 (tokens: their c tokens, the
        context's q + 1; hidden [c, H]: their hidden rows). The caller checked the context and that
        the draft rows fit the pool (start + c - 2 + k < max_seq_len)."""
        c = len(tokens)
        assert self.fits(c, k) and hidden.shape == (c, self._hidden.shape[1]), (c, k, list(hidden.shape))
        self._host_control_view[0] = start
        self._host_control_view[1 : 1 + c] = tokens
        self._hidden[:c].copy_(hidden)
        if not self.graphed:
            self._body(start, c, k)
            return self._host_drafts[:k].tolist()
        graph = self._graphs.get((c, k))
        if graph is None:
            graph = self._capture(start, c, k)
        graph.replay()
        self._done.record()
        self._done.synchronize()
        return self._host_drafts[:k].tolist()

    def _capture(self, start: int, c: int, k: int) -> torch.cuda.CUDAGraph:
        self._body(start, c, k)  # eager once: compiles this shape's kernels (the replay rewrites its KV rows)
        graph = captured(lambda: self._body(start, c, k), self._memory)
        self._graphs[(c, k)] = graph
        self.captures += 1
        return graph

    def _body(self, start: int, c: int, k: int) -> None:
        """The proposal (DESIGN.md section 9, "The MTP chain"). `start` feeds the batches' host fields only (the CPU
        reference's attention reads them; kernels read the device tensors, so a capture may pass
        any value)."""
        head, pool, slot = self.head, self.pool, self.slot
        self._control.copy_(self._host_control, non_blocking=self.graphed)
        catch = self._catch[c]
        torch.add(self._offsets[:c], self._start, out=catch.positions)  # s .. s + c - 1
        catch.tokens.copy_(self._control[1 : 1 + c])
        batch = RowBatch((slot,), (start,), (c,))
        batch.attach(self.device, catch.batch_tensors())
        out, _ = head.compute(catch.tokens, self._hidden[:c], batch, pool, row_invariant=True, step=0,
                              logits_out=self._catch_logits[:c])
        torch.add(self._start, c + 1, out=self._position)  # draft 0's token sits at p + 1
        self.choose(self._catch_logits[c - 1 : c], self._position, self._drafts[0:1])
        row, one = out[c - 1 : c], self._one
        for i in range(1, k):
            torch.add(self._start, c - 1 + i, out=one.positions)  # the row's own position, p - 1 + i
            one.tokens.copy_(self._drafts[i - 1 : i])
            batch = RowBatch((slot,), (start + c - 1 + i,), (1,))
            batch.attach(self.device, one.batch_tensors())
            row, _ = head.compute(one.tokens, row, batch, pool, row_invariant=True, step=i, logits_out=self._logits)
            torch.add(self._start, c + 1 + i, out=self._position)
            self.choose(self._logits, self._position, self._drafts[i : i + 1])
        self._host_drafts[:k].copy_(self._drafts[:k], non_blocking=self.graphed)
