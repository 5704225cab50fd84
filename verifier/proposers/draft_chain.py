"""The model drafter's k drafts of one proposal in one CUDA graph replay.
One proposal, catching up, static buffers, steps and capture: DESIGN.md section 9, "The model
drafter's chain".
"""

from __future__ import annotations

import torch

from hybrid_kernels.runtime import pick
from hybrid_kernels.sampling import argmax_rows, argmax_rows_ref, coupled_choice

from ..model.step import FixedStep, StepGraph
from ..params import SamplingParams
from ..sampling import keep_threshold, mask_limits, masks_on, seed_as_int64

# How a proposal first brings the slot to its context (DESIGN.md section 9, "The model drafter's chain": catching up).
NONE, BONUS, TWO, RESTORE_BONUS = "none", "bonus", "two", "restore_bonus"
CATCH_UP_TOKENS = {NONE: 0, BONUS: 1, TWO: 2, RESTORE_BONUS: 1}

# the host-written control words, one copy to the device per proposal
_CATCH_START, _START, _RESTORE, _NEW_TOKENS = 0, 1, 2, 3  # _NEW_TOKENS .. +2: the tokens caught up

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
            # the masks' limits on the device now: a capture may not copy them from the host
            self.limits = mask_limits([params], vocab, device) if self.masked else None

    def __call__(self, logits: torch.Tensor, position: torch.Tensor, out: torch.Tensor) -> None:
        """position [1] int64: where the chosen token will sit (coupled sampling's noise key)."""
        if self.params.greedy:
            pick(argmax_rows, argmax_rows_ref, logits)(logits, out=out)
            return
        threshold = None
        if self.masked:  # choose_rows' threshold, for its one row
            threshold = keep_threshold(logits[0].float() / self.temperature[0], self.params, self.limits).view(1)
        coupled_choice(logits, self.temperature, self.seeds, position, threshold, out=out)


class DraftChain:
    def __init__(self, engine, slot: int, max_k: int, params: SamplingParams):
        """Chains of 1 .. max_k drafts for `slot` of `engine` (verifier.engine.Engine, the drafter's:
        its steps, through its door), choosing as `params` says; captured now when the engine's
        steps are graphed (CUDA), else run eagerly."""
        if max_k < 1:
            raise ValueError(f"max_k must be at least 1, got {max_k}")
        if max_k > engine.max_seq_len:
            raise ValueError(f"a chain of {max_k} drafts consumes {max_k - 1} rows, past max_seq_len {engine.max_seq_len}")
        self.engine, self.slot, self.max_k = engine, slot, max_k
        self.device = torch.device(engine.model.device)
        vocab = engine.vocab_size
        self.choose = DeviceChoice(params, vocab, self.device)
        self.graphed = graphed = engine.graphed
        device = self.device
        # [5] int64: catch-up start, p (the first draft's position), restore boundary, up to two new tokens
        self._control = torch.zeros(_NEW_TOKENS + 2, dtype=torch.int64, device=device)
        self._host_control = torch.zeros(_NEW_TOKENS + 2, dtype=torch.int64, pin_memory=graphed)
        self._start = self._control[_START : _START + 1]  # [1]: p
        self._catch_start = self._control[_CATCH_START : _CATCH_START + 1]  # [1]: where the caught-up tokens sit
        self._restore_index = self._control[_RESTORE : _RESTORE + 1]  # [1]: the boundary RESTORE_BONUS restores
        self._row_offsets = torch.arange(2, dtype=torch.int64, device=device)  # [2]: 0, 1
        self._catch_steps = {n: engine.fixed_step(slot, n) for n in (1, 2)}  # the catch-up's consume
        self._keep_caught = {n: torch.full((1,), n, dtype=torch.int32, device=device) for n in (1, 2)}
        self._caught_logits = torch.zeros(2, vocab, dtype=torch.float32, device=device)  # [2, vocab]: the catch-up rows'
        self._logits = torch.zeros(1, vocab, dtype=torch.float32, device=device)  # running: predicts the next draft
        self._drafts = torch.zeros(max_k, dtype=torch.int64, device=device)  # [max_k] the draft ids
        self._host_drafts = torch.zeros(max_k, dtype=torch.int64, pin_memory=graphed)
        self._step = engine.fixed_step(slot, 1)  # a draft's consume
        self._keep_row = torch.ones(1, dtype=torch.int32, device=device)  # rollback keeps the consumed draft
        boundaries = max_k - 1
        self._states = engine.recurrent_states()  # per recurrent layer (conv windows, states) of every slot
        self._saved_conv = [torch.zeros((boundaries, *conv.shape[1:]), dtype=conv.dtype, device=device)
                            for conv, _ in self._states]  # per layer [max_k - 1, conv_dim, W-1]
        self._saved_recurrent = [torch.zeros((boundaries, *recurrent.shape[1:]), dtype=torch.float32, device=device)
                                 for _, recurrent in self._states]  # per layer [max_k - 1, heads, d_k, d_v]
        self._saved_logits = torch.zeros(boundaries, vocab, dtype=torch.float32, device=device)  # [max_k - 1, vocab]
        self.captures = 0  # chain graphs captured since construction
        self.catch_ups = (NONE, BONUS, TWO) + ((RESTORE_BONUS,) if boundaries else ())
        self._graphs: dict[tuple[str, int], StepGraph] = {}
        self._capturing: StepGraph | None = None  # the graph being captured (its steps' rollback tables)
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
    def propose(self, logits: torch.Tensor | None, start: int, k: int, catch_up: str = NONE, new_tokens: tuple[int, ...] = (),
                restore: int = 0) -> list[int]:
        """k drafts from position `start` (the slot's committed position once caught up).

        catch_up NONE: `logits` [vocab] predicts the token at `start`, which the slot has consumed
        up to. Otherwise (logits None) the replay first consumes `new_tokens` at start -
        len(new_tokens) .. start - 1, after restoring boundary `restore` of the last proposal for
        RESTORE_BONUS (DESIGN.md section 9, "The model
drafter's chain"). The slot ends with drafts[0 .. k-2] consumed."""
        assert 1 <= k <= self.max_k, f"a chain of {k} drafts; chains hold 1 .. {self.max_k}"
        assert start + k - 1 <= self.engine.max_seq_len, f"drafts consumed up to position {start + k - 2}, past the slot"
        assert catch_up in self.catch_ups and len(new_tokens) == CATCH_UP_TOKENS[catch_up], (catch_up, new_tokens)
        assert (logits is None) == (catch_up != NONE), "logits come either from the caller or from the catch-up"
        assert catch_up != RESTORE_BONUS or 0 <= restore < self.max_k - 1, f"no boundary {restore}"
        if logits is not None and logits.data_ptr() != self._logits.data_ptr():  # a fresh row (sync consumed tokens) or a boundary's
            self._logits[0].copy_(logits)
        control = self._host_control
        control[_CATCH_START] = start - len(new_tokens)
        control[_START] = start
        control[_RESTORE] = restore
        for i, token in enumerate(new_tokens):
            control[_NEW_TOKENS + i] = token
        self._control.copy_(control, non_blocking=True)
        if self.graphed:
            self._graphs[catch_up, k].replay()
        else:
            self._catch_up(catch_up, start - len(new_tokens))
            self._run(k, self._step, self._keep_row, start)
        self._host_drafts[:k].copy_(self._drafts[:k], non_blocking=True)
        if self.device.type == "cuda":
            # the ids are needed now; this also settles both copies from the pinned buffers
            torch.cuda.current_stream(self.device).synchronize()
        return self._host_drafts[:k].tolist()

    def _catch_up(self, kind: str, catch_start: int) -> None:
        """The slot brought to the proposal's context (DESIGN.md section 9, "The model
drafter's chain"); the running logits then
        predict the first draft. `catch_start` on the host, for the step's host fields (as `_run`'s start)."""
        if kind == NONE:
            return
        if kind == RESTORE_BONUS:  # the boundary's rows gathered straight into the slot: one launch per state
            slot = self.slot
            for (conv, recurrent), saved_conv, saved_recurrent in zip(self._states, self._saved_conv, self._saved_recurrent):
                torch.index_select(saved_conv, 0, self._restore_index, out=conv[slot : slot + 1])
                torch.index_select(saved_recurrent, 0, self._restore_index, out=recurrent[slot : slot + 1])
        n = CATCH_UP_TOKENS[kind]
        step = self._catch_steps[n]
        step.tokens.copy_(self._control[_NEW_TOKENS : _NEW_TOKENS + n])
        torch.add(self._catch_start, self._row_offsets[:n], out=step.positions)
        # the engine's own consume: a verify writing the rows' logits, a rollback keeping them all
        step.run(catch_start, self._keep_caught[n], self._caught_logits[:n], self._capturing)
        self._logits[0].copy_(self._caught_logits[n - 1])

    def _run(self, k: int, step: FixedStep, kept: torch.Tensor, start: int) -> None:
        """The chain's body (DESIGN.md section 9, "The model
drafter's chain") through `step` (a one-row consume of the chain's
        slot, or of the scratch slot in the warm-up run), each consume keeping kept [1] rows.
        `start` is p on the host, for the host fields of the one-row batches (the CPU reference's
        attention reads them; kernels read only the device tensors, so a capture passes any value)."""
        for i in range(k):
            torch.add(self._start, i, out=step.positions)  # where drafts[i] sits
            choice = self._drafts[i : i + 1]
            self.choose(self._logits, step.positions, choice)
            if i + 1 == k:
                break  # the last draft is consumed only if the verifier keeps it
            self._save(i, step.slot)
            step.tokens.copy_(choice)
            step.run(start + i, kept, self._logits, self._capturing)

    def _save(self, i: int, slot: int) -> None:
        destinations = [conv[i] for conv in self._saved_conv] + [recurrent[i] for recurrent in self._saved_recurrent]
        sources = [conv[slot] for conv, _ in self._states] + [recurrent[slot] for _, recurrent in self._states]
        _copy_tensors(destinations + [self._saved_logits[i]], sources + [self._logits[0]])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # one eager run of each catch-up's consume and of the longest chain first, in the scratch
        # slot: it compiles every kernel outside a capture; keeping no row, it commits nothing (the
        # scratch slot's state stays zero)
        scratch = self.engine.scratch_slot
        keep_none = torch.zeros(1, dtype=torch.int32, device=self.device)
        for n in (1, 2):
            self.engine.fixed_step(scratch, n).run(0, keep_none, self._caught_logits[:n])
        self._run(self.max_k, self.engine.fixed_step(scratch, 1), keep_none, 0)
        torch.cuda.synchronize(self.device)
        memory = torch.cuda.graph_pool_handle()  # one replays at a time and keeps nothing in its temporaries
        for kind in self.catch_ups:
            for k in range(1, self.max_k + 1):
                # a consume per catch-up and per draft but the last
                graph = self.engine.step_graph(1 + k - 1, memory)

                def body(kind=kind, k=k):
                    self._catch_up(kind, 0)
                    self._run(k, self._step, self._keep_row, 0)

                self._capturing = graph
                try:
                    graph.capture(body)
                finally:
                    self._capturing = None
                self._graphs[kind, k] = graph
                self.captures += 1


def _copy_tensors(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """destinations[i].copy_(sources[i]) for every i, in one multi-tensor launch per dtype (a graph
    node per copy was a tenth of a proposal's kernels)."""
    by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for destination, source in zip(destinations, sources, strict=True):
        pair = by_dtype.setdefault(destination.dtype, ([], []))
        pair[0].append(destination)
        pair[1].append(source)
    for group_destinations, group_sources in by_dtype.values():
        torch._foreach_copy_(group_destinations, group_sources)
