"""What a generation returns, and the two rules both front ends share: how many drafts a step may
carry, and the mean acceptance length. The one home of these concepts: the in-process loop
(verifier/generate.py), the drafter's loop over gRPC (drafter/loop.py), the server's metrics and
the benches all use them, so the same stream reports the same figures everywhere.
No torch here: the drafter imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def mean_acceptance_length(accepted_tokens: int, drafted_steps: int) -> float:
    """Tokens emitted per step that carried drafts, the bonus counted: 1 + accepted / drafted steps
    (DESIGN.md section 7). 1.0 when no step carried drafts."""
    return 1.0 + accepted_tokens / drafted_steps if drafted_steps else 1.0


def draft_room(k: int, max_k: int, max_context: int, position: int, max_new_tokens: int, emitted: int) -> int:
    """How many drafts the next step may carry: at most k and the verifier's max_k, no verify row
    past the context (position + drafts + 1 <= max_context), and none past the token budget (a step
    emits at most drafts + 1 tokens, so drafts beyond max_new_tokens - emitted - 1 could never be
    kept). `emitted` counts the tokens emitted so far, the first one included."""
    return max(0, min(k, max_k, max_context - position - 1, max_new_tokens - emitted - 1))


@dataclass
class Generation:
    tokens: list[int]  # emitted ids, the first token and an eos that ended it included
    finish_reason: str  # "eos" or "length"
    accepted_per_step: list[int]  # drafts accepted per verify step (a step with no drafts counts 0)
    drafted_per_step: list[int]  # drafts verified per step (over gRPC: the server's verified_drafts; 0: a plain decode step)
    # [len(tokens), vocab] float32 (a torch tensor in process, a numpy array over gRPC) when asked:
    # row i holds the logits tokens[i] was chosen from
    logits: Any = field(default=None, repr=False)
    session_id: str = ""  # over gRPC: the session that generated it
    prompt_ids: list[int] = field(default_factory=list)  # the prompt as the model saw it

    @property
    def steps(self) -> int:
        return len(self.accepted_per_step)

    @property
    def mean_acceptance_length(self) -> float:
        drafted = [a for a, d in zip(self.accepted_per_step, self.drafted_per_step) if d]
        return mean_acceptance_length(sum(drafted), len(drafted))

    def step_figures(self) -> dict:
        """The per-step figures both command lines print with --json, under the same keys."""
        return {
            "steps": self.steps,
            "accepted_per_step": list(self.accepted_per_step),
            "drafted_per_step": list(self.drafted_per_step),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
        }
