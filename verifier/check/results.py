"""What each check of `python -m verifier check` counts, and the one comparison they all use:
torch.equal, bit for bit, never a tolerance. A difference is kept with where it happened and its
largest absolute difference, for the human reading the report.

Tensor parallelism (--tensor-parallel N): every rank runs the same checks and compares its own
tensors: the logits are whole and the same on every rank, but a layer's recorded output is the
rank's partial sum and a layer's state holds the rank's heads only. So each comparison's verdicts
are agreed across the ranks (`agree`): a row or state counts as equal only when it is equal on
every rank, and every rank then takes the same branch after it (a rank that stopped a stream
alone would send the others different engine calls, and their collectives would no longer pair).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..model.parallel import TensorParallel


def max_abs_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in float64; inf when the shapes differ, nan when either holds a nan."""
    if got.shape != want.shape:
        return math.inf
    if got.numel() == 0:
        return 0.0
    return float((got.double() - want.double()).abs().max())


def agree(parallel: TensorParallel | None, equal: list[bool], diffs: list[float]) -> tuple[list[bool], list[float]]:
    """One comparison's verdicts merged over the ranks: equal where every rank found equal, and the
    largest difference any rank saw. The same on every rank; one all_gather per comparison call,
    none without parallelism (parallel None or size 1: the verdicts as given)."""
    if parallel is None or parallel.size == 1 or not equal:
        return equal, diffs
    import torch.distributed as dist

    # NCCL gathers CUDA tensors only; its ranks run on cuda:rank, torch's current device there
    device = "cuda" if dist.get_backend(parallel.group) == "nccl" else "cpu"
    local = torch.tensor([[float(e) for e in equal], diffs], dtype=torch.float64, device=device)
    every = torch.stack(parallel.gather(local)).cpu()  # [ranks, 2, comparisons]
    # max would keep a nan that only one rank saw; nan_to_num first would hide it: nan wins
    worst = torch.where(every[:, 1].isnan().any(0), math.nan, every[:, 1].nan_to_num(nan=0.0).max(0).values)
    return every[:, 0].min(0).values.bool().tolist(), worst.tolist()


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
    parallel: TensorParallel | None = field(default=None, repr=False)  # the rank's group: verdicts agreed across it

    def _agree(self, equal: list[bool], diffs: list[float]) -> tuple[list[bool], list[float]]:
        return agree(self.parallel, equal, diffs)

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
        n = max(len(got_tokens), len(want_tokens))
        present = [i < len(got_tokens) and i < len(want_tokens) and i < len(got) and i < len(want) for i in range(n)]
        local = [present[i] and got_tokens[i] == want_tokens[i] and torch.equal(got[i], want[i]) for i in range(n)]
        diffs = [0.0 if local[i] else max_abs_diff(got[i], want[i]) if present[i] else math.inf for i in range(n)]
        equal, diffs = self._agree(local, diffs)
        for i in range(n):
            if not self.rows.add(equal[i]):
                self._differs(where(i) + ("" if present[i] else ": missing row"), diffs[i])
        return all(equal)

    def layer_kind(self, kind: str) -> Counts:
        return self.per_layer_kind.setdefault(kind, Counts())

    def compare_layer_rows(self, kinds: list[str], got: list[torch.Tensor], want: list[torch.Tensor], where: str) -> bool:
        """One row of every recorded layer part against the serial row, counted per layer kind."""
        pairs = list(zip(kinds, got, want))
        local = [torch.equal(a, b) for _, a, b in pairs]
        equal, diffs = self._agree(local, [0.0 if e else max_abs_diff(a, b) for e, (_, a, b) in zip(local, pairs)])
        for index, (kind, _, _) in enumerate(pairs):
            if not self.layer_kind(kind).add(equal[index]):
                self._differs(f"{where}: layer {index // 2} {kind}", diffs[index])
        return all(equal)

    def compare_states(self, got, want, where: str) -> bool:
        """Per layer (reference.LayerState lists), every state tensor bitwise; counted per layer kind."""
        pairs = list(zip(got, want))
        local = [len(a.tensors) == len(b.tensors) and all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))
                 for a, b in pairs]
        diffs = [0.0 if e else max((max_abs_diff(x, y) for x, y in zip(a.tensors, b.tensors)), default=math.inf)
                 for e, (a, b) in zip(local, pairs)]
        equal, diffs = self._agree(local, diffs)
        for index, (a, _) in enumerate(pairs):
            self.states.add(equal[index])
            self.layer_kind(f"{a.kind} state").add(equal[index])
            if not equal[index]:
                self._differs(f"{where}: layer {index} {a.kind} state", diffs[index])
        return len(got) == len(want) and all(equal)
