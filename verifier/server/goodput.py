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
falls as rows get dearer. Pure Python, no torch: the policy is a function of numbers and is tested
as one.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """Expected tokens a step with k drafts emits: 1 + sum_{j<=k} prod_{i<=j} rates[i-1]."""
    total, alive = 1.0, 1.0
    for j in range(k):
        alive *= rates[j]
        total += alive
    return total


def trim_drafts(requested: Sequence[int], rates: Sequence[Sequence[float]],
                cost: Callable[[int], float]) -> list[int]:
    """Drafts to verify per session: k_s <= requested[s], chosen to maximise expected tokens per
    second. rates[s][j] is session s's acceptance rate at draft position j + 1 (at least
    requested[s] of them); cost(rows) > 0 is the step time of a batch of `rows` verify rows, never
    smaller for more rows (StepCost makes a measured table so). Ties go to more drafts (the same
    goodput, more information about the drafter).

    The walk stops once no later prefix can win: every draft still to come is worth at most the
    largest marginal left and costs at least the next row, so (tokens + left * that marginal) /
    cost(next rows) bounds every later rate. With useless drafts this stops at once instead of
    walking all of a batch's drafts (a batch of 64 sessions x 4 drafts: ~1 ms of Python)."""
    if len(requested) != len(rates):
        raise ValueError(f"trim_drafts: {len(requested)} requests but {len(rates)} rate lists")
    for s, (k, r) in enumerate(zip(requested, rates)):
        if k < 0 or len(r) < k:
            raise ValueError(f"trim_drafts: session {s} asks for {k} drafts with {len(r)} rates")
    base_rows = len(requested)
    # marginal value of each session's next draft, largest first; a session's values never grow,
    # so popping the largest and pushing that session's next keeps the prefix order per session
    heap = [(-float(rates[s][0]), s, 0) for s in range(base_rows) if requested[s] > 0]
    heapq.heapify(heap)
    alive = [1.0] * base_rows
    taken = [0] * base_rows
    order: list[int] = []  # the session each successive draft row goes to
    tokens = float(base_rows)
    best_rate, best_rows = tokens / cost(base_rows), 0
    left = sum(requested)
    while heap:
        if (tokens + left * -heap[0][0]) / cost(base_rows + len(order) + 1) < best_rate:
            break
        _, s, j = heapq.heappop(heap)
        left -= 1
        alive[s] *= rates[s][j]
        tokens += alive[s]
        taken[s] += 1
        order.append(s)
        if taken[s] < requested[s]:
            heapq.heappush(heap, (-alive[s] * rates[s][taken[s]], s, taken[s]))
        rate = tokens / cost(base_rows + len(order))
        if rate >= best_rate:
            best_rate, best_rows = rate, len(order)
    chosen = [0] * base_rows
    for s in order[:best_rows]:
        chosen[s] += 1
    return chosen


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
    (oracle drafts at 0.9x untrimmed on the 2B model, H200)."""

    def __init__(self, max_k: int, cost: Callable[[int], float], decay: float = 0.9, prior: float = 0.7):
        if not 0 <= prior <= 1:
            raise ValueError(f"prior must be in [0, 1], got {prior}")
        self.max_k, self.cost, self.decay, self.prior = max_k, cost, decay, prior
        self.server = DecayedRates(max_k, decay)
        self.sessions: dict[str, DecayedRates] = {}
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
        server = self.server.rates(None, self.prior)
        rates = [self.sessions[s].rates(server, self.prior) if s in self.sessions else server for s in session_ids]
        turnaround = self.turnaround_s
        return trim_drafts(requested, rates, lambda rows: self.cost(rows) + turnaround)

    def observe(self, session_id: str, requested: int, verified: int, accepted: int) -> None:
        """One step's outcome: it sent `requested` drafts, `verified` were verified, `accepted` accepted."""
        if requested == 0:
            return
        rates = self.sessions.get(session_id)
        if verified == 0:
            if rates is not None:
                rates.relax()
            self._relax_server = True
            return
        if rates is None:
            rates = self.sessions[session_id] = DecayedRates(self.max_k, self.decay)
        rates.observe(verified, accepted)
        self.server.observe(verified, accepted)

    def forget(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)
