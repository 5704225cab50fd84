"""Adaptive K: each sequence picks its next step's draft count from its own recent acceptance.

The rule (off by default; `--adaptive-k`, or `adaptive=AdaptiveK(k_max)` in drafter.loop):

1. Model each draft as accepted with one probability `a`, independently (the i.i.d. model the
   bench draws beside its measured curves). A step with d drafts of which x were accepted is then
   x successes and, when x < d, one failure (the draft after the accepted prefix); drafts after the
   first failure were never judged and count for nothing.
2. Estimate `a` from decayed counts: after each step with drafts,
       S <- decay * S + x,    N <- decay * N + x + (1 if x < d else 0),    a = S / N,
   the maximum-likelihood estimate of the model above with every older step's weight multiplied
   by `decay` (0.8 by default: a step's weight halves in about three steps). Before the first
   drafted step, and while N is 0, K is k_max: try the most the caller allows.
3. Under that model a step of K drafts emits E[tokens] = 1 + a + ... + a^K = (1 - a^(K+1)) / (1 - a)
   (K + 1 when a = 1), and costs 1 + c*K in units of a plain decode step: c is the extra cost of one
   verify row plus one draft (0.1 by default). Choose the K in [1, k_max] maximising
       (1 - a^(K+1)) / (1 - a) / (1 + c*K),
   the smallest such K on ties. K never drops below 1, so a sequence whose acceptance recovers is
   seen to recover.

Known answers with c = 0.1 and k_max = 8: a = 0 -> 1, a = 0.5 -> 2, a = 0.8 -> 6, a = 1 -> 8.
The loop may still send fewer drafts than K (the context, the token budget or the server's max_k
cut them, or the proposer has fewer to offer), and the server may verify fewer than were sent
(goodput-aware K): the counts use the drafts the server verified.
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
