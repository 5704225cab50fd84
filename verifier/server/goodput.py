"""Goodput-aware K: how many of each session's drafts a batch verifies (DESIGN.md section 9).

A step of R verify rows costs cost(R) seconds (measured at startup, per graph bucket of rows) and
emits, per session, 1 + (the drafts it accepts) tokens. Verifying a session's j-th draft adds a row
and is worth P(the first j drafts are all accepted) = a_1 * ... * a_j expected tokens, where a_i is
the session's acceptance rate at draft position i. So per batch we choose k_s <= requested_s for
every session s to maximise

    expected tokens per second = sum_s (1 + sum_{j <= k_s} P_s(j)) / cost(sum_s (k_s + 1)).

P_s(j) never grows with j (a product of rates <= 1), so for a fixed number T of draft rows the best
choice takes the T largest marginal values P_s(j) over all sessions, each session's in order
(a greedy merge); the policy then picks the T whose total over its cost is largest. With a step-cost
table flat inside a graph bucket, rows that fill a bucket are free and are always verified; with
drafts that are never accepted no draft row is bought once the rows cost time; with drafts that
are always accepted every draft is verified as long as a row costs less than the token it brings.

Trimming changes no token of the stream: a step verifies a prefix of the drafts, and the tokens a
step emits (accepted drafts, then the target's own token) are those of plain decoding whatever the
drafts (the bit-exactness contract). Only the number of tokens per step changes.

Acceptance rates are decayed counts per session and draft position; a session with no history
borrows the server-wide rates (also decayed), and positions nobody has reached yet start at
`prior`. A step whose drafts were all trimmed judged nothing, so evidence would freeze where it
stopped buying rows (a drafter that improves, or a good drafter arriving after a run of bad ones,
would never be verified again): such a step relaxes the session's counts (decay without an
observation) toward the server-wide rates, and a batch holding such a step relaxes the server-wide
counts toward `prior`. Drafts are then tried again once old evidence has faded, at a cost that
falls as rows get dearer. numpy, no torch: the policy is a function of numbers and is tested
as one.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """Expected tokens a step with k drafts emits: 1 + sum_{j<=k} prod_{i<=j} rates[i-1]."""
    total, alive = 1.0, 1.0
    for j in range(k):
        alive *= rates[j]
        total += alive
    return total


def trim_drafts(requested: Sequence[int], rates, cost: Callable[[int], float]) -> list[int]:
    """Drafts to verify per session: k_s <= requested[s], chosen to maximise expected tokens per
    second. rates[s][j] is session s's acceptance rate at draft position j + 1 (at least
    requested[s] of them; a list of lists or an [S, >= max requested] array); cost(rows) > 0 is the
    step time of a batch of `rows` verify rows, never smaller for more rows (StepCost makes a
    measured table so); a cost with a `many(rows array)` method is asked once for every candidate.
    Ties go to more drafts (the same goodput, more information about the drafter).

    Vectorised (a batch of 64 sessions x 8 drafts is one sort, not a heap walk in Python): every
    draft's marginal value P_s(j) in descending order, sessions' own drafts in order (their values
    never grow; ties by session then position), the tokens and rows of every prefix of that order,
    and the prefix of largest tokens / cost. When even the best draft left cannot pay for the next
    row (useless drafts), two cost lookups decide it."""
    if len(requested) != len(rates):
        raise ValueError(f"trim_drafts: {len(requested)} requests but {len(rates)} rate lists")
    for s, (k, r) in enumerate(zip(requested, rates)):
        if k < 0 or len(r) < k:
            raise ValueError(f"trim_drafts: session {s} asks for {k} drafts with {len(r)} rates")
    base_rows = len(requested)
    width = max(requested, default=0)
    if width == 0:
        return [0] * base_rows
    asked = np.asarray(requested)
    wanted = np.arange(width)[None, :] < asked[:, None]  # [S, width]: drafts sent
    if isinstance(rates, np.ndarray):
        rate = np.where(wanted, rates[:, :width], 0.0)
    else:
        rate = np.zeros((base_rows, width))
        for s, r in enumerate(rates):
            rate[s, : asked[s]] = np.asarray(r[: asked[s]], dtype=np.float64)
    value = np.cumprod(rate, axis=1)  # [S, width]: P_s(j), the j-th draft's expected tokens
    base_rate = base_rows / cost(base_rows)
    if (base_rows + float(value[wanted].sum())) / cost(base_rows + 1) < base_rate:
        return [0] * base_rows  # every draft together, at the price of one row, does not pay
    session, position = np.nonzero(wanted)  # row-major: sessions ascending, positions ascending
    order = np.lexsort((position, session, -value[session, position]))
    tokens = base_rows + np.cumsum(value[session, position][order])
    rows = base_rows + np.arange(1, len(order) + 1)
    costs = cost.many(rows) if hasattr(cost, "many") else np.array([cost(int(r)) for r in rows])
    goodput = np.concatenate(([base_rate], tokens / costs))
    best = len(goodput) - 1 - int(np.argmax(goodput[::-1]))  # the last prefix of the largest goodput
    return np.bincount(session[order[:best]], minlength=base_rows).tolist()


class StepCost:
    """Step time by verify rows, from a table measured at startup: {rows: seconds}. A batch of R
    rows costs the time of the smallest measured row count >= R (graphs pad R up to a bucket);
    past the table, the cost grows linearly from the last entry."""

    def __init__(self, table: dict[int, float]):
        if not table or any(r < 1 or not t > 0 for r, t in table.items()):
            raise ValueError(f"StepCost needs row counts >= 1 with times > 0, got {table}")
        self.rows = sorted(table)
        # a larger bucket is never cheaper: a measured dip is timing noise, and the trim's early
        # stop relies on costs that never fall
        self.times = list(itertools.accumulate((table[r] for r in self.rows), max))

    def __call__(self, rows: int) -> float:
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows):
            return self.times[i]
        return self.times[-1] * rows / self.rows[-1]

    def many(self, rows: np.ndarray) -> np.ndarray:
        """__call__ for an array of row counts."""
        i = np.searchsorted(self.rows, rows, side="left")
        table = np.asarray(self.times)
        return np.where(i < len(self.rows), table[np.minimum(i, len(self.rows) - 1)], self.times[-1] * rows / self.rows[-1])


class _WithTurnaround:
    """A step cost plus the turnaround every round pays (GoodputPolicy)."""

    def __init__(self, cost, turnaround_s: float):
        self.cost, self.turnaround_s = cost, turnaround_s

    def __call__(self, rows: int) -> float:
        return self.cost(rows) + self.turnaround_s

    def many(self, rows: np.ndarray) -> np.ndarray:
        if hasattr(self.cost, "many"):
            return self.cost.many(rows) + self.turnaround_s
        return np.array([self.cost(int(r)) for r in rows]) + self.turnaround_s


@dataclass
class DecayedRates:
    """Acceptance rate by draft position from decayed counts: each observation multiplies the old
    counts by `decay` first, so recent steps weigh most."""

    max_k: int
    decay: float = 0.9
    drafted: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        self.drafted = [0.0] * self.max_k
        self.accepted = [0.0] * self.max_k

    def observe(self, verified: int, accepted: int) -> None:
        """A step verified `verified` drafts and accepted the first `accepted` of them: positions
        1..accepted+1 (the first rejected one included, when there is one) were reached."""
        reached = min(verified, accepted + 1)
        for j in range(reached):
            self.drafted[j] = self.drafted[j] * self.decay + 1.0
            self.accepted[j] = self.accepted[j] * self.decay + (1.0 if j < accepted else 0.0)

    def relax(self) -> None:
        """A step that judged nothing: older evidence weighs less, the base (see rates) more."""
        self.drafted = [d * self.decay for d in self.drafted]
        self.accepted = [a * self.decay for a in self.accepted]

    def rates(self, fallback: Sequence[float] | None, prior: float, weight: float = 1.0) -> list[float]:
        """Rate per position: (accepted + weight * base) / (drafted + weight), base = fallback's rate
        at that position (the server-wide rates), else `prior` at position 1 and the rate just
        estimated for the position before it deeper down. Carrying the previous position's rate
        forward (not `prior`) matters: a position the policy has not verified yet has no evidence,
        and a prior below the drafter's true rate would keep it unverified for ever (oracle drafts
        stuck at one verified draft per step on the H200), while a high prior everywhere would make
        useless drafts look worth a probe after every relaxation."""
        out = []
        for j in range(self.max_k):
            base = fallback[j] if fallback is not None else (out[j - 1] if j else prior)
            out.append((self.accepted[j] + weight * base) / (self.drafted[j] + weight))
        return out


# The turnaround between two batches (results out, the next steps in: the clients' own work and
# the round trip) is the part of a served round that no row count changes. A gap longer than
# this is an idle server, not a round trip, and is counted as this.
MAX_TURNAROUND_S = 0.02


class GoodputPolicy:
    """Per-session acceptance rates and the batch trim, as the scheduler uses them.

    A served round costs the step plus the turnaround before the next batch, and closed-loop
    drafters pay the turnaround whatever the rows: the seconds a batch's tokens are divided by
    are cost(rows) + the turnaround (a decayed mean of the gaps the scheduler reports). Without it
    a row that costs 10% more engine time looked 10% dearer than it is and good drafts were cut
    (oracle drafts at 0.9x untrimmed on the 2B model, H200).

    The sessions' decayed counts are rows of two [sessions, max_k] arrays (a batch's rates and
    updates are a few array operations, not a Python loop per session and position: the policy
    ran ~1 ms per batch of 64 on the H200's host); the server-wide counts are a DecayedRates."""

    def __init__(self, max_k: int, cost: Callable[[int], float], decay: float = 0.9, prior: float = 0.7):
        if not 0 <= prior <= 1:
            raise ValueError(f"prior must be in [0, 1], got {prior}")
        self.max_k, self.cost, self.decay, self.prior = max_k, cost, decay, prior
        self.server = DecayedRates(max_k, decay)
        self.sessions: dict[str, int] = {}  # session id -> its row of the count arrays
        self._drafted = np.zeros((0, max_k))  # [rows, max_k] decayed drafts that reached each position
        self._accepted = np.zeros((0, max_k))
        self._free_rows: list[int] = []
        self.turnaround_s = 0.0  # decayed mean of the gaps between batches
        self._relax_server = False  # a step of the last batch had every draft trimmed

    def observe_turnaround(self, gap_s: float) -> None:
        """The time from one batch's results to the next batch's start."""
        gap_s = min(max(gap_s, 0.0), MAX_TURNAROUND_S)
        self.turnaround_s = self.decay * self.turnaround_s + (1 - self.decay) * gap_s

    def trim(self, session_ids: Sequence[str], requested: Sequence[int]) -> list[int]:
        """Drafts to verify per session of one batch (requested[i] drafts sent by session_ids[i])."""
        if self._relax_server:
            self.server.relax()
            self._relax_server = False
        if not any(requested):  # plain decoding: nothing to trim
            return list(requested)
        server = np.asarray(self.server.rates(None, self.prior))  # [max_k]
        rates = np.broadcast_to(server, (len(session_ids), self.max_k)).copy()
        rows = np.array([self.sessions.get(s, -1) for s in session_ids])
        known = rows >= 0
        if known.any():  # (accepted + base) / (drafted + 1), the base the server-wide rate
            at = rows[known]
            rates[known] = (self._accepted[at] + server) / (self._drafted[at] + 1.0)
        return trim_drafts(requested, rates, _WithTurnaround(self.cost, self.turnaround_s))

    def observe(self, session_id: str, requested: int, verified: int, accepted: int) -> None:
        """One step's outcome: it sent `requested` drafts, `verified` were verified, `accepted` accepted."""
        self.observe_batch([session_id], [requested], [verified], [accepted])

    def observe_batch(self, session_ids: Sequence[str], requested: Sequence[int], verified: Sequence[int],
                      accepted: Sequence[int]) -> None:
        """A batch's outcomes, one per session (each at most once), as `observe`: a step whose drafts
        were all trimmed relaxes its session's counts (and, next batch, the server-wide ones); a
        step that verified drafts counts the positions it reached, decayed."""
        judged, relaxed = [], []
        for i, (sid, sent, k) in enumerate(zip(session_ids, requested, verified)):
            if sent == 0:
                continue
            if k == 0:
                self._relax_server = True
                if sid in self.sessions:
                    relaxed.append(self.sessions[sid])
            else:
                judged.append(i)
                if sid not in self.sessions:
                    self.sessions[sid] = self._new_row()
        if relaxed:
            self._drafted[relaxed] *= self.decay
            self._accepted[relaxed] *= self.decay
        if not judged:
            return
        rows = np.array([self.sessions[session_ids[i]] for i in judged])
        k = np.array([verified[i] for i in judged])[:, None]
        a = np.array([accepted[i] for i in judged])[:, None]
        position = np.arange(self.max_k)[None, :]
        reached = position < np.minimum(k, a + 1)  # [steps, max_k]: the first rejected one included
        self._drafted[rows] = np.where(reached, self._drafted[rows] * self.decay + 1.0, self._drafted[rows])
        self._accepted[rows] = np.where(reached, self._accepted[rows] * self.decay + (position < a), self._accepted[rows])
        for i in judged:
            self.server.observe(verified[i], accepted[i])

    def forget(self, session_id: str) -> None:
        row = self.sessions.pop(session_id, None)
        if row is not None:
            self._drafted[row] = 0.0
            self._accepted[row] = 0.0
            self._free_rows.append(row)

    def _new_row(self) -> int:
        if not self._free_rows:
            grown = max(8, 2 * len(self._drafted))
            self._free_rows = list(range(grown - 1, len(self._drafted) - 1, -1))
            self._drafted = np.concatenate((self._drafted, np.zeros((grown - len(self._drafted), self.max_k))))
            self._accepted = np.concatenate((self._accepted, np.zeros((grown - len(self._accepted), self.max_k))))
        return self._free_rows.pop()
