"""What a drafter is, to both front ends (the in-process loop, verifier/generate.py, and the
drafter's loop over gRPC, drafter/loop.py).

`propose(context, k)` gets the prompt plus every emitted token and returns at most k draft ids
(fewer, even none, when it has nothing to say). A proposer that drafts from a distribution (the
model drafter) also has `propose_with_probs(context, k) -> (ids, probs)`, probs [len(ids), vocab]
float32 or None; the drafter's loop prefers it and sends the probabilities when the session
samples, so the verifier's rejection sampling is exact. A proposer without it drafts
deterministically given the context (q one-hot at each draft: the verifier's default).
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
