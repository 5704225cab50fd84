"""Choosing tokens from logits (DESIGN.md section 7).

greedy (temperature 0): argmax, ties to the lowest id.
coupled sampling: the token at position j is argmax(masked(logits / T) + G(seed, j)), G a Gumbel
    vector drawn from a generator keyed by (seed, j) alone. It is an exact sample of the target
    distribution, and it depends only on the logits row, the seed and the position, so a
    speculative run (whose rows are bit-identical) chooses exactly the tokens a plain run chooses.
Masks: top-k keeps the k largest logits (and any tied with the k-th); top-p keeps the smallest
    prefix of the probability-sorted vocabulary whose mass reaches p (the first token always).
Position j is where the chosen token will sit: the row at position p chooses the token at p + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
STREAM_CHOOSE, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed <= _MASK64:
            raise ValueError(f"seed must be in 0 .. 2^64-1, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _generator(seed: int, position: int, stream: int) -> torch.Generator:
    key = _splitmix64(_splitmix64(_splitmix64(seed) ^ position) ^ stream)
    return torch.Generator().manual_seed(key & ((1 << 63) - 1))


def uniform(seed: int, position: int, stream: int) -> float:
    """One U[0, 1) draw keyed by (seed, position, stream)."""
    return float(torch.rand(1, generator=_generator(seed, position, stream), dtype=torch.float64))


def gumbel(seed: int, position: int, vocab: int, stream: int = STREAM_CHOOSE) -> torch.Tensor:
    """A Gumbel(0, 1) vector [vocab] fp32 keyed by (seed, position, stream); drawn on the CPU."""
    u = torch.rand(vocab, generator=_generator(seed, position, stream), dtype=torch.float32)
    return -torch.log(-torch.log(u))  # u = 0 gives -inf: never chosen


def masked_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [vocab] -> fp32 logits / T with -inf outside the top-k / top-p set (temperature > 0)."""
    scaled = logits.float().cpu() / params.temperature
    if params.top_k and params.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        order = torch.sort(probs, descending=True, stable=True).indices
        sorted_probs = probs[order]
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly before each token
        drop = order[before >= params.top_p]
        scaled[drop] = float("-inf")
    return scaled


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a plain run samples from: [vocab] fp32 (one-hot at the argmax when greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(torch.argmax(logits.cpu()), logits.shape[-1]).float()
    return torch.softmax(masked_logits(logits, params), dim=-1)


def choose(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token a plain run places at `position` given the logits row [vocab] that predicts it."""
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.argmax(masked_logits(logits, params) + gumbel(params.seed, position, logits.shape[-1])))


def sample_from(probs: torch.Tensor, seed: int, position: int, stream: int) -> int:
    """An exact sample of probs [vocab] (Gumbel-max on log probs), keyed by (seed, position, stream)."""
    return int(torch.argmax(torch.log(probs) + gumbel(seed, position, probs.shape[-1], stream)))
