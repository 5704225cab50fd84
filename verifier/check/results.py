"""What each check of `python -m verifier check` counts, and the one comparison they all use:
torch.equal, bit for bit, never a tolerance. A difference is kept with where it happened and its
largest absolute difference, for the human reading the report."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def max_abs_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in float64; inf when the shapes differ, nan when either holds a nan."""
    if got.shape != want.shape:
        return math.inf
    if got.numel() == 0:
        return 0.0
    return float((got.double() - want.double()).abs().max())


@dataclass
class Difference:
    check: str
    where: str  # e.g. "K=3 wrong drafts, step 2, row 1 (stream row 4)"
    max_abs_diff: float

    def describe(self) -> str:
        return f"{self.check}: {self.where}: max abs diff {self.max_abs_diff:.3g}"


@dataclass
class Counts:
    checked: int = 0
    equal: int = 0

    def add(self, equal: bool) -> bool:
        self.checked += 1
        self.equal += int(equal)
        return equal


@dataclass
class CheckResult:
    name: str  # e.g. "verify_vs_serial"
    title: str  # one line for the human report
    path: str  # "eager" or "cuda graphs": how the engine ran the steps
    rows: Counts = field(default_factory=Counts)  # logit rows (and the token chosen from each)
    states: Counts = field(default_factory=Counts)  # one per layer state compared after a rollback
    per_layer_kind: dict[str, Counts] = field(default_factory=dict)  # "gdn mixer", "moe mlp", "kda state", ...
    first_difference: Difference | None = None
    seconds: float = 0.0
    batch_rows: list[int] = field(default_factory=list)  # rows of each batched step (the full-batch check)

    @property
    def passed(self) -> bool:
        return self.first_difference is None and self.rows.equal == self.rows.checked

    def _differs(self, where: str, diff: float) -> None:
        if self.first_difference is None:
            self.first_difference = Difference(self.name, where, diff)

    def compare_rows(self, got_tokens: list[int], got: torch.Tensor, want_tokens: list[int], want: torch.Tensor,
                     where) -> bool:
        """Rows [n, vocab] and the tokens chosen from them, row by row; where(i) names row i.
        A row missing on either side counts as checked and differing."""
        all_equal = True
        for i in range(max(len(got_tokens), len(want_tokens))):
            present = i < len(got_tokens) and i < len(want_tokens) and i < len(got) and i < len(want)
            equal = present and got_tokens[i] == want_tokens[i] and torch.equal(got[i], want[i])
            if not self.rows.add(equal):
                all_equal = False
                self._differs(where(i) + ("" if present else ": missing row"),
                              max_abs_diff(got[i], want[i]) if present else math.inf)
        return all_equal

    def layer_kind(self, kind: str) -> Counts:
        return self.per_layer_kind.setdefault(kind, Counts())

    def compare_layer_rows(self, kinds: list[str], got: list[torch.Tensor], want: list[torch.Tensor], where: str) -> bool:
        """One row of every recorded layer part against the serial row, counted per layer kind."""
        all_equal = True
        for index, (kind, a, b) in enumerate(zip(kinds, got, want)):
            if not self.layer_kind(kind).add(torch.equal(a, b)):
                all_equal = False
                self._differs(f"{where}: layer {index // 2} {kind}", max_abs_diff(a, b))
        return all_equal

    def compare_states(self, got, want, where: str) -> bool:
        """Per layer (reference.LayerState lists), every state tensor bitwise; counted per layer kind."""
        all_equal = len(got) == len(want)
        for index, (a, b) in enumerate(zip(got, want)):
            equal = len(a.tensors) == len(b.tensors) and all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))
            self.states.add(equal)
            self.layer_kind(f"{a.kind} state").add(equal)
            if not equal:
                all_equal = False
                diff = max((max_abs_diff(x, y) for x, y in zip(a.tensors, b.tensors)), default=math.inf)
                self._differs(f"{where}: layer {index} {a.kind} state", diff)
        return all_equal
