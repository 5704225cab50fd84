"""In-process generation through the engine: plain (K = 0) or speculative with a local proposer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .engine import Engine, StepRequest
from .sampling import SamplingParams


class Proposer(Protocol):
    def propose(self, context: list[int], k: int) -> list[int]: ...


@dataclass
class Generation:
    tokens: list[int]  # emitted ids (an eos that ended it included)
    logits: torch.Tensor  # [len(tokens), vocab] fp32: row i holds the logits tokens[i] was chosen from
    finish_reason: str  # "eos" or "length"
    accepted_per_step: list[int]  # drafts accepted per verify step (steps with no drafts count 0)
    drafted_per_step: list[int]  # drafts sent per step

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / steps-with-drafts: tokens per drafted step, the bonus counted."""
        drafted = sum(1 for d in self.drafted_per_step if d)
        accepted = sum(a for a, d in zip(self.accepted_per_step, self.drafted_per_step) if d)
        return 1.0 + accepted / drafted if drafted else 1.0


def generate(engine: Engine, prompt: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
             proposer: Proposer | None = None, k: int = 0, eos_ids: tuple[int, ...] | None = None) -> Generation:
    sampling = sampling or SamplingParams()
    seq = engine.open(prompt, sampling, max_new_tokens, eos_ids)
    try:
        tokens, rows = [seq.pending], [seq.first_logits]
        accepted, drafted = [], []
        while not seq.finished:
            drafts = proposer.propose(prompt + tokens, k) if proposer is not None and k > 0 else []
            room = engine.pool.max_seq_len - seq.position - 1
            drafts = drafts[: max(0, min(k, room))]
            (result,) = engine.step([StepRequest(seq, drafts)])
            if result.error is not None:
                raise result.error
            tokens += result.tokens
            rows.append(result.logits)
            accepted.append(result.accepted)
            drafted.append(len(drafts))
        return Generation(tokens, torch.cat([rows[0][None], *rows[1:]]), seq.finish_reason, accepted, drafted)
    finally:
        engine.close(seq)
