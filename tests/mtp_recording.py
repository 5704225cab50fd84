"""A recording MTP proposer for the MTP tests: the proposer protocol around an MTPProposer, keeping
every proposal and every hidden row handed over."""

from __future__ import annotations

import torch


class Recording:
    """Keeps each proposal's (context, k, drafts, q) in `calls` and the hidden rows it was handed in
    `rows`; with `instead` (a proposer), the head still proposes (its state moves on as it would)
    but `instead`'s drafts are sent."""

    def __init__(self, inner, instead=None):
        self.inner, self.instead, self.calls, self.rows = inner, instead, [], []

    @property
    def hidden(self) -> torch.Tensor:
        """Every hidden row handed over, positions 0 .. known - 1: [known, H]."""
        return torch.cat(self.rows)

    @property
    def drafts(self) -> list[list[int]]:
        return [drafts for _, _, drafts, _ in self.calls]

    def begin(self, prompt_hidden):
        self.rows = [prompt_hidden.clone()]
        self.inner.begin(prompt_hidden)

    def observe(self, hidden):
        self.rows.append(hidden.clone())
        self.inner.observe(hidden)

    def propose(self, context, k):
        return self.propose_with_probs(context, k)[0]

    def propose_with_probs(self, context, k):
        drafts, probs = self.inner.propose_with_probs(context, k)
        self.calls.append((list(context), k, drafts, probs))
        return (drafts, probs) if self.instead is None else (self.instead.propose(context, k), None)
