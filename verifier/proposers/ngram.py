"""The n-gram drafter (prompt lookup): no model, no torch."""

from __future__ import annotations


class NgramProposer:
    """Find an earlier occurrence of the context's last n tokens (n from max_n down to min_n) and
    propose the tokens that followed it: the latest occurrence followed by k tokens, else the one
    followed by the most."""

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
