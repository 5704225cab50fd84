"""Drafters for regression tests and benchmarks: one that is (almost) always wrong, one that is
always right. Neither needs a model or torch."""

from __future__ import annotations

import random


class RandomProposer:
    """K uniform random ids per call from a seeded generator: an adversarial drafter."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)

    def propose(self, context: list[int], k: int) -> list[int]:
        return [self._rng.randrange(self.vocab_size) for _ in range(k)]


class OracleProposer:
    """Proposes the known true continuation: every draft is accepted."""

    def __init__(self, prompt_len: int, continuation: list[int]):
        self.prompt_len = prompt_len
        self.continuation = continuation

    def propose(self, context: list[int], k: int) -> list[int]:
        done = len(context) - self.prompt_len
        return self.continuation[done : done + k]
