"""The engine: sequences in slots, and one step for decode and verify.

A step takes a ragged batch of sequences, each with its pending token and 0..max_k drafts, runs
the K+1 rows of every sequence through one row-invariant forward (decode_k), accepts per
sequence, rolls each slot back to its accepted prefix and returns per-sequence results. Decode
is a step with no drafts. The engine knows nothing of gRPC or sessions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .acceptance import accept_choices, accept_matching, accept_rejection, step_choices
from .model import HybridModel, RowBatch
from .model.graphs import GraphedSteps, graphs_supported
from .model.rollback import ROLLBACK_MODES, WOA, rollback
from .sampling import SamplingParams, choose

EOS, LENGTH = "eos", "length"


class StepError(ValueError):
    """A step that cannot run. `code` says which kind (the service maps it to a status)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code  # "invalid_argument" | "out_of_range" | "failed_precondition"


@dataclass
class Sequence:
    slot: int
    position: int  # committed position p: tokens consumed into the slot
    pending: int  # the last emitted token, not yet consumed
    sampling: SamplingParams
    max_new_tokens: int
    eos_ids: frozenset[int]
    emitted: int = 1  # tokens emitted so far, the first one (chosen from the prompt) included
    finish_reason: str | None = None
    first_logits: torch.Tensor | None = field(default=None, repr=False)  # [vocab] the first token came from (model's device)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepRequest:
    sequence: Sequence
    drafts: list[int]
    draft_probs: torch.Tensor | None = None  # [K, vocab]: rejection sampling; None: greedy / coupled


@dataclass
class StepResult:
    accepted: int  # drafts accepted (before any cut at eos or the token budget)
    tokens: list[int]  # emitted: accepted drafts then the bonus, cut at eos / the budget
    position: int  # the new committed position
    finish_reason: str | None
    logits: torch.Tensor  # [len(tokens), vocab] fp32 on the model's device: row i is what tokens[i] was chosen from
    error: StepError | None = None


class Engine:
    def __init__(self, model: HybridModel, n_slots: int, max_seq_len: int, max_k: int = 8, rollback_mode: str = WOA,
                 cuda_graphs: bool = True):
        if rollback_mode not in ROLLBACK_MODES:
            raise ValueError(f"rollback mode must be one of {ROLLBACK_MODES}, got {rollback_mode!r}")
        if max_k < 0:
            raise ValueError(f"max_k must be >= 0, got {max_k}")
        self.model = model
        self.pool = model.new_pool(n_slots, max_seq_len)
        self.max_k = max_k
        self.rollback_mode = rollback_mode
        # CUDA graphs replay the same kernels as the eager path (same bits), minus the launch cost
        self.graphs = GraphedSteps(model, self.pool) if cuda_graphs and graphs_supported(model) else None

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def open(self, prompt: list[int], sampling: SamplingParams, max_new_tokens: int, eos_ids: tuple[int, ...] | None = None) -> Sequence:
        """Admit a slot, prefill the prompt, choose the first token (it becomes the pending token)."""
        if not prompt:
            raise StepError("invalid_argument", "prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise StepError("invalid_argument", f"prompt token ids {bad[:5]} are outside the vocabulary 0..{self.vocab_size - 1}")
        if max_new_tokens < 1:
            raise StepError("invalid_argument", f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if len(prompt) + 1 > self.pool.max_seq_len:
            raise StepError("out_of_range", f"prompt of {len(prompt)} tokens leaves no room in max_seq_len {self.pool.max_seq_len}")
        slot = self.pool.admit()
        try:
            logits = self.model.prefill(self.pool, slot, prompt)
        except Exception:
            self.pool.release(slot)
            raise
        token = choose(logits, sampling, len(prompt))
        eos = frozenset(self.model.config.eos_token_ids if eos_ids is None else eos_ids)
        seq = Sequence(slot, len(prompt), token, sampling, max_new_tokens, eos, first_logits=logits)
        if token in eos:
            seq.finish_reason = EOS
        elif max_new_tokens == 1:
            seq.finish_reason = LENGTH
        return seq

    def close(self, seq: Sequence) -> None:
        self.pool.release(seq.slot)

    def check(self, request: StepRequest) -> None:
        """Raise StepError if the request cannot run; never touches state."""
        seq, drafts = request.sequence, request.drafts
        if seq.finished:
            raise StepError("failed_precondition", f"the sequence has finished ({seq.finish_reason})")
        if len(drafts) > self.max_k:
            raise StepError("invalid_argument", f"{len(drafts)} drafts exceed max_k {self.max_k}")
        bad = [t for t in drafts if not 0 <= t < self.vocab_size]
        if bad:
            raise StepError("invalid_argument", f"draft ids {bad[:5]} are outside the vocabulary 0..{self.vocab_size - 1}")
        if seq.position + len(drafts) + 1 > self.pool.max_seq_len:
            raise StepError("out_of_range", f"{len(drafts) + 1} rows from position {seq.position} pass max_seq_len {self.pool.max_seq_len}")
        if request.draft_probs is not None:
            _check_draft_probs(request.draft_probs, drafts, self.vocab_size)

    def step(self, requests: list[StepRequest]) -> list[StepResult]:
        """One engine step over many sequences; a bad request gets its error, the others run."""
        results: list[StepResult | None] = [None] * len(requests)
        live: list[int] = []
        slots: set[int] = set()
        for i, req in enumerate(requests):
            try:
                self.check(req)
                if req.sequence.slot in slots:
                    raise StepError("invalid_argument", "the same sequence appears twice in one step")
                slots.add(req.sequence.slot)
                live.append(i)
            except StepError as err:
                results[i] = StepResult(0, [], req.sequence.position, req.sequence.finish_reason, torch.empty(0, self.vocab_size), err)
        if live:
            for i, result in zip(live, self._run([requests[i] for i in live])):
                results[i] = result
        return results

    def _run(self, requests: list[StepRequest]) -> list[StepResult]:
        batch = RowBatch(
            slots=tuple(r.sequence.slot for r in requests),
            starts=tuple(r.sequence.position for r in requests),
            counts=tuple(len(r.drafts) + 1 for r in requests),
        )
        tokens = torch.tensor([t for r in requests for t in [r.sequence.pending, *r.drafts]], dtype=torch.int64)
        if self.graphs is not None:
            logits, record = self.graphs.verify(tokens, batch, self.rollback_mode)
        else:
            logits, record = self.model.verify(tokens, batch, self.pool, self.rollback_mode)
        # Greedy and coupled acceptance need each row's choice only. On the GPU all of them come
        # from device launches (argmax; coupled sampling for the sampled rows of every sequence)
        # and a step copies R ids to the host, not R x vocab floats; on the CPU coupled rows are
        # chosen from the host rows. Rejection sampling reads its rows on the host either way.
        on_device = logits.is_cuda
        sampled = [(span, r.sequence.sampling, start) for r, (_, start, span) in zip(requests, batch.sequences())
                   if on_device and not r.sequence.sampling.greedy and r.draft_probs is None]
        choices = step_choices(logits, sampled)
        results, consumed = [], []
        for req, (_, start, span) in zip(requests, batch.sequences()):
            rows = logits[span]
            seq = req.sequence
            if seq.sampling.greedy or (on_device and req.draft_probs is None):
                accepted, bonus = accept_choices(choices[span], req.drafts)
            elif req.draft_probs is None:
                accepted, bonus = accept_matching(rows, req.drafts, seq.sampling, start)
            else:
                accepted, bonus = accept_rejection(rows.cpu(), req.drafts, req.draft_probs, seq.sampling, start)
            emitted = [*req.drafts[:accepted], bonus]
            emitted, finish = self._cut(seq, emitted)
            # Each emitted token's row is consumed: the pending token plus the accepted drafts kept.
            consumed.append(len(emitted))
            seq.position = start + len(emitted)
            seq.pending = emitted[-1]
            seq.emitted += len(emitted)
            seq.finish_reason = finish
            # a copy: a graph's next replay overwrites its output
            results.append(StepResult(accepted, emitted, seq.position, finish, rows[: len(emitted)].clone()))
        if self.graphs is not None:
            self.graphs.rollback(record, consumed)
        else:
            rollback(self.pool, record, consumed)
        return results

    @staticmethod
    def _cut(seq: Sequence, emitted: list[int]) -> tuple[list[int], str | None]:
        """Cut at the first eos (kept) and at the token budget."""
        for i, token in enumerate(emitted):
            if token in seq.eos_ids:
                emitted = emitted[: i + 1]
                break
        room = seq.max_new_tokens - seq.emitted
        emitted = emitted[:room]
        if emitted[-1] in seq.eos_ids:
            return emitted, EOS
        if seq.emitted + len(emitted) >= seq.max_new_tokens:
            return emitted, LENGTH
        return emitted, None


def _check_draft_probs(probs: torch.Tensor, drafts: list[int], vocab: int) -> None:
    if probs.shape != (len(drafts), vocab):
        raise StepError("invalid_argument", f"draft_probs has shape {list(probs.shape)}, expected [{len(drafts)}, {vocab}]")
    probs = probs.float()
    if not torch.isfinite(probs).all() or (probs < 0).any():
        raise StepError("invalid_argument", "draft_probs must be finite and non-negative")
    sums = probs.sum(dim=-1)
    if ((sums - 1).abs() > 1e-3).any():
        raise StepError("invalid_argument", f"each draft_probs row must sum to 1 (got sums {[round(float(s), 4) for s in sums][:4]})")
    for r, d in enumerate(drafts):
        if not math.isfinite(float(probs[r, d])) or float(probs[r, d]) <= 0:
            raise StepError("invalid_argument", f"draft_probs[{r}] gives its own draft {d} probability 0")
