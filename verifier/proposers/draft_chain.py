"""The model drafter's k drafts of one proposal in one CUDA graph replay (issue 13, item 3).

Eager, each draft costs a choice with a host sync, clones of every recurrent layer's state, and a
one-row verify and rollback through the engine's runner (host packing, two copies to the device,
two replays): host work far above the GPU work of a small draft model. A DraftChain records the
whole proposal once per k, and a proposal is then one copy of the start position to the device,
one replay and one copy of the k draft ids back.

One proposal of k drafts from committed position p (the slot has consumed p tokens and `logits`
[1, vocab] predicts the token at p):
    for i in 0 .. k-1:
        drafts[i] = the session's choice from logits, for position p + i   (on the device)
        if i < k-1:
            boundary i <- the slot's conv windows, recurrent states and logits   (what _save keeps)
            consume drafts[i] at position p + i: the one-row verify, then the rollback keeping
                that row (the engine's kernels and shapes, so the eager path's bits) -> logits
The choice is greedy (argmax, ties to the lowest id: torch.argmax's answer) or, on CUDA, coupled
sampling (the device path of verifier/sampling.choose_rows: the same kernel and threshold ops).

Static buffers. A graph reads and writes fixed addresses: the start position, the one-row step
inputs (token and position written by in-graph ops from the start and the chosen draft; the slot
fixed at construction), the running logits, the draft ids and the k-1 boundary buffers. A replay
overwrites all of them, so what a proposal hands out (its boundaries, its last logits) is valid
until the next proposal; the drafter settles every boundary in its sync, which runs before the
next proposal (ModelProposer asserts it).

Capture happens at construction, for every k up to max_k, after one eager run of the largest
chain in the pool's scratch slot (it compiles the kernels; its rollback keeps nothing and the
scratch slot's KV is padding's anyway). Without CUDA graphs (graphed=False, the CPU reference:
tests) every proposal runs the same body eagerly: the same buffers and device-side positions and
tokens, none of the speed.
"""

from __future__ import annotations

import torch

from kernels.runtime import pick
from kernels.sampling import argmax_rows, argmax_rows_ref, coupled_choice

from ..model import RowBatch
from ..model.rollback import WOA, VerifyRecord, apply_rollback
from ..model.state import RecurrentState, SlotPool
from ..model.step_inputs import StepInputs
from ..params import SamplingParams
from ..sampling import seed_as_int64, masks_on, keep_threshold

# A saved draft boundary: per recurrent layer (conv window [conv_dim, W-1], recurrent state
# [heads, d_k, d_v] fp32), and the logits [vocab] fp32 predicting the token at that boundary.
Boundary = tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


class DeviceChoice:
    """The session's choice of a draft from logits [1, vocab] fp32, written into out [1] int64,
    without a host sync: what verifier.sampling.choose returns for the same row and position."""

    def __init__(self, params: SamplingParams, vocab: int, device: torch.device):
        self.params = params
        if not params.greedy:
            if torch.device(device).type != "cuda":
                raise ValueError("a coupled draft is chosen on the device only on CUDA (the CPU draws its noise on the host)")
            self.temperature = torch.tensor([params.temperature], dtype=torch.float32, device=device)  # [1]
            self.seeds = torch.tensor([seed_as_int64(params.seed)], dtype=torch.int64, device=device)  # [1]
            self.masked = masks_on(params, vocab)

    def __call__(self, logits: torch.Tensor, position: torch.Tensor, out: torch.Tensor) -> None:
        """position [1] int64: where the chosen token will sit (coupled sampling's noise key)."""
        if self.params.greedy:
            pick(argmax_rows, argmax_rows_ref, logits)(logits, out=out)
            return
        threshold = None
        if self.masked:  # choose_rows' threshold, for its one row
            threshold = keep_threshold(logits[0].float() / self.temperature[0], self.params).view(1)
        coupled_choice(logits, self.temperature, self.seeds, position, threshold, out=out)


class DraftChain:
    def __init__(self, model, pool: SlotPool, slot: int, max_k: int, params: SamplingParams, graphed: bool):
        """Chains of 1 .. max_k drafts for `slot` of `pool` (WOA rollback, as the drafter's engine),
        choosing as `params` says; graphed: capture each chain now (CUDA), else run eagerly."""
        if max_k < 1:
            raise ValueError(f"max_k must be at least 1, got {max_k}")
        if max_k > pool.max_seq_len:
            raise ValueError(f"a chain of {max_k} drafts consumes {max_k - 1} rows, past max_seq_len {pool.max_seq_len}")
        self.model, self.pool, self.slot, self.max_k = model, pool, slot, max_k
        self.device = torch.device(model.device)
        vocab = model.config.vocab_size
        self.choose = DeviceChoice(params, vocab, self.device)
        self.graphed = graphed
        device = self.device
        self._start = torch.zeros(1, dtype=torch.int64, device=device)  # [1]: p, the proposal's first draft position
        self._host_start = torch.zeros(1, dtype=torch.int64, pin_memory=graphed)
        self._logits = torch.zeros(1, vocab, dtype=torch.float32, device=device)  # running: predicts the next draft
        self._drafts = torch.zeros(max_k, dtype=torch.int64, device=device)  # [max_k] the draft ids
        self._host_drafts = torch.zeros(max_k, dtype=torch.int64, pin_memory=graphed)
        self._inputs = _one_row_inputs(slot, device)
        self._keep_row = torch.ones(1, dtype=torch.int32, device=device)  # rollback keeps the consumed draft
        boundaries = max_k - 1
        layers = [layer for layer in pool.layers if isinstance(layer, RecurrentState)]
        self._layers = layers
        self._saved_conv = [torch.zeros((boundaries, *layer.conv.shape[1:]), dtype=layer.conv.dtype, device=device)
                            for layer in layers]  # per layer [max_k - 1, conv_dim, W-1]
        self._saved_recurrent = [torch.zeros((boundaries, *layer.recurrent.shape[1:]), dtype=torch.float32, device=device)
                                 for layer in layers]  # per layer [max_k - 1, heads, d_k, d_v]
        self._saved_logits = torch.zeros(boundaries, vocab, dtype=torch.float32, device=device)  # [max_k - 1, vocab]
        self.captures = 0  # chain graphs captured since construction
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if graphed:
            self._capture_all()

    @property
    def logits(self) -> torch.Tensor:
        """[vocab] fp32: after a proposal of k > 1 drafts, the logits predicting the token after
        drafts[k-2] (valid until the next proposal)."""
        return self._logits[0]

    def boundary(self, i: int) -> Boundary:
        """Views of boundary i (the slot before consuming drafts[i]) of the last proposal, valid
        until the next proposal overwrites them."""
        assert 0 <= i < self.max_k - 1, f"boundary {i} outside 0 .. {self.max_k - 2}"
        states = [(conv[i], recurrent[i]) for conv, recurrent in zip(self._saved_conv, self._saved_recurrent)]
        return states, self._saved_logits[i]

    @torch.inference_mode()
    def propose(self, logits: torch.Tensor, start: int, k: int) -> list[int]:
        """k drafts from `logits` [vocab] (predicting the token at position `start`, the slot's
        committed position); the slot ends with drafts[0 .. k-2] consumed."""
        assert 1 <= k <= self.max_k, f"a chain of {k} drafts; chains hold 1 .. {self.max_k}"
        assert start + k - 1 <= self.pool.max_seq_len, f"drafts consumed up to position {start + k - 2}, past the slot"
        if logits.data_ptr() != self._logits.data_ptr():  # a fresh row (sync consumed tokens) or a boundary's
            self._logits[0].copy_(logits)
        self._host_start[0] = start
        self._start.copy_(self._host_start, non_blocking=True)
        if self.graphed:
            self._graphs[k].replay()
        else:
            self._run(k, self.slot, self._inputs, self._keep_row, start)
        self._host_drafts[:k].copy_(self._drafts[:k], non_blocking=True)
        if self.device.type == "cuda":
            # the ids are needed now; this also settles both copies from the pinned buffers
            torch.cuda.current_stream(self.device).synchronize()
        return self._host_drafts[:k].tolist()

    def _run(self, k: int, slot: int, inputs: StepInputs, kept: torch.Tensor, start: int) -> None:
        """The chain's body (module docstring). `start` is p on the host, for the host fields of the
        one-row batches (the CPU reference's attention reads them; kernels read only the device
        tensors, so a capture passes any value)."""
        for i in range(k):
            torch.add(self._start, i, out=inputs.positions)  # where drafts[i] sits
            choice = self._drafts[i : i + 1]
            self.choose(self._logits, inputs.positions, choice)
            if i + 1 == k:
                break  # the last draft is consumed only if the verifier keeps it
            self._save(i, slot)
            inputs.tokens.copy_(choice)
            batch = RowBatch(slots=(slot,), starts=(start + i,), counts=(1,))
            batch.attach(self.device, inputs.batch_tensors())
            record = VerifyRecord(WOA, batch)
            self.model.compute(inputs.tokens, batch, self.pool, True, False, WOA, record, self._logits)
            apply_rollback(self.pool, record, kept)
            # a batch read under another device key would be built from its host fields: stale positions in a graph
            assert len(batch._on_device) == 1, f"the chain's batch was read on more than one device key: {list(batch._on_device)}"

    def _save(self, i: int, slot: int) -> None:
        for layer, conv, recurrent in zip(self._layers, self._saved_conv, self._saved_recurrent):
            conv[i].copy_(layer.conv[slot])
            recurrent[i].copy_(layer.recurrent[slot])
        self._saved_logits[i].copy_(self._logits[0])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # one eager run of the longest chain first, in the scratch slot: it compiles every kernel
        # outside a capture; keeping no row, it commits nothing (the scratch slot's state stays zero)
        scratch = self.pool.scratch_slot
        keep_none = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._run(self.max_k, scratch, _one_row_inputs(scratch, self.device), keep_none, 0)
        torch.cuda.synchronize(self.device)
        memory = torch.cuda.graph_pool_handle()  # one replays at a time and keeps nothing in its temporaries
        for k in range(1, self.max_k + 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory):
                self._run(k, self.slot, self._inputs, self._keep_row, 0)
            self._graphs[k] = graph
            self.captures += 1


def _one_row_inputs(slot: int, device: torch.device) -> StepInputs:
    """The step inputs of one row in one sequence of `slot`: token and position are written per draft."""
    return StepInputs(1, 1, "cpu").fill(None, RowBatch(slots=(slot,), starts=(0,), counts=(1,))).to(device)
