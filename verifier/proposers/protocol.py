"""What a drafter is, to both front ends (the in-process loop, verifier/generate.py, and the
drafter's loop over gRPC, drafter/loop.py).

`propose(context, k)` gets the prompt plus every emitted token and returns at most k draft ids
(fewer, even none, when it has nothing to say). A proposer that drafts from a distribution (the
model drafter, the MTP drafter in rejection mode) also has `propose_with_probs(context, k) -> (ids, probs)`, probs [len(ids), vocab]
float32 or None; the drafter's loop prefers it and sends the probabilities when the session
samples, so the verifier's rejection sampling is exact. A proposer without it drafts
deterministically given the context (q one-hot at each draft: the verifier's default).

A proposer that drafts from the target's own hidden rows (the MTP head: proposers/mtp.py) is a
`HiddenStateProposer`: the in-process loop (verifier/generate.py) hands it the prompt rows' hidden
rows (`begin`) and each step's consumed rows' (`observe`) before asking it to propose.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


class Proposer(Protocol):
    def propose(self, context: list[int], k: int) -> list[int]: ...


@runtime_checkable
class ProbabilityProposer(Protocol):
    def propose(self, context: list[int], k: int) -> list[int]: ...

    def propose_with_probs(self, context: list[int], k: int) -> tuple[list[int], np.ndarray | None]: ...


@runtime_checkable
class HiddenStateProposer(Protocol):
    def propose(self, context: list[int], k: int) -> list[int]: ...

    def begin(self, prompt_hidden) -> None: ...  # torch.Tensor [len(prompt), H]

    def observe(self, hidden) -> None: ...  # torch.Tensor [rows the step consumed, H]
