"""The acceptance arithmetic of the bench: pure functions of what the loop records per verify step
(drafts sent, drafts accepted), no I/O, so tests can give them synthetic streams with known answers.
The design in full: DESIGN.md section 8, "The acceptance bench's arithmetic".
"""

from __future__ import annotations

from dataclasses import dataclass

from verifier.generation import mean_acceptance_length


@dataclass(frozen=True)
class Counts:
    """What one or more runs of one (drafter, k) did. Add two to pool runs."""

    steps: int = 0  # verify steps
    step_tokens: int = 0  # tokens those steps emitted (the first token, from OpenSession, is not a step's)
    drafts: int = 0  # steps that carried >= 1 draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rejections: int = 0  # drafted steps that stopped short of their last draft: one draft token the target refused
    drafted_at: tuple[int, ...] = ()  # [k]: steps whose draft reached position i+1
    accepted_at: tuple[int, ...] = ()  # [k]: of those, steps that accepted position i+1

    def __add__(self, other: "Counts") -> "Counts":
        width = max(len(self.drafted_at), len(other.drafted_at))
        return Counts(self.steps + other.steps, self.step_tokens + other.step_tokens, self.drafts + other.drafts,
                      self.draft_tokens + other.draft_tokens, self.accepted_tokens + other.accepted_tokens,
                      self.rejections + other.rejections,
                      _add_padded(self.drafted_at, other.drafted_at, width),
                      _add_padded(self.accepted_at, other.accepted_at, width))


def count(accepted_per_step: list[int], drafted_per_step: list[int], step_tokens: int, k: int) -> Counts:
    """Counts of one generation. `k` sizes the per-position lists (the most drafts a step may send)."""
    if len(accepted_per_step) != len(drafted_per_step):
        raise ValueError(f"accepted_per_step has {len(accepted_per_step)} entries but drafted_per_step "
                         f"has {len(drafted_per_step)}")
    drafted_at, accepted_at = [0] * k, [0] * k
    drafts = draft_tokens = accepted_tokens = rejections = 0
    for step, (accepted, drafted) in enumerate(zip(accepted_per_step, drafted_per_step)):
        if not 0 <= accepted <= drafted <= k:
            raise ValueError(f"step {step}: accepted {accepted} of {drafted} drafts; need 0 <= accepted <= drafts <= k={k}")
        if drafted == 0:
            continue
        drafts += 1
        draft_tokens += drafted
        accepted_tokens += accepted
        rejections += accepted < drafted
        for i in range(drafted):
            drafted_at[i] += 1
        for i in range(accepted):
            accepted_at[i] += 1
    return Counts(len(accepted_per_step), step_tokens, drafts, draft_tokens, accepted_tokens, rejections,
                  tuple(drafted_at), tuple(accepted_at))


@dataclass(frozen=True)
class Figures:
    mean_acceptance_length: float
    acceptance_rate: float | None  # None: no draft token was sent
    token_acceptance_probability: float | None  # see `token_acceptance_probability`
    per_position_acceptance: list[float | None]  # None where no draft reached that position
    tokens_per_step: float | None  # None: no verify step ran


def figures(counts: Counts) -> Figures:
    return Figures(
        mean_acceptance_length=mean_acceptance_length(counts.accepted_tokens, counts.drafts),
        acceptance_rate=counts.accepted_tokens / counts.draft_tokens if counts.draft_tokens else None,
        token_acceptance_probability=token_acceptance_probability(counts),
        per_position_acceptance=[a / d if d else None for a, d in zip(counts.accepted_at, counts.drafted_at)],
        tokens_per_step=counts.step_tokens / counts.steps if counts.steps else None,
    )


def token_acceptance_probability(counts: Counts) -> float | None:
    """The per-token acceptance probability alpha of the i.i.d. model: the target judges drafts in
    order and stops at the first refusal, so the judged draft tokens are the accepted ones plus one
    per step that refused one; alpha = accepted / judged. (accepted / draft tokens would count the
    drafts after a refusal, never judged, as refusals: it falls with K even for an i.i.d. drafter.)
    At K = 1 the two are equal."""
    judged = counts.accepted_tokens + counts.rejections
    return counts.accepted_tokens / judged if judged else None


def iid_acceptance_length(alpha: float, k: int) -> float:
    """Expected tokens per drafted step when each draft token is accepted with probability alpha
    independently: 1 + alpha + ... + alpha^K = (1 - alpha^(K+1)) / (1 - alpha)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _add_padded(a: tuple[int, ...], b: tuple[int, ...], width: int) -> tuple[int, ...]:
    a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
    return tuple(x + y for x, y in zip(a, b))
