"""The goodput policy in plain Python (verifier/server/goodput.py's trim_drafts and GoodputPolicy):
the test reference its vectorised policy is held to, bit for bit, at every batch size.

Lists, one session and one draft at a time, with the product's arithmetic in the product's order:
the running product of the rates, the sum of every draft as numpy's pairwise sum adds it
(add_reduce), a stable best-first order, the running sum of the tokens with the sessions' own
rows added after, the last prefix of the largest goodput. Two numbers come from numpy itself,
because their bits are numpy's and no plain formula has them on every host: relax ** age, which
the product looks up in a table numpy raised over an array of ages (an elementwise pow, not
Python's), and for a lone count (one session of max_k 1) raises as a one-element array."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from verifier.server.goodput import MAX_PROBE_CREDIT, MAX_TURNAROUND_S, TIE


def add_reduce(values: list[float]) -> float:
    """float(np.add.reduce(values)) bit for bit: numpy adds left to right from 0.0 under 8 values;
    from 8 on pairwise: 8 running sums over the whole blocks of 8, added as a tree, then the values
    left over; past 128 values, the two halves (the first a multiple of 8) each so."""
    n = len(values)
    if n > 128:
        half = n // 2 - n // 2 % 8
        return add_reduce(values[:half]) + add_reduce(values[half:])
    total, blocks = 0.0, (n - n % 8 if n >= 8 else 0)
    if blocks:
        sums = values[:8]
        for i in range(8, blocks, 8):
            sums = [a + b for a, b in zip(sums, values[i:i + 8])]
        total += ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]))
    for value in values[blocks:]:
        total += value
    return total


def best_first(values: list[float]) -> list[int]:
    """Indices of `values` by value, highest first; ties in index order (Python's sort is stable
    with reverse=True too)."""
    return sorted(range(len(values)), key=values.__getitem__, reverse=True)


def trim_drafts(requested: Sequence[int], rates: list[list[float]], cost: Callable[[int], float],
                fixed_rows: int = 0) -> list[int]:
    """Drafts to verify per session (valid requests: 0 <= requested[s] <= len(rates[s])): the prefix
    of the best-first drafts of largest tokens / model cost, the last of equal ones; none when no
    prefix beats verifying no draft, or when every draft together does not pay for one row. The
    model cost of R rows is R times the least cost per row of the steps from the base rows (the
    sessions' own plus `fixed_rows`) up to R, or its cost where that least is its own; a fixed row
    counts as a token."""
    sessions = len(requested)
    base_rows = sessions + fixed_rows
    drafts, owner = [], []  # [drafts sent], session by session: P_s(j), and s
    for s, k in enumerate(requested):
        alive = 1.0
        for rate in rates[s][:k]:
            alive *= rate
            drafts.append(alive)
            owner.append(s)
    verified = [0] * sessions
    if not drafts:
        return verified
    base_cost = cost(base_rows)
    base_rate = base_rows / base_cost
    least = base_cost / base_rows  # the least cost per row so far
    one_more = cost(base_rows + 1)
    if one_more / (base_rows + 1) > least:
        one_more = least * (base_rows + 1)
    if (base_rows + add_reduce(drafts)) / one_more < base_rate * (1.0 - TIE):
        return verified
    order = best_first(drafts)
    goodputs, tokens = [], 0.0  # per prefix of the order
    for n, i in enumerate(order, 1):
        tokens += drafts[i]
        rows = base_rows + n
        measured = cost(rows)
        if measured / rows <= least:
            least, model = measured / rows, measured
        else:
            model = least * rows
        goodputs.append((base_rows + tokens) / model)
    floor = max(base_rate, max(goodputs)) * (1.0 - TIE)
    best = max((n for n, goodput in enumerate(goodputs, 1) if goodput >= floor), default=0)
    for i in order[:best]:
        verified[owner[i]] += 1
    return verified


class ReferencePolicy:
    """GoodputPolicy's trim, probe credit and observations, its state in lists: per session drafted
    and accepted decayed counts and the batch that last reached each position, and the server-wide
    counts. Valid calls only (the product's refusals are tested on the product)."""

    def __init__(self, max_k: int, cost: Callable[[int], float], decay: float = 0.9, prior: float = 0.7,
                 relax: float = 0.98, probe_share: float = 0.02, base_weight: float = 0.1):
        self.max_k, self.cost, self.decay, self.prior = max_k, cost, decay, prior
        self.relax, self.probe_share, self.base_weight = relax, probe_share, base_weight
        self.sessions: dict[str, tuple[list[float], list[float], list[int]]] = {}  # drafted, accepted, reached at
        self.server_drafted, self.server_accepted = [0.0] * max_k, [0.0] * max_k
        self.turnaround_s = 0.0
        self.batch = 0
        self.probe_credit = 0.0
        self._powers: list[float] = []

    def power_table(self, ages: int) -> list[float]:
        """relax ** age for ages 0 .. ages - 1 as numpy raises them over an array."""
        return (self.relax ** np.arange(ages)).tolist()

    def _relaxed(self, reached_at: list[int], lone: bool) -> list[float]:
        """relax ** the age of counts last reached in batches `reached_at`: the batches since, the
        batch after not counted, and evidence renewed this batch not aged."""
        ages = [max(self.batch - 1 - at, 0) for at in reached_at]
        if lone:
            return (self.relax ** np.array([ages])).tolist()[0]
        if max(ages) >= len(self._powers):
            self._powers = self.power_table(max(2 * len(self._powers), max(ages) + 1, 64))
        return [self._powers[age] for age in ages]

    def _counts(self, session_id: str) -> tuple[list[float], list[float], list[int]]:
        return self.sessions.get(session_id) or ([0.0] * self.max_k, [0.0] * self.max_k, [0] * self.max_k)

    def server_rates(self) -> list[float]:
        """The server-wide rates: `prior` the base at position 1, the rate of the position before deeper."""
        rates = []
        for drafted, accepted in zip(self.server_drafted, self.server_accepted):
            rates.append((accepted + (rates[-1] if rates else self.prior)) / (drafted + 1.0))
        return rates

    def observe_turnaround(self, gap_s: float) -> None:
        gap_s = min(max(gap_s, 0.0), MAX_TURNAROUND_S)
        self.turnaround_s = self.decay * self.turnaround_s + (1 - self.decay) * gap_s

    def trim(self, session_ids: Sequence[str], requested: Sequence[int], fixed_rows: int = 0) -> list[int]:
        self.batch += 1
        if not any(requested):
            return list(requested)
        turnaround = self.turnaround_s

        def cost(rows: int) -> float:
            return self.cost(rows) + turnaround

        width = max(requested)
        server = self.server_rates()[:width]
        lone = len(session_ids) * self.max_k == 1
        aged = []  # per session: drafted and accepted [width], aged
        rates = []  # per session [width]: its evidence weighed with the base; where it never reached a
        # position, the rate of the last position it reached (`prior` before any)
        weight = self.base_weight
        for session_id in session_ids:
            drafted, accepted, reached_at = self._counts(session_id)
            relaxed = self._relaxed(reached_at, lone)
            aged.append(([c * r for c, r in zip(drafted[:width], relaxed)],
                         [c * r for c, r in zip(accepted[:width], relaxed)]))
            carried, own = self.prior, []
            for raw, d, a, b in zip(drafted, *aged[-1], server):
                if raw != 0.0:
                    carried = (a + weight * b) / (d + weight)
                own.append(carried)
            rates.append(own)
        verified = trim_drafts(requested, rates, cost, fixed_rows)
        size = self._probe_size(requested, verified, cost, fixed_rows)
        if not size:
            return verified
        value, owner = [], []  # the trimmed drafts' values at rates based on `prior`, and their sessions
        for s, ((drafted, accepted), kept) in enumerate(zip(aged, verified)):
            alive = 1.0
            for j in range(requested[s]):
                alive *= (accepted[j] + self.prior) / (drafted[j] + 1.0)
                if j >= kept:
                    value.append(alive)
                    owner.append(s)
        for i in best_first(value)[:size]:
            verified[owner[i]] += 1
        return verified

    def _probe_size(self, requested: Sequence[int], verified: list[int], cost: Callable[[int], float],
                    fixed_rows: int) -> int:
        """The credit grows by probe_share per batch that trimmed drafts; a probe takes the trimmed
        drafts in the rows that cost what one more row costs (at most a step's rows), charged the
        larger of its share of the step's cost and of its rows."""
        if sum(verified) == sum(requested):
            return 0
        self.probe_credit = min(self.probe_credit + self.probe_share, MAX_PROBE_CREDIT)
        step_rows = fixed_rows + len(requested) + sum(verified)
        if self.probe_credit < 1 / step_rows:
            return 0
        costs = [cost(rows) for rows in range(step_rows + 1, fixed_rows + len(requested) + sum(requested) + 1)]
        dearer = next((i for i, c in enumerate(costs) if c > costs[0]), len(costs))
        size = min(dearer, step_rows)
        charge = max(costs[size - 1] / cost(step_rows) - 1.0, size / step_rows)
        if charge > self.probe_credit:
            return 0
        self.probe_credit -= charge
        return size

    def observe(self, session_id: str, requested: int, verified: int, accepted: int) -> None:
        self.observe_batch([session_id], [requested], [verified], [accepted])

    def observe_batch(self, session_ids: Sequence[str], requested: Sequence[int], verified: Sequence[int],
                      accepted: Sequence[int]) -> None:
        """Each judged step (drafts verified) decays the old counts of the positions it reached by
        decay * relax ** their age and counts it there; the server-wide counts decay once per batch."""
        judged = [(s, k, a) for s, k, a in zip(session_ids, verified, accepted) if k > 0]
        lone = len(judged) * self.max_k == 1
        reached, taken = [0] * self.max_k, [0] * self.max_k  # steps per position
        for session_id, k, a in judged:
            drafted, took, reached_at = counts = self._counts(session_id)
            self.sessions[session_id] = counts
            relaxed = self._relaxed(reached_at, lone)
            end = min(k, a + 1)  # positions reached (the first rejected one too)
            for j in range(end):
                keep = self.decay * relaxed[j]
                drafted[j] = drafted[j] * keep + 1.0
                took[j] *= keep
                reached_at[j] = self.batch
                reached[j] += 1
            for j in range(a):
                took[j] += 1.0
                taken[j] += 1
        if not judged:
            return
        for j, steps in enumerate(reached):
            if steps:
                self.server_drafted[j] = self.server_drafted[j] * self.decay + float(steps)
                self.server_accepted[j] = self.server_accepted[j] * self.decay + float(taken[j])

    def forget(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)
