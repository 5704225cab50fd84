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

Acceptance rates are decayed counts per session and draft position (`decay` per observation); a
session with no history borrows the server-wide rates, and positions nobody has reached yet start
at `prior`. The server-wide counts decay once per batch, not per step, so they remember ten
batches of steps: remembering ten steps put a floor of prior / 11 (6%) under drafts that are never
accepted, enough to buy a graph bucket that looks cheap.

A step whose drafts were all trimmed judged nothing, so evidence freezes where it stopped buying
rows, and a drafter that improves, or a good drafter after a run of bad luck, would never be
verified again. The first remedy relaxed every trimmed session's counts by `decay` per step toward
the server-wide rates, and those toward `prior` by `decay` per batch: within a few dozen batches
every estimate was back up, and the trim bought a bucket of probes again, nearly every batch
(H200, 2026-11-30: 64 sessions of random drafts ran at 79.6 rows per batch against 64 for plain
decoding, 0.835x its tokens/s). Exploring now has a bounded price, in two parts:

- Evidence ages by `relax` per batch (0.98: a half-life of 34 batches, against 6.6 observations
  for `decay`): a trimmed session's rates drift toward the server-wide ones, which hold evidence
  only and never drift toward `prior`, and a new observation after a long gap outweighs the stale
  counts. When every drafter is useless the server-wide rates are near 0 and the drift buys no
  rows; a good drafter trimmed after a streak of rejections is verified again within tens of
  batches. (Among good drafters a useless one drifts up too and is verified again now and then:
  at half and half, 1% below the best goodput.)
- Probes are paid from a credit. A batch that trims drafts adds `probe_share` (0.02) of a step;
  a probe takes the trimmed drafts that fit in the rows costing what one more row costs (the rest
  of the next graph bucket) and is charged the larger of its share of the step by the cost table
  and its share of the rows. The table times padding rows, and real rows also bring host work, so
  a bucket may cost more than its entry; the share of rows bounds any step whose time per row
  does not grow with the rows. Probes then cost at most `probe_share` of the steps over time, and
  at plain decoding's rows (one per session) they reach each session's first draft about every
  1 / probe_share = 50 batches. A probe takes the drafts of highest value at rates whose counts
  are discounted by age toward `prior`: stale positions first, and a drafter whose last probe was
  accepted ahead of the useless ones, so that it is probed again soon and its evidence climbs to
  where exploiting it pays.

tests/test_goodput_exploration.py measures the bounds on an H200-shaped table (flat per bucket,
64 -> 80 rows 8% dearer): never-accepted drafts at 64 sessions cost under 1% more than plain
decoding; one session whose drafter turns perfect is verified in full again within 120 batches
(where its drafts pay at all: at 64 sessions x 4 drafts, one perfect session is worth less than
the 16-row bucket it needs), a whole server's drafters within 60. numpy, no torch: the policy is
a function of numbers and is tested as one.
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
    if isinstance(rates, np.ndarray):  # the policy's case: one check for the batch, not a loop
        asked = np.asarray(requested)
        wrong = np.flatnonzero((asked < 0) | (asked > rates.shape[1]))
        if len(wrong):
            s = int(wrong[0])
            raise ValueError(f"trim_drafts: session {s} asks for {requested[s]} drafts with {rates.shape[1]} rates")
    else:
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
        self._rows_array, self._times_array = np.asarray(self.rows), np.asarray(self.times)

    def __call__(self, rows: int) -> float:
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows):
            return self.times[i]
        return self.times[-1] * rows / self.rows[-1]

    def many(self, rows: np.ndarray) -> np.ndarray:
        """__call__ for an array of row counts."""
        i = np.searchsorted(self._rows_array, rows, side="left")
        table = self._times_array
        return np.where(i < len(table), table[np.minimum(i, len(table) - 1)], self.times[-1] * rows / self.rows[-1])


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
    counts of the positions it reached by `decay` first, so recent evidence weighs most."""

    max_k: int
    decay: float = 0.9
    drafted: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self):
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        self.drafted = [0.0] * self.max_k
        self.accepted = [0.0] * self.max_k

    def observe(self, verified, accepted) -> None:
        """One observation: steps that verified `verified` drafts and accepted the first `accepted`
        of them (ints for one step; equal-length sequences for a batch, which decays once). Each step
        reached positions 1..accepted+1 (the first rejected one included, when there is one)."""
        verified, accepted = np.atleast_1d(verified), np.atleast_1d(accepted)
        position = np.arange(self.max_k)[:, None]
        reached = (position < np.minimum(verified, accepted + 1)).sum(axis=1)  # [max_k] steps per position
        taken = (position < accepted).sum(axis=1)  # [max_k]
        for j in np.flatnonzero(reached):
            self.drafted[j] = self.drafted[j] * self.decay + float(reached[j])
            self.accepted[j] = self.accepted[j] * self.decay + float(taken[j])

    def rates(self, fallback: Sequence[float] | None, prior: float, weight: float = 1.0) -> list[float]:
        """Rate per position: (accepted + weight * base) / (drafted + weight), base = fallback's rate
        at that position (the server-wide rates), else `prior` at position 1 and the rate just
        estimated for the position before it deeper down. Carrying the previous position's rate
        forward (not `prior`) matters: a position the policy has not verified yet has no evidence,
        and a prior below the drafter's true rate would keep it unverified for ever (oracle drafts
        stuck at one verified draft per step on the H200), while a high prior everywhere would make
        useless drafts look worth verifying."""
        out = []
        for j in range(self.max_k):
            base = fallback[j] if fallback is not None else (out[j - 1] if j else prior)
            out.append((self.accepted[j] + weight * base) / (self.drafted[j] + weight))
        return out


# The turnaround between two batches (results out, the next steps in: the clients' own work and
# the round trip) is the part of a served round that no row count changes. A gap longer than
# this is an idle server, not a round trip, and is counted as this.
MAX_TURNAROUND_S = 0.02

# Probe credit is kept in steps (1.0: the cost of one batch). Capped at one step, so a long run with
# nothing to probe does not save up a burst of probes for later.
MAX_PROBE_CREDIT = 1.0


class GoodputPolicy:
    """Per-session acceptance rates, the batch trim and the probes, as the scheduler uses them.

    A served round costs the step plus the turnaround before the next batch, and closed-loop
    drafters pay the turnaround whatever the rows: the seconds a batch's tokens are divided by
    are cost(rows) + the turnaround (a decayed mean of the gaps the scheduler reports). Without it
    a row that costs 10% more engine time looked 10% dearer than it is and good drafts were cut
    (oracle drafts at 0.9x untrimmed on the 2B model, H200).

    `relax` (per batch) discounts evidence by its age, `probe_share` is what probing may cost (a
    share of the steps, see the module docstring). The sessions' decayed counts are rows of
    [sessions, max_k] arrays (a batch's rates and updates are a few array operations, not a Python
    loop per session and position: the policy ran ~1 ms per batch of 64 on the H200's host); the
    server-wide counts are a DecayedRates, observed once per batch."""

    def __init__(self, max_k: int, cost: Callable[[int], float], decay: float = 0.9, prior: float = 0.7,
                 relax: float = 0.98, probe_share: float = 0.02):
        if not 0 <= prior <= 1:
            raise ValueError(f"prior must be in [0, 1], got {prior}")
        if not 0 < relax <= 1:
            raise ValueError(f"relax must be in (0, 1], got {relax}")
        if not 0 <= probe_share < 1:
            raise ValueError(f"probe_share must be in [0, 1), got {probe_share}")
        self.max_k, self.cost, self.decay, self.prior = max_k, cost, decay, prior
        self.relax, self.probe_share = relax, probe_share
        self.server = DecayedRates(max_k, decay)
        self.sessions: dict[str, int] = {}  # session id -> its row of the count arrays
        # row 0 stays empty: the row of sessions with no counts, so a batch's rates need no mask
        self._drafted = np.zeros((1, max_k))  # [rows, max_k] decayed drafts that reached each position
        self._accepted = np.zeros((1, max_k))
        self._reached_at = np.zeros((1, max_k), dtype=np.int64)  # the batch that last reached each position
        self._free_rows: list[int] = []
        self.turnaround_s = 0.0  # decayed mean of the gaps between batches
        self.batch = 0  # batches trimmed so far: the clock evidence ages by
        self.probe_credit = 0.0  # in steps: what probes may still cost

    def observe_turnaround(self, gap_s: float) -> None:
        """The time from one batch's results to the next batch's start."""
        gap_s = min(max(gap_s, 0.0), MAX_TURNAROUND_S)
        self.turnaround_s = self.decay * self.turnaround_s + (1 - self.decay) * gap_s

    def trim(self, session_ids: Sequence[str], requested: Sequence[int]) -> list[int]:
        """Drafts to verify per session of one batch (requested[i] drafts sent by session_ids[i]):
        those worth their rows by the evidence, plus a probe when the credit allows one."""
        self.batch += 1
        if not any(requested):  # plain decoding: nothing to trim
            return list(requested)
        rows = np.array([self.sessions.get(s, 0) for s in session_ids])
        cost = _WithTurnaround(self.cost, self.turnaround_s)
        server = np.asarray(self.server.rates(None, self.prior))  # [max_k]
        verified = trim_drafts(requested, self._rates(rows, server), cost)
        if sum(verified) == sum(requested):
            return verified
        self.probe_credit = min(self.probe_credit + self.probe_share, MAX_PROBE_CREDIT)
        return self._probe(rows, requested, verified, cost)

    def _rates(self, rows: np.ndarray, base: np.ndarray | float) -> np.ndarray:
        """[S, max_k] rates (accepted + base) / (drafted + 1) from each session's counts, discounted
        by relax ** their age (row 0, no counts: `base`)."""
        weight = self.relax ** self._age(rows)
        return (self._accepted[rows] * weight + base) / (self._drafted[rows] * weight + 1.0)

    def _age(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), max_k] batches since each position was last reached, the batch after it not counted
        (evidence renewed every batch does not age)."""
        return np.maximum(self.batch - self._reached_at[rows] - 1, 0)

    def _probe(self, rows: np.ndarray, requested: Sequence[int], verified: list[int], cost) -> list[int]:
        """`verified` plus, when the probe credit pays for it, the trimmed drafts that fit in the
        rows costing what one more row costs (the rest of the next graph bucket), chosen by their
        value at rates whose evidence is discounted by age toward `prior`: stale positions first."""
        step_rows = len(requested) + sum(verified)
        costs = cost.many(np.arange(step_rows + 1, len(requested) + sum(requested) + 1))  # one more row, two, ...
        dearer = np.flatnonzero(costs > costs[0])
        size = min(int(dearer[0]) if len(dearer) else len(costs), step_rows)
        step = cost(step_rows)
        # rows at no less than their share of the step: the measured table may make a bucket look
        # cheaper than real rows in it are (padding rows are timed), and per-row host work grows too
        charge = max(float(costs[size - 1]) / step - 1.0, size / step_rows)
        if charge > self.probe_credit:
            return verified
        self.probe_credit -= charge
        asked, kept = np.asarray(requested), np.asarray(verified)
        position = np.arange(int(asked.max()))[None, :]
        trimmed = (position >= kept[:, None]) & (position < asked[:, None])  # [S, width]
        value = np.cumprod(self._rates(rows, self.prior)[:, : position.shape[1]], axis=1)
        session, at = np.nonzero(trimmed)
        chosen = np.lexsort((at, session, -value[session, at]))[:size]
        return (kept + np.bincount(session[chosen], minlength=len(asked))).tolist()

    def observe(self, session_id: str, requested: int, verified: int, accepted: int) -> None:
        """One step's outcome, as a batch of one: `requested` drafts sent, `verified` verified, `accepted` accepted."""
        self.observe_batch([session_id], [requested], [verified], [accepted])

    def observe_batch(self, session_ids: Sequence[str], requested: Sequence[int], verified: Sequence[int],
                      accepted: Sequence[int]) -> None:
        """A batch's outcomes, one per session (each at most once): a step that verified drafts
        counts the positions it reached (the first rejected one included), its old counts there
        discounted by relax ** (their age) and decayed; the server-wide counts take the whole batch
        as one observation. A step whose drafts were all trimmed judged nothing and changes nothing."""
        judged = [i for i, k in enumerate(verified) if k > 0]
        if not judged:
            return
        for i in judged:
            if session_ids[i] not in self.sessions:
                self.sessions[session_ids[i]] = self._new_row()
        rows = np.array([self.sessions[session_ids[i]] for i in judged])
        k = np.array([verified[i] for i in judged])
        a = np.array([accepted[i] for i in judged])
        position = np.arange(self.max_k)[None, :]
        reached = position < np.minimum(k, a + 1)[:, None]  # [steps, max_k]
        kept = np.where(reached, self.decay * self.relax ** self._age(rows), 1.0)  # what old counts keep
        self._drafted[rows] = self._drafted[rows] * kept + reached
        self._accepted[rows] = self._accepted[rows] * kept + (position < a[:, None])
        self._reached_at[rows] = np.where(reached, self.batch, self._reached_at[rows])
        self.server.observe(k, a)

    def forget(self, session_id: str) -> None:
        row = self.sessions.pop(session_id, None)
        if row is not None:
            self._drafted[row] = 0.0
            self._accepted[row] = 0.0
            self._reached_at[row] = 0
            self._free_rows.append(row)

    def _new_row(self) -> int:
        if not self._free_rows:
            grown = max(8, 2 * len(self._drafted))  # row 0 is never handed out
            self._free_rows = list(range(grown - 1, len(self._drafted) - 1, -1))
            extra = grown - len(self._drafted)
            self._drafted = np.concatenate((self._drafted, np.zeros((extra, self.max_k))))
            self._accepted = np.concatenate((self._accepted, np.zeros((extra, self.max_k))))
            self._reached_at = np.concatenate((self._reached_at, np.zeros((extra, self.max_k), dtype=np.int64)))
        return self._free_rows.pop()
