"""Adaptive K: each sequence picks its next step's draft count from its own recent acceptance.
The design in full: DESIGN.md section 8, "Adaptive K".
"""

from __future__ import annotations

import math

DEFAULT_DECAY = 0.8
DEFAULT_COST = 0.1


def expected_tokens(a: float, k: int) -> float:
    """Tokens one step of k drafts emits on average when each is accepted with probability a
    (the bonus counted): (1 - a^(k+1)) / (1 - a), or k + 1 at a = 1."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance rate a must be in [0, 1], got {a}")
    if a == 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def best_k(a: float, k_max: int, cost: float = DEFAULT_COST) -> int:
    """The K in [1, k_max] with the most expected tokens per unit of step cost (smallest on ties)."""
    if k_max < 1:
        raise ValueError(f"k_max must be at least 1, got {k_max}")
    if not (math.isfinite(cost) and cost >= 0):
        raise ValueError(f"cost must be a finite number >= 0, got {cost}")
    best, best_value = 1, -1.0
    for k in range(1, k_max + 1):
        value = expected_tokens(a, k) / (1.0 + cost * k)
        if value > best_value * (1 + 1e-12):  # strictly better: a rounding tie keeps the smaller K
            best, best_value = k, value
    return best


class AdaptiveK:
    """One sequence's adaptive K: `k` is the next step's draft count; `observe(drafted, accepted)`
    takes each step's outcome in."""

    def __init__(self, k_max: int, decay: float = DEFAULT_DECAY, cost: float = DEFAULT_COST):
        if k_max < 1:
            raise ValueError(f"k_max must be at least 1, got {k_max}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if not (math.isfinite(cost) and cost >= 0):
            raise ValueError(f"cost must be a finite number >= 0, got {cost}")
        self.k_max, self.decay, self.cost = k_max, decay, cost
        self.successes = 0.0  # S: decayed accepted drafts
        self.trials = 0.0  # N: decayed judged drafts (accepted ones plus the first rejected one)
        self.history: list[int] = []  # the K chosen for each step, for reports and tests

    @property
    def rate(self) -> float | None:
        """The estimated per-draft acceptance rate a, or None before any draft was judged."""
        return self.successes / self.trials if self.trials > 0 else None

    @property
    def k(self) -> int:
        a = self.rate
        return self.k_max if a is None else best_k(a, self.k_max, self.cost)

    def next_k(self) -> int:
        """The K for the next step, remembered in `history`."""
        k = self.k
        self.history.append(k)
        return k

    def observe(self, drafted: int, accepted: int) -> None:
        """A step sent `drafted` drafts and the verifier accepted the first `accepted` of them."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted must be in 0..drafted ({drafted}), got {accepted}")
        if drafted == 0:  # a plain decode step judges no draft: nothing learnt
            return
        rejected = 1 if accepted < drafted else 0
        self.successes = self.decay * self.successes + accepted
        self.trials = self.decay * self.trials + accepted + rejected
