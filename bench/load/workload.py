"""What every session does, derived from (plan, session index, generation number) alone, so the
drafter processes and the reference decoder agree without passing prompts around.

A session runs generations back to back until its step budget is spent: when one finishes (eos
or max_new_tokens) the slot is closed and a new prompt is opened, so slots are reused under load.
Session i's drafter (--drafter mixed: ngram for even i, random for odd i; none: plain decoding;
oracle: the known plain continuation, given by the caller) and sampling (sampling mixed: greedy for
i % 4 in {0, 1}, seeded coupled sampling otherwise; greedy: greedy for all) are fixed for all its
generations. `generations` caps how many a session opens (bench.serve: one, whose plain stream it
knows).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from verifier.params import SamplingParams
from verifier.proposers import NgramProposer, OracleProposer, RandomProposer

DRAFTERS = ("ngram", "random", "mixed", "none", "oracle")
SAMPLING_MIXES = ("mixed", "greedy")
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
    sampling_mix: str = "mixed"  # mixed | greedy
    generations: int | None = None  # most generations a session opens (None: until its steps are done)

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.sampling_mix not in SAMPLING_MIXES:
            raise ValueError(f"sampling_mix must be one of {SAMPLING_MIXES}, got {self.sampling_mix!r}")
        if self.k < 0 or self.max_new_tokens < 1 or self.steps < 1:
            raise ValueError(f"k >= 0, max_new_tokens >= 1 and steps >= 1, got {self.k}, {self.max_new_tokens}, {self.steps}")
        if self.generations is not None and self.generations < 1:
            raise ValueError(f"generations must be >= 1 or None, got {self.generations}")

    def opens_another(self, steps_done: int, generation: int) -> bool:
        """Whether a session that has taken `steps_done` steps opens generation number `generation`."""
        return steps_done < self.steps and (self.generations is None or generation < self.generations)

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
    if plan.sampling_mix == "greedy" or session % 4 < 2:
        return SamplingParams()
    return SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=plan.seed * 100_003 + session)


def drafter_of(plan: Plan, session: int) -> str:
    if plan.drafter != "mixed":
        return plan.drafter
    return "ngram" if session % 2 == 0 else "random"


def proposer(plan: Plan, session: int, generation: int, references: dict[int, list[int]] | None = None):
    """`references[session]`: the plain stream of the session's generation 0 (the oracle's drafts)."""
    kind = drafter_of(plan, session)
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramProposer()
    if kind == "oracle":
        if generation != 0 or not references or session not in references:
            raise ValueError(f"the oracle drafter knows the plain stream of generation 0 only (session {session}, "
                             f"generation {generation})")
        return OracleProposer(len(prompt(plan, session, generation)), references[session])
    return RandomProposer(plan.vocab_size, seed=plan.seed * 1_000_003 + session * 1009 + generation)
