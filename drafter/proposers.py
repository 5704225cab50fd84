"""Proposers: given the sequence so far, propose up to K next tokens.

`propose(context, k)` gets the prompt plus every emitted token and returns at most k ids
(fewer, even none, when it has nothing to say). A proposer that drafts from a distribution (the
model drafter) also has `propose_with_probs(context, k) -> (ids, probs)`, probs [len(ids), vocab]
float32 or None; the loop prefers it and sends the probabilities when the session samples, so the
verifier's rejection sampling is exact. The proposers here draft deterministically given the
context (q one-hot at each draft: the verifier's default when no probabilities come).
"""

from __future__ import annotations

import random
from typing import Protocol, runtime_checkable

import numpy as np


class Proposer(Protocol):
    def propose(self, context: list[int], k: int) -> list[int]: ...


@runtime_checkable
class ProbabilityProposer(Protocol):
    def propose(self, context: list[int], k: int) -> list[int]: ...

    def propose_with_probs(self, context: list[int], k: int) -> tuple[list[int], np.ndarray | None]: ...


class RandomProposer:
    """K uniform random ids per call from a seeded generator: an adversarial drafter for regression tests."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)

    def propose(self, context: list[int], k: int) -> list[int]:
        return [self._rng.randrange(self.vocab_size) for _ in range(k)]


class NgramProposer:
    """Prompt lookup: find an earlier occurrence of the context's last n tokens (n from max_n down
    to min_n) and propose the tokens that followed it: the latest occurrence followed by k tokens,
    else the one followed by the most."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, context: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            tail, best = context[-n:], []
            for start in range(len(context) - n - 1, -1, -1):
                if context[start : start + n] == tail:
                    follow = context[start + n : start + n + k]
                    if len(follow) == k:
                        return follow
                    if len(follow) > len(best):
                        best = follow
            if best:
                return best
        return []


class OracleProposer:
    """Proposes the known true continuation: every draft is accepted (a regression drafter)."""

    def __init__(self, prompt_len: int, continuation: list[int]):
        self.prompt_len = prompt_len
        self.continuation = continuation

    def propose(self, context: list[int], k: int) -> list[int]:
        done = len(context) - self.prompt_len
        return self.continuation[done : done + k]
