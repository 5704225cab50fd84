"""What every session does, derived from (plan, session index, generation number) alone, so the
drafter processes and the reference decoder agree without passing prompts around.

A session runs generations back to back until its step budget is spent: when one finishes (eos
or max_new_tokens) the slot is closed and a new prompt is opened, so slots are reused under load.
Session i's drafter (--drafter mixed: ngram for even i, random for odd i) and sampling (greedy
for i % 4 in {0, 1}, seeded coupled sampling otherwise) are fixed for all its generations.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from verifier.params import SamplingParams
from verifier.proposers import NgramProposer, RandomProposer

DRAFTERS = ("ngram", "random", "mixed")
PROMPT_MIN, PROMPT_MAX = 8, 24


@dataclass(frozen=True)
class Plan:
    vocab_size: int
    eos_ids: tuple[int, ...]
    k: int  # drafts per step asked of the proposer (the loop cuts to the verifier's limits)
    drafter: str  # ngram | random | mixed
    max_new_tokens: int  # per generation
    steps: int  # verify steps per session (across its generations)
    seed: int = 0

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.k < 0 or self.max_new_tokens < 1 or self.steps < 1:
            raise ValueError(f"k >= 0, max_new_tokens >= 1 and steps >= 1, got {self.k}, {self.max_new_tokens}, {self.steps}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        return cls(**{**data, "eos_ids": tuple(data["eos_ids"])})


def prompt(plan: Plan, session: int, generation: int) -> list[int]:
    """A prompt with a repeated phrase among random ids (something for the n-gram drafter to find);
    never an eos id, so no prompt ends a session before it starts."""
    rng = random.Random(f"load:{plan.seed}:{session}:{generation}")
    allowed = [t for t in range(plan.vocab_size) if t not in plan.eos_ids]
    length = rng.randint(PROMPT_MIN, PROMPT_MAX)
    phrase = [rng.choice(allowed) for _ in range(rng.randint(3, 6))]
    ids: list[int] = []
    while len(ids) < length:
        ids += phrase if rng.random() < 0.5 else [rng.choice(allowed)]
    return ids[:length]


def sampling(plan: Plan, session: int) -> SamplingParams:
    if session % 4 < 2:
        return SamplingParams()
    return SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=plan.seed * 100_003 + session)


def drafter_of(plan: Plan, session: int) -> str:
    if plan.drafter != "mixed":
        return plan.drafter
    return "ngram" if session % 2 == 0 else "random"


def proposer(plan: Plan, session: int, generation: int):
    if drafter_of(plan, session) == "ngram":
        return NgramProposer()
    return RandomProposer(plan.vocab_size, seed=plan.seed * 1_000_003 + session * 1009 + generation)
