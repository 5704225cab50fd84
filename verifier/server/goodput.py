"""Goodput-aware K: how many of each session's drafts a batch verifies, to maximise expected tokens
per second from the measured step cost by row count and each session's decayed acceptance by
position; the stream is unchanged, only fewer drafts are verified. The objective, the cost model,
the acceptance evidence, exploration by probes and their measured bounds: DESIGN.md section 9,
"Goodput-aware K". numpy, no torch: the policy is a function of numbers and is tested as one.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

# The policy runs on the served round's critical path, once per batch, on arrays of a few hundred
# numbers at most: what it costs is mostly the count of numpy calls (~1-3 us each whatever the
# size), so the code below keeps that count small: one stable sort instead of a lexsort, take()
# instead of fancy indexing, the ufuncs' own reduce/accumulate (the same arithmetic as sum, cumsum
# and cumprod, without their Python wrappers), a table of relax ** age instead of a pow per count.
# The choice is what is held (tests/test_goodput.py: the best within TIE, by exact arithmetic), not
# the bits of these sums. One path serves every batch size; `python -m bench.goodput_policy` times it per batch size.


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """Expected tokens a step with k drafts emits: 1 + sum_{j<=k} prod_{i<=j} rates[i-1]."""
    total, alive = 1.0, 1.0
    for j in range(k):
        alive *= rates[j]
        total += alive
    return total


def _best_first(values: np.ndarray) -> np.ndarray:
    """Order of `values` (drafts in row-major order: session, then position) by value, highest
    first; a stable sort, so ties keep row-major order: the lower session, then the earlier position."""
    return (-values).argsort(kind="stable")


def _span_costs(cost: Callable[[int], float], first: int, stop: int) -> np.ndarray:
    """[stop - first] cost(rows) for rows = first .. stop - 1: one `span` call where the cost has one."""
    return cost.span(first, stop) if hasattr(cost, "span") else np.array([cost(r) for r in range(first, stop)])


# Goodputs within this share of the largest are equal: their difference is the rounding of the
# model's arithmetic, not a difference the drafts make; the choice with the most drafts wins.
TIE = 2.0 ** -40


def per_row_capped(costs: np.ndarray, first: int) -> np.ndarray:
    """The decision's cost model from measured costs [n] of first .. first + n - 1 rows: each step
    charged no more per row than the cheapest per row of the steps from `first` rows up to it,
    model(R) = R * min_{first <= r <= R} cost(r) / r, and the measured cost itself, bit for bit,
    where that minimum is its own (so a flat bucket's equal costs stay equal). Never smaller for
    more rows when the costs are not (see DESIGN.md section 9, "Goodput-aware K")."""
    rows = np.arange(first, first + len(costs))
    per_row = costs / rows
    least = np.minimum.accumulate(per_row)
    return np.where(per_row <= least, costs, least * rows)


def trim_drafts(requested: Sequence[int], rates, cost: Callable[[int], float], fixed_rows: int = 0) -> list[int]:
    """Drafts to verify per session: k_s <= requested[s], chosen to maximise expected tokens per
    second under the per-row capped cost model (per_row_capped). rates[s][j] is session s's
    acceptance rate at draft position j + 1 (at least requested[s] of them; a list of lists or an
    [S, >= max requested] array); cost(rows) > 0 is the step time of a batch of `rows` verify rows,
    never smaller for more rows (StepCost makes a measured table so); a cost with a
    `span(first, stop)` method is asked once for every candidate. `fixed_rows` more rows run in the
    step whatever the choice (sessions exempt from trimming), each counted as a token (the module
    docstring says why). Ties go to more drafts (the same goodput, more information about the drafter).

    Vectorised (a batch of 64 sessions x 8 drafts is one sort, not a heap walk in Python): every
    draft's marginal value P_s(j) in descending order, sessions' own drafts in order (their values
    never grow; ties by session then position), the tokens and rows of every prefix of that order,
    and the prefix of largest tokens / model cost. When even the best draft left cannot pay for the
    next row (useless drafts), two cost lookups decide it."""
    if len(requested) != len(rates):
        raise ValueError(f"trim_drafts: {len(requested)} requests but {len(rates)} rate lists")
    if fixed_rows < 0:
        raise ValueError(f"trim_drafts: fixed_rows must be >= 0, got {fixed_rows}")
    sessions = len(requested)
    base_rows = sessions + fixed_rows
    width = max(requested, default=0)
    if isinstance(rates, np.ndarray):  # the policy's case: one check for the batch, not a loop
        if sessions and (min(requested) < 0 or width > rates.shape[1]):
            s = next(s for s, k in enumerate(requested) if not 0 <= k <= rates.shape[1])
            raise ValueError(f"trim_drafts: session {s} asks for {requested[s]} drafts with {rates.shape[1]} rates")
    else:
        for s, (k, r) in enumerate(zip(requested, rates)):
            if k < 0 or len(r) < k:
                raise ValueError(f"trim_drafts: session {s} asks for {k} drafts with {len(r)} rates")
    if width == 0:
        return [0] * sessions
    asked = np.asarray(requested)
    wanted = np.arange(width) < asked[:, None]  # [S, width]: drafts sent
    if isinstance(rates, np.ndarray):
        rate = rates[:, :width]  # rates past a session's drafts are never read: P_s(j) needs positions <= j only
    else:
        rate = np.zeros((sessions, width))
        for s, r in enumerate(rates):
            rate[s, : asked[s]] = np.asarray(r[: asked[s]], dtype=np.float64)
    # [drafts sent], row-major: P_s(j), the j-th draft's expected tokens (cumprod)
    drafts = np.multiply.accumulate(rate, axis=1)[wanted]
    base_cost = cost(base_rows)
    base_rate = base_rows / base_cost
    # the model's cost of one more row (per_row_capped's second entry, two lookups)
    next_cost = cost(base_rows + 1)
    if not next_cost / (base_rows + 1) <= base_cost / base_rows:
        next_cost = base_cost / base_rows * (base_rows + 1)
    if (base_rows + float(np.add.reduce(drafts))) / next_cost < base_rate * (1.0 - TIE):
        return [0] * sessions  # every draft together, at the price of one row, does not pay
    order = _best_first(drafts)
    tokens = base_rows + np.add.accumulate(drafts[order])  # [drafts sent]: expected tokens of each prefix of the order
    model = per_row_capped(_span_costs(cost, base_rows, base_rows + len(order) + 1), base_rows)
    goodput = tokens / model[1:]
    tied = goodput >= max(base_rate, float(goodput.max())) * (1.0 - TIE)  # verifying no draft is a choice too
    if not tied.any():
        return [0] * sessions  # no draft at all beats every prefix
    best = len(goodput) - int(tied[::-1].argmax())  # the last prefix of the largest goodput
    if best == len(order):
        return asked.tolist()
    return np.bincount(wanted.nonzero()[0][order[:best]], minlength=sessions).tolist()


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
        # [rows[-1] + 1]: the cost of every row count the table covers (a list of graph buckets: a few
        # thousand rows at most), so that the costs of a run of row counts are one slice
        self._by_rows = np.array([self(r) if r else np.nan for r in range(self.rows[-1] + 1)])

    def __call__(self, rows: int) -> float:
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows):
            return self.times[i]
        return self.times[-1] * rows / self.rows[-1]

    def span(self, first: int, stop: int) -> np.ndarray:
        """[stop - first] __call__ of rows = first .. stop - 1 (first >= 1); read only (a view of the table)."""
        last = self.rows[-1]
        if stop <= last + 1:
            return self._by_rows[first:stop]
        past = np.arange(max(first, last + 1), stop)
        return np.concatenate((self._by_rows[first:], self.times[-1] * past / last))


class _WithTurnaround:
    """A step cost plus the turnaround every round pays (GoodputPolicy)."""

    def __init__(self, cost, turnaround_s: float):
        self.cost, self.turnaround_s = cost, turnaround_s

    def __call__(self, rows: int) -> float:
        return self.cost(rows) + self.turnaround_s

    def span(self, first: int, stop: int) -> np.ndarray:
        return _span_costs(self.cost, first, stop) + self.turnaround_s


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
        self.observe_counts(reached.tolist(), taken.tolist())

    def observe_counts(self, reached: Sequence[int], taken: Sequence[int]) -> None:
        """One observation as counts per position: reached[j] steps reached position j + 1 and
        taken[j] of them had its draft accepted. Positions no step reached keep their counts."""
        for j, steps in enumerate(reached):
            if steps:
                self.drafted[j] = self.drafted[j] * self.decay + float(steps)
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
    share of the steps, see DESIGN.md section 9, "Goodput-aware K"). The sessions' decayed counts are rows of one
    [2, sessions, max_k] array, drafted and accepted (a batch's rates and updates are a few array
    operations, one gather and one scatter of both counts, not a Python loop per session and
    position: the policy ran ~1 ms per batch of 64 on the H200's host); the server-wide counts are
    a DecayedRates, observed once per batch."""

    def __init__(self, max_k: int, cost: Callable[[int], float], decay: float = 0.9, prior: float = 0.7,
                 relax: float = 0.98, probe_share: float = 0.02, base_weight: float = 0.1):
        if not 0 <= prior <= 1:
            raise ValueError(f"prior must be in [0, 1], got {prior}")
        if not 0 < relax <= 1:
            raise ValueError(f"relax must be in (0, 1], got {relax}")
        if not 0 <= probe_share < 1:
            raise ValueError(f"probe_share must be in [0, 1), got {probe_share}")
        if not base_weight > 0:
            raise ValueError(f"base_weight must be > 0, got {base_weight}")
        self.max_k, self.cost, self.decay, self.prior = max_k, cost, decay, prior
        self.relax, self.probe_share, self.base_weight = relax, probe_share, base_weight
        self.server = DecayedRates(max_k, decay)
        self.sessions: dict[str, int] = {}  # session id -> its row of the count arrays
        # row 0 stays empty: the row of sessions with no counts, so a batch's rates need no mask
        self._counts = np.zeros((2, 1, max_k))  # [drafted | accepted, rows, max_k] decayed counts by position
        self._reached_at = np.zeros((1, max_k), dtype=np.int64)  # the batch that last reached each position
        self._positions = np.arange(max_k)  # [max_k] draft positions - 1
        self._tabulate_relax(64)
        self._free_rows: list[int] = []
        self.turnaround_s = 0.0  # decayed mean of the gaps between batches
        self.batch = 0  # batches trimmed so far: the clock evidence ages by
        self.probe_credit = 0.0  # in steps: what probes may still cost

    def observe_turnaround(self, gap_s: float) -> None:
        """The time from one batch's results to the next batch's start."""
        gap_s = min(max(gap_s, 0.0), MAX_TURNAROUND_S)
        self.turnaround_s = self.decay * self.turnaround_s + (1 - self.decay) * gap_s

    def trim(self, session_ids: Sequence[str], requested: Sequence[int], fixed_rows: int = 0) -> list[int]:
        """Drafts to verify per session of one batch (requested[i] drafts sent by session_ids[i]):
        those worth their rows by the evidence, plus a probe when the credit allows one. `fixed_rows`
        more rows run in the same step untrimmed (sessions exempt from trimming): the cost model
        prices the step at its real size."""
        self._next_batch()
        if not any(requested):  # plain decoding: nothing to trim
            return list(requested)
        cost = _WithTurnaround(self.cost, self.turnaround_s)
        width = max(requested)  # rates past the longest draft are never read
        server = np.array(self.server.rates(None, self.prior)[:width])  # [width]
        counts, reached_at = self._gather(self._rows(session_ids))
        unmeasured = counts[0, :, :width] == 0.0  # [S, width]: positions the session never reached
        counts = counts[:, :, :width] * self._relaxed(reached_at)[:, :width]  # [2, S, width], aged
        rates = self._rates(counts, server, self.base_weight)
        if unmeasured.any():  # the rate of the last position it reached, `prior` where it reached none
            last = np.maximum.accumulate(np.where(unmeasured, -1, self._positions[:width]), axis=1)
            rates = np.where(last >= 0, np.take_along_axis(rates, np.maximum(last, 0), axis=1), self.prior)
        verified = trim_drafts(requested, rates, cost, fixed_rows)
        size = self._probe_size(requested, verified, cost, fixed_rows)
        return self._probe(counts, requested, verified, size) if size else verified

    @staticmethod
    def _rates(counts: np.ndarray, base: np.ndarray | float, weight: float = 1.0) -> np.ndarray:
        """[S, width] rates (accepted + weight * base) / (drafted + weight) from aged counts [2, S,
        width] (row 0, no counts: `base`)."""
        return (counts[1] + weight * base) / (counts[0] + weight)

    def _next_batch(self) -> None:
        """Advance the clock evidence ages by, with the table of relax ** age up to every age it allows
        (counts last reached at batch >= 0 are at most batch - 1 old)."""
        self.batch += 1
        powers = self._relax_powers
        if self.batch > len(powers) and powers[-1] not in (0.0, 1.0):  # 0.0: underflowed, 1.0: relax 1
            self._tabulate_relax(2 * self.batch)

    def _tabulate_relax(self, ages: int) -> None:
        """The table of relax ** age for ages 0 .. ages - 1 (see _relaxed)."""
        self._relax_powers = self.relax ** np.arange(ages)

    def _relaxed(self, reached_at: np.ndarray) -> np.ndarray:
        """relax ** the age of counts last reached in batches `reached_at` [rows, max_k]: the batches
        since, the batch after not counted (evidence renewed every batch does not age).

        Looked up in a table made by np.power over an array, without pow's 15-30 ns per element;
        mode="clip" takes an age below 0 (reached this batch) as 0, and one past the table's end as
        its last entry, which the powers no longer leave (see _next_batch). Always whole rows of
        max_k positions, never a slice, so one batch's ages are raised one way."""
        age = (self.batch - 1) - reached_at
        if age.size == 1:
            return self.relax ** np.maximum(age, 0)
        return self._relax_powers.take(age, mode="clip")

    def _probe_size(self, requested: Sequence[int], verified: list[int], cost, fixed_rows: int = 0) -> int:
        """How many trimmed drafts a probe takes (0: none): when the batch trimmed drafts, the credit
        grows, and when it pays for them, a probe takes the trimmed drafts that fit in the rows
        costing what one more row costs (the rest of the next graph bucket), its charge paid."""
        if sum(verified) == sum(requested):
            return 0
        self.probe_credit = min(self.probe_credit + self.probe_share, MAX_PROBE_CREDIT)
        step_rows = fixed_rows + len(requested) + sum(verified)
        if self.probe_credit < 1 / step_rows:  # a probe takes a row at least, charged at least its share of the rows
            return 0
        costs = cost.span(step_rows + 1, fixed_rows + len(requested) + sum(requested) + 1)  # one more row, two, ...
        dearer = int((costs > costs[0]).argmax()) or len(costs)  # the first dearer row (0: none is)
        size = min(dearer, step_rows)
        step = cost(step_rows)
        # rows at no less than their share of the step: the measured table may make a bucket look
        # cheaper than real rows in it are (padding rows are timed), and per-row host work grows too
        charge = max(float(costs[size - 1]) / step - 1.0, size / step_rows)
        if charge > self.probe_credit:
            return 0
        self.probe_credit -= charge
        return size

    def _probe(self, counts: np.ndarray, requested: Sequence[int], verified: list[int], size: int) -> list[int]:
        """`verified` plus the `size` trimmed drafts of highest value at rates whose evidence is
        discounted by age toward `prior`: stale positions first."""
        asked, kept = np.asarray(requested), np.asarray(verified)
        position = self._positions[: max(requested)]
        trimmed = (position >= kept[:, None]) & (position < asked[:, None])  # [S, width]
        value = np.multiply.accumulate(self._rates(counts, self.prior), axis=1)
        chosen = _best_first(value[trimmed])[:size]
        return (kept + np.bincount(trimmed.nonzero()[0][chosen], minlength=len(asked))).tolist()

    def observe(self, session_id: str, requested: int, verified: int, accepted: int) -> None:
        """One step's outcome, as a batch of one: `requested` drafts sent, `verified` verified, `accepted` accepted."""
        self.observe_batch([session_id], [requested], [verified], [accepted])

    def observe_batch(self, session_ids: Sequence[str], requested: Sequence[int], verified: Sequence[int],
                      accepted: Sequence[int]) -> None:
        """A batch's outcomes, one per session (each at most once): a step that verified drafts
        counts the positions it reached (the first rejected one included), its old counts there
        discounted by relax ** (their age) and decayed; the server-wide counts take the whole batch
        as one observation. A step whose drafts were all trimmed judged nothing and changes nothing."""
        if min(verified, default=0) <= 0:  # some steps judged nothing: leave them out
            judged = [i for i, k in enumerate(verified) if k > 0]
            if not judged:
                return
            session_ids, verified, accepted = ([x[i] for i in judged] for x in (session_ids, verified, accepted))
        if not all(map(self.sessions.__contains__, session_ids)):  # first steps judged: rows for them
            for s in session_ids:
                if s not in self.sessions:
                    self.sessions[s] = self._new_row()
        rows = self._rows(session_ids)
        steps = np.array((verified, accepted))  # [2, steps]
        ends = np.minimum(steps, steps[1] + 1)  # [2, steps]: positions reached (the first rejected one too), accepted
        marks = self._positions < ends[:, :, None]  # [2, steps, max_k]: reached, accepted
        reached = marks[0]
        counts, reached_at = self._gather(rows)
        np.multiply(counts, self.decay * self._relaxed(reached_at), out=counts, where=reached)  # what old counts keep
        counts += marks
        reached_at[reached] = self.batch
        self._counts[:, rows] = counts
        self._reached_at[rows] = reached_at
        self.server.observe_counts(*np.add.reduce(marks, axis=1).tolist())  # steps per position

    def forget(self, session_id: str) -> None:
        row = self.sessions.pop(session_id, None)
        if row is not None:
            self._counts[:, row] = 0.0
            self._reached_at[row] = 0
            self._free_rows.append(row)

    def _gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the rows' counts [2, len(rows), max_k] and reached_at [len(rows), max_k] (take:
        a fraction of fancy indexing's cost on arrays this small)."""
        return self._counts.take(rows, axis=1), self._reached_at.take(rows, axis=0)

    def _rows(self, session_ids: Sequence[str]) -> np.ndarray:
        """[S] the sessions' rows of the count arrays (0: no counts yet)."""
        return np.fromiter(map(self.sessions.get, session_ids, itertools.repeat(0)), np.int64, len(session_ids))

    def _new_row(self) -> int:
        if not self._free_rows:
            held = self._reached_at.shape[0]
            grown = max(8, 2 * held)  # row 0 is never handed out
            self._free_rows = list(range(grown - 1, held - 1, -1))
            self._counts = np.concatenate((self._counts, np.zeros((2, grown - held, self.max_k))), axis=1)
            self._reached_at = np.concatenate((self._reached_at, np.zeros((grown - held, self.max_k), dtype=np.int64)))
        return self._free_rows.pop()
