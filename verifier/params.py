"""Sampling parameters of a sequence: the one home of the concept, shared by the engine, the server
and the drafter side (DESIGN.md section 7). No torch here: the drafter imports it.

Validated once, on construction; everything downstream takes a SamplingParams and trusts it.
The noise streams are keyed by (seed, position, stream): the verifier draws stream CHOOSE for its
own choice (coupled sampling), ACCEPT and RESIDUAL for rejection sampling; a drafter that samples
its drafts takes DRAFT, so its noise is independent of the verifier's even with the same seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SEED_LIMIT = 1 << 64  # seeds are uint64: the wire's type, and the hash's key
# The smallest temperature and top_p that sampling computes with in float32: logits / temperature
# would overflow to inf below the one (and NaN follow), and the other would round to nothing.
MIN_TEMPERATURE = 1e-6
MIN_TOP_P = 1e-6

# noise stream ids, one list so that no two users can take the same id by accident
STREAM_CHOOSE, STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_DRAFT = 0, 1, 2, 3


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0  # coupled sampling: the token at position j is keyed by (seed, j)

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE)):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not (MIN_TOP_P <= self.top_p <= 1):
            raise ValueError(f"top_p must be in [{MIN_TOP_P:g}, 1], got {self.top_p}")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in 0 .. 2^64-1, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
