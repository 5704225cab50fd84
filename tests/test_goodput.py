"""The goodput policy as a pure function (verifier/server/goodput.py), held to its choices, never to
the bits of its sums: the trim's choice the best within its tie margin (exact arithmetic: brute
force on small batches, the greedy merge on batches of up to 64 sessions), the same however the
batch is given, and the regimes the service relies on (useless drafts trimmed away, good drafts
kept, rows that fill a graph bucket taken because they are free); the policy's rates by its rules,
evidence aged by relax, probes paid from their credit, over random runs of trims and observations."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_goodput_exploration import BUCKETS
from verifier.server import goodput as goodput_module
from verifier.server.goodput import (MAX_PROBE_CREDIT, MAX_TURNAROUND_S, TIE, DecayedRates, GoodputPolicy, StepCost,
                                     expected_tokens, trim_drafts)


def goodput(ks, rates, cost):
    return sum(expected_tokens(r, k) for k, r in zip(ks, rates)) / cost(sum(k + 1 for k in ks))


def linear_cost(per_row: float, fixed: float = 1.0):
    return lambda rows: fixed + per_row * rows


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5], 2) == 1.0 + 0.5 + 0.25
    assert expected_tokens([1.0] * 4, 4) == 5.0


@pytest.mark.parametrize("seed", range(40))
def test_trim_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    sessions = rng.randint(1, 4)
    requested = [rng.randint(0, 4) for _ in range(sessions)]
    rates = [[rng.choice([0.0, 0.1, 0.5, 0.8, 0.95, 1.0, rng.random()]) for _ in range(4)] for _ in range(sessions)]
    table = {r: 1.0 + 0.05 * r + rng.random() * 0.02 for r in (1, 2, 4, 8, 12, 16, 20)}
    cost = StepCost(dict(sorted(table.items())))
    chosen = trim_drafts(requested, rates, cost)
    assert all(0 <= k <= q for k, q in zip(chosen, requested))
    best = max(goodput(ks, rates, cost) for ks in itertools.product(*[range(q + 1) for q in requested]))
    assert goodput(chosen, rates, cost) == pytest.approx(best, rel=1e-12)


def test_useless_drafts_are_trimmed_when_rows_cost_time():
    assert trim_drafts([8] * 64, [[0.0] * 8] * 64, linear_cost(0.1)) == [0] * 64


def test_good_drafts_are_kept():
    assert trim_drafts([8] * 64, [[1.0] * 8] * 64, linear_cost(0.01)) == [8] * 64


def test_free_rows_in_a_bucket_are_taken():
    # a bucket of 16 rows costs the same as 4: useless drafts ride along up to the bucket's edge
    cost = StepCost({4: 1.0, 16: 1.0, 32: 3.0})
    chosen = trim_drafts([8, 8, 8, 8], [[0.0] * 8] * 4, cost)
    assert sum(chosen) + 4 == 16


def test_the_best_drafts_win_the_rows():
    # one row to spare: it goes to the session whose first draft is most likely accepted
    cost = StepCost({3: 1.0, 4: 1.0, 5: 10.0})
    assert trim_drafts([2, 2, 2], [[0.2, 0.2], [0.9, 0.9], [0.5, 0.5]], cost) == [0, 1, 0]


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="2 requests but 1 rate"):
        trim_drafts([1, 1], [[0.5]], linear_cost(0.1))
    with pytest.raises(ValueError, match="session 0 asks for 3 drafts with 2 rates"):
        trim_drafts([3], [[0.5, 0.5]], linear_cost(0.1))
    with pytest.raises(ValueError, match="times > 0"):
        StepCost({4: 0.0})
    with pytest.raises(ValueError, match="relax must be in"):
        GoodputPolicy(max_k=4, cost=linear_cost(0.1), relax=0.0)
    with pytest.raises(ValueError, match="probe_share must be in"):
        GoodputPolicy(max_k=4, cost=linear_cost(0.1), probe_share=1.0)


def test_step_cost_pads_up_and_extrapolates():
    cost = StepCost({1: 1.0, 8: 2.0, 16: 4.0})
    assert cost(1) == 1.0 and cost(2) == 2.0 and cost(8) == 2.0 and cost(9) == 4.0
    assert cost(32) == 8.0


def test_step_cost_never_falls():
    assert StepCost({4: 2.0, 8: 1.5, 16: 3.0}).times == [2.0, 2.0, 3.0]  # a measured dip is noise


def test_useless_drafts_stop_the_walk_at_once():
    calls = []

    def cost(rows):
        calls.append(rows)
        return 1.0 + 0.1 * rows

    assert trim_drafts([4] * 64, [[0.0] * 4] * 64, cost) == [0] * 64
    assert len(calls) <= 2, f"{len(calls)} cost lookups for drafts that are never accepted"


def test_decayed_rates_count_reached_positions():
    rates = DecayedRates(max_k=4, decay=1.0)
    rates.observe(verified=4, accepted=1)  # position 1 accepted, position 2 rejected, 3-4 never reached
    assert rates.drafted == [1.0, 1.0, 0.0, 0.0] and rates.accepted == [1.0, 0.0, 0.0, 0.0]
    rates.observe(verified=2, accepted=2)  # all verified drafts accepted: nothing rejected
    assert rates.drafted == [2.0, 2.0, 0.0, 0.0] and rates.accepted == [2.0, 1.0, 0.0, 0.0]
    # the prior at position 1; deeper, the position before carries forward as the base
    first = 2.5 / 3
    second = (1.0 + first) / 3
    assert rates.rates(None, prior=0.5, weight=1.0) == [first, second, second, second]


def test_server_wide_counts_take_a_batch_as_one_observation():
    rates = DecayedRates(max_k=3, decay=0.5)
    rates.observe([3, 3], [3, 0])  # one step accepts all three drafts, one rejects the first
    assert rates.drafted == [2.0, 1.0, 1.0] and rates.accepted == [1.0, 1.0, 1.0]
    rates.observe(1, 0)  # one step, decayed once: only the position it reached
    assert rates.drafted == [2.0, 1.0, 1.0] and rates.accepted == [0.5, 1.0, 1.0]


def test_server_wide_rates_of_never_accepted_drafts_fall_near_zero():
    # counts decayed per step remembered ten steps: prior / 11 = 6% under drafts never accepted,
    # enough to buy a bucket the table calls cheap; per batch, ten batches of 64 steps
    policy = GoodputPolicy(max_k=4, cost=linear_cost(0.1), prior=0.7)
    ids = [f"s{i}" for i in range(64)]
    for _ in range(10):
        policy.observe_batch(ids, [4] * 64, [1] * 64, [0] * 64)
    assert policy.server.rates(None, policy.prior)[0] < 0.002


def _rounds(policy, ids, requested, accept, n):
    """n batches: trim, then observe with accept(session, verified) drafts accepted; the drafts verified per batch."""
    verified = []
    for _ in range(n):
        ks = policy.trim(ids, [requested] * len(ids))
        policy.observe_batch(ids, [requested] * len(ids), ks, [accept(sid, k) for sid, k in zip(ids, ks)])
        verified.append(sum(ks))
    return verified


def test_policy_learns_to_stop_verifying_random_drafts():
    policy = GoodputPolicy(max_k=4, cost=linear_cost(0.1), decay=0.9, prior=0.7)
    ids = [f"s{i}" for i in range(8)]
    assert sum(policy.trim(ids, [4] * 8)) > 0  # the prior says drafts are worth trying
    verified = _rounds(policy, ids, 4, lambda sid, k: 0, 200)
    assert verified[:3] != [0, 0, 0]
    # later, the drafts verified are occasional probes: under 5% of the 32 sent per batch
    assert sum(verified[20:]) < 0.05 * 32 * 180, verified
    assert verified.count(0) > 150
    # new sessions are judged on their own evidence, never the server-wide rates (other drafters'):
    # before any, at `prior`, which buys each a first draft here; then trimmed on what they showed
    new = _rounds(policy, [f"new{i}" for i in range(8)], 4, lambda sid, k: 0, 20)
    assert new[0] == 8 and sum(new[1:]) <= 8, new


def test_policy_keeps_verifying_good_drafts():
    policy = GoodputPolicy(max_k=4, cost=linear_cost(0.1))
    _rounds(policy, ["a", "b"], 4, lambda sid, k: k, 30)
    assert policy.trim(["a", "b"], [4, 4]) == [4, 4]


def test_trimmed_sessions_are_tried_again_and_recover():
    """Evidence fades while drafts go unverified: drafts that turn good after a bad run are
    verified again (they would never be, were the counts frozen when trimming began)."""
    policy = GoodputPolicy(max_k=4, cost=linear_cost(0.02), decay=0.9, prior=0.7)
    ids = [f"s{i}" for i in range(8)]
    bad = _rounds(policy, ids, 4, lambda sid, k: 0, 100)
    assert sum(bad[20:]) < 0.05 * 32 * 80, bad  # random drafts: occasional probes only
    good = _rounds(policy, ids, 4, lambda sid, k: k, 60)
    assert good[:3] == [0, 0, 0] and good[-20:] == [32] * 20, good


def test_closed_sessions_are_forgotten():
    policy = GoodputPolicy(max_k=2, cost=linear_cost(0.1))
    policy.observe("a", 2, 2, 1)
    policy.forget("a")
    assert "a" not in policy.sessions
    policy.observe("b", 0, 0, 0)  # a plain step: nothing to learn
    assert "b" not in policy.sessions


def test_oracle_drafts_are_all_verified_where_a_prior_alone_would_stop_at_one():
    # the 2B model's shape of costs on the H200: at 64 sessions a second draft row per session is
    # worth it only if it is accepted more often than ~0.75; the policy must find that out by
    # verifying it, not hold the unverified position at its prior for ever
    table = {r: (0.003 + 0.0044 * r / 64 if r <= 64 else 0.0074 + 0.0176 * (r - 64) / 256)
             for r in (64, 80, 96, 128, 160, 192, 256, 320)}
    policy = GoodputPolicy(max_k=8, cost=StepCost(table), prior=0.7)
    ids = [f"s{i}" for i in range(64)]
    for _ in range(20):
        for sid, k in zip(ids, policy.trim(ids, [4] * 64)):
            policy.observe(sid, 4, k, k)  # oracle drafts: every verified draft accepted
    assert policy.trim(ids, [4] * 64) == [4] * 64


def test_the_turnaround_between_batches_buys_draft_rows():
    # engine rows that cost 40% more time are not worth drafts accepted 30% of the time, until the
    # round's fixed turnaround (clients, the round trip) is counted: then the step is a smaller
    # share of the round and the same drafts pay
    table = {64: 0.010, 128: 0.014}
    policy = GoodputPolicy(max_k=1, cost=StepCost(table))
    ids = [f"s{i}" for i in range(64)]
    for accepted in (0, 1, 0, 0, 1, 0, 0, 1, 0, 0):  # every session's drafts accepted ~30% of the time
        policy.observe_batch(ids, [1] * 64, [1] * 64, [accepted] * 64)
    assert policy.trim(ids, [1] * 64) == [0] * 64  # 64 / 10 ms > 64 * 1.3 / 14 ms
    for _ in range(100):
        policy.observe_turnaround(0.010)
    assert abs(policy.turnaround_s - 0.010) < 1e-4
    assert policy.trim(ids, [1] * 64) == [1] * 64  # 64 / 20 ms < 64 * 1.3 / 24 ms
    policy.observe_turnaround(5.0)  # an idle server: counted as MAX_TURNAROUND_S at most
    assert policy.turnaround_s <= 0.9 * 0.010 + 0.1 * MAX_TURNAROUND_S + 1e-12


# --- the trim by its choices: the best within its tie margin, in exact arithmetic ---
#
# The trim is a heuristic that chooses K; it is held to its choices, not to the bits of its sums.
# Goodputs here are exact (fractions.Fraction of the very floats the trim is given: its rates and
# its step costs), and the tolerance is the trim's own tie margin. The trim computes goodputs in
# float64, counts those within TIE (2 ** -40) of the largest as equal and takes the most drafts
# among them; its rounding is a few ulps (2 ** -52 each) over at most a few hundred additions, far
# inside TIE. So a choice is right when its exact goodput is within 2 * TIE of the exact best (TIE
# for the margin, as much again for rounding), and when no choice of more drafts comes within
# TIE / 2 of the best (one that close the trim counts as tied with its best, and takes).

CHOSEN_WITHIN = 1 - 2 * Fraction(TIE)  # the chosen goodput over the best: at least this
MORE_DRAFTS_BELOW = 1 - Fraction(TIE) / 2  # a choice of more drafts over the best: less than this


class ExactGoodput:
    """Expected tokens per second of a batch's choices, exactly, as the module docstring of
    verifier/server/goodput.py states them: (F + sum_s (1 + sum_{j <= k_s} P_s(j))) / model(R),
    P_s(j) the product of session s's first j rates, R = F + sum_s (k_s + 1) rows, model(R) =
    R * min_{B <= r <= R} cost(r) / r, B = F + sessions."""

    def __init__(self, requested, rates, cost, fixed_rows: int = 0):
        self.base = len(requested) + fixed_rows
        self.drafts = []  # [sessions][requested]: P_s(j), j = 1 .. requested[s]
        for k, session_rates in zip(requested, rates):
            alive, values = Fraction(1), []
            for rate in session_rates[:k]:
                alive *= Fraction(float(rate))
                values.append(alive)
            self.drafts.append(values)
        self.prefix = [list(itertools.accumulate(values, initial=Fraction(0))) for values in self.drafts]
        self.model, least = [], None  # [draft rows]: model(B + draft rows)
        for rows in range(self.base, self.base + sum(requested) + 1):
            per_row = Fraction(float(cost(rows))) / rows
            least = per_row if least is None else min(least, per_row)
            self.model.append(least * rows)

    def __call__(self, ks) -> Fraction:
        return (self.base + sum(p[k] for p, k in zip(self.prefix, ks))) / self.model[sum(ks)]

    def best_by_drafts(self) -> list[Fraction]:
        """[T] the best goodput of any choice of T drafts: that of the T largest P_s(j), which are
        prefixes of the sessions' drafts (P_s(j) never grows with j: the greedy merge)."""
        merged = sorted((p for values in self.drafts for p in values), reverse=True)
        return [t / m for t, m in zip(itertools.accumulate(merged, initial=Fraction(self.base)), self.model)]


class TableCost:
    """A measured table (StepCost: padded up to a bucket, linear past the last entry) plus a
    turnaround, asked by `span` as the policy's costs are; its repr names it in hypothesis's reports."""

    def __init__(self, table: dict[int, float], turnaround_s: float = 0.0):
        self.table, self.turnaround_s, self.steps = table, turnaround_s, StepCost(table)

    def __call__(self, rows: int) -> float:
        return self.steps(rows) + self.turnaround_s

    def span(self, first: int, stop: int) -> np.ndarray:
        return self.steps.span(first, stop) + self.turnaround_s

    def __repr__(self) -> str:
        return f"TableCost({self.table}, turnaround_s={self.turnaround_s})"


class LineCost:
    """fixed + per_row * rows plus a turnaround, without `span`: the trim asks it row count by row count."""

    def __init__(self, fixed: float, per_row: float, turnaround_s: float = 0.0):
        self.fixed, self.per_row, self.turnaround_s = fixed, per_row, turnaround_s

    def __call__(self, rows: int) -> float:
        return self.fixed + self.per_row * rows + self.turnaround_s

    def __repr__(self) -> str:
        return f"LineCost({self.fixed}, {self.per_row}, turnaround_s={self.turnaround_s})"


# levels (ties between drafts), always accepted (where the cost model matters most), near it, any
RATES = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]), st.just(1.0), st.floats(0.9, 1.0), st.floats(0.0, 1.0))
EXEMPT_ROWS = st.sampled_from([0, 0, 3, 40])  # rows of sessions exempt from trimming (verify_all_drafts)


@st.composite
def batches(draw, max_sessions: int = 4, max_k: int = 4):
    """(requested [sessions], rates [sessions][width]): drafts sent and acceptance rates by position."""
    sessions, width = draw(st.integers(1, max_sessions)), draw(st.integers(1, max_k))
    requested = draw(st.lists(st.integers(0, width), min_size=sessions, max_size=sessions))
    rates = draw(st.lists(st.lists(RATES, min_size=width, max_size=width), min_size=sessions, max_size=sessions))
    return requested, rates


@st.composite
def step_costs(draw, turnaround_s=st.sampled_from([0.0, 0.0, 1e-3, MAX_TURNAROUND_S])):
    """A step cost never smaller for more rows, as the trim requires: a table of graph buckets (a
    line fixed + per_row * rows sampled at the buckets: flat inside one, dearer per row at the
    first row of the next), a table of arbitrary buckets and rises, some of one cost (rows a bucket
    makes free), or a line. Every rise is at least 1e-6 s per bucket or 1e-7 s per row, a few
    millionths of any cost drawn at the least, millions of times TIE: a dearer row is dearer to
    the trim too."""
    kind = draw(st.sampled_from(["graphs", "table", "line"]))
    if kind == "graphs":
        rows = draw(st.sets(st.sampled_from(BUCKETS), min_size=1))
        fixed = draw(st.floats(1e-4, 1e-2))
        per_row = fixed * draw(st.floats(0.01, 3.0))  # comparable: the per-row cost rises at some buckets
        return TableCost({r: fixed + per_row * r for r in sorted(rows)}, draw(turnaround_s))
    if kind == "table":
        rows = sorted(draw(st.sets(st.integers(1, 64), min_size=1, max_size=10)))
        rises = draw(st.lists(st.just(0.0) | st.floats(1e-6, 2e-2), min_size=len(rows) - 1, max_size=len(rows) - 1))
        times = itertools.accumulate(rises, initial=draw(st.floats(1e-4, 1e-2)))
        return TableCost(dict(zip(rows, times)), draw(turnaround_s))
    fixed = draw(st.sampled_from([0.0, 4e-4]) | st.floats(1e-5, 1e-2))
    per_row = draw(st.sampled_from([0.0, 1e-5]) | st.floats(1e-7, 1e-2))
    return LineCost(fixed if fixed or per_row else 4e-4, per_row, draw(turnaround_s))


def _is_prefix_choice(chosen, requested) -> bool:
    """Drafts verified per session: ints, 0 <= k_s <= requested_s (a step verifies a prefix of its drafts)."""
    return len(chosen) == len(requested) and all(type(k) is int and 0 <= k <= q for k, q in zip(chosen, requested))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(batch=batches(), cost=step_costs(), fixed_rows=EXEMPT_ROWS)
def test_the_trim_is_the_best_choice_within_its_tie_margin_by_brute_force(batch, cost, fixed_rows):
    """Every per-session prefix choice of a small batch enumerated (at most 5 ** 4): the trim's
    choice has the best goodput within the tie margin, and no choice of more drafts comes as close
    (ties go to more drafts). The greedy merge finds the same best, exactly: the larger batches of
    the next test are checked by it."""
    requested, rates = batch
    chosen = trim_drafts(requested, rates, cost, fixed_rows)
    assert _is_prefix_choice(chosen, requested), chosen
    goodput = ExactGoodput(requested, rates, cost, fixed_rows)
    choices = {ks: goodput(ks) for ks in itertools.product(*(range(q + 1) for q in requested))}
    best = max(choices.values())
    assert max(goodput.best_by_drafts()) == best
    assert choices[tuple(chosen)] >= best * CHOSEN_WITHIN, (chosen, float(choices[tuple(chosen)] / best))
    closer = {ks: float(g / best) for ks, g in choices.items()
              if sum(ks) > sum(chosen) and g >= best * MORE_DRAFTS_BELOW}
    assert not closer, (chosen, closer)


@pytest.mark.parametrize("apart, chosen", [(2.0 ** -42, [2, 1]), (2.0 ** -38, [1, 0])])
def test_goodputs_within_the_tie_margin_are_equal_and_the_most_drafts_win(apart, chosen):
    """Drafts of values 0.9, 0.6, 0.45 (and 0.18, priced out): the first alone, or the three, on a
    table that makes the three's goodput `apart` (relatively) below the first's: a quarter of TIE is
    a tie, taken by the three drafts; four times TIE is not, and the first alone wins."""
    requested, rates = [2, 2], [[0.9, 0.5], [0.6, 0.3]]
    cost = StepCost({3: 1.0, 5: (2 + 0.9 + 0.6 + 0.45) / (2 + 0.9) * (1 + apart), 6: 100.0})
    goodput = ExactGoodput(requested, rates, cost)
    # as built, up to the rounding of the table's entry
    assert goodput([2, 1]) / goodput([1, 0]) == pytest.approx(1 / (1 + apart), rel=2.0 ** -46)
    assert max(goodput(ks) for ks in itertools.product(range(3), repeat=2)) == goodput([1, 0])
    assert trim_drafts(requested, rates, cost) == chosen


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rng=st.randoms(use_true_random=False), sessions=st.sampled_from([8, 37, 64]), cost=step_costs(),
       fixed_rows=EXEMPT_ROWS)
def test_the_trim_is_the_best_choice_within_its_tie_margin_at_every_batch_size(rng, sessions, cost, fixed_rows):
    """Batches of up to 64 sessions of up to 12 drafts, rates as the policy passes them (one array):
    the chosen goodput is the best over every number of drafts within the tie margin, no number of
    more drafts comes as close, and the drafts verified are those of highest value (the T largest
    P_s(j), up to the margin)."""
    width = rng.randint(1, 12)
    levels = [0.0, 0.5, 1.0, rng.random()]
    requested = [rng.randint(0, width) for _ in range(sessions)]
    rates = [[rng.choice(levels) if rng.random() < 0.5 else rng.random() for _ in range(width)]
             for _ in range(sessions)]
    chosen = trim_drafts(requested, np.array(rates), cost, fixed_rows)
    assert _is_prefix_choice(chosen, requested), chosen
    goodput = ExactGoodput(requested, rates, cost, fixed_rows)
    by_drafts = goodput.best_by_drafts()
    best = max(by_drafts)
    assert goodput(chosen) >= best * CHOSEN_WITHIN, (sum(chosen), float(goodput(chosen) / best))
    assert all(g < best * MORE_DRAFTS_BELOW for g in by_drafts[sum(chosen) + 1:])
    kept = [p for values, k in zip(goodput.drafts, chosen) for p in values[:k]]
    left = [p for values, k in zip(goodput.drafts, chosen) for p in values[k:]]
    if kept and left:
        assert min(kept) >= max(left) * (1 - Fraction(TIE)), (float(min(kept)), float(max(left)))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(batch=batches(max_sessions=8, max_k=8), cost=step_costs(), fixed_rows=st.sampled_from([0, 1, 3, 40]),
       order=st.randoms(use_true_random=False))
def test_one_choice_however_the_batch_is_given(batch, cost, fixed_rows, order):
    """The same batch, the same choice, by every form the trim takes it in: rates as lists or as
    one array (the policy's), the cost by `span` or row count by row count, exempt rows or as many
    sessions that sent no draft (an exempt row is priced as a row and counted as a token, as such a
    session is), and the sessions in any order; and the same again when asked again. Another form
    may give only a choice of equal goodput: as many drafts, goodputs within the tie margin of each
    other (session order breaks ties between equal drafts, and sums in another order may break a
    near-tie another way)."""
    requested, rates = batch
    chosen = trim_drafts(requested, rates, cost, fixed_rows)
    goodput = ExactGoodput(requested, rates, cost, fixed_rows)

    def as_good(other) -> bool:
        return other == chosen or (sum(other) == sum(chosen) and goodput(other) >= goodput(chosen) * CHOSEN_WITHIN
                                   and goodput(chosen) >= goodput(other) * CHOSEN_WITHIN)

    assert trim_drafts(requested, rates, cost, fixed_rows) == chosen
    assert as_good(trim_drafts(requested, np.array(rates), cost, fixed_rows))
    assert as_good(trim_drafts(requested, rates, lambda rows: cost(rows), fixed_rows))
    exempt_as_sessions = trim_drafts(requested + [0] * fixed_rows, rates + [[]] * fixed_rows, cost)
    assert exempt_as_sessions[len(requested):] == [0] * fixed_rows and as_good(exempt_as_sessions[:len(requested)])
    shuffled = order.sample(range(len(requested)), len(requested))
    permuted = trim_drafts([requested[s] for s in shuffled], [rates[s] for s in shuffled], cost, fixed_rows)
    unshuffled = [0] * len(requested)
    for s, k in zip(shuffled, permuted):
        unshuffled[s] = k
    assert as_good(unshuffled), (chosen, unshuffled)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(batch=batches(max_sessions=8, max_k=8), cost=step_costs(), fixed_rows=EXEMPT_ROWS)
def test_drafts_always_accepted_are_all_verified_on_any_cost(batch, cost, fixed_rows):
    """Rates of 1: a draft brings a token per row, as plain decoding's rows do; the model never
    charges it more per row than the step without it, so it always pays."""
    requested, _ = batch
    assert trim_drafts(requested, [[1.0] * 8] * len(requested), cost, fixed_rows) == requested


@settings(max_examples=100, deadline=None, derandomize=True)
@given(batch=batches(max_sessions=8, max_k=8), seconds=st.floats(1e-5, 1.0), extra=st.integers(0, 50),
       fixed_rows=EXEMPT_ROWS)
def test_rows_that_cost_nothing_take_every_draft(batch, seconds, extra, fixed_rows):
    """Every row count of the step in one graph bucket (or a constant cost): any draft adds tokens
    at no cost, and one never accepted ties, which goes to more drafts: nothing is trimmed."""
    requested, rates = batch
    top = len(requested) + fixed_rows + sum(requested)
    for cost in (StepCost({top + extra: seconds}), lambda rows: seconds):
        assert trim_drafts(requested, rates, cost, fixed_rows) == requested


@settings(max_examples=150, deadline=None, derandomize=True)
@given(batch=batches(max_sessions=8, max_k=8), cost=step_costs(), fixed_rows=EXEMPT_ROWS)
def test_drafts_never_accepted_take_only_the_rows_a_bucket_makes_free(batch, cost, fixed_rows):
    """Rates of 0: a draft brings no token, so a row that costs anything lowers goodput; the rows
    that cost what the step without drafts costs (the rest of its graph bucket) tie, and ties go to
    more drafts. So the drafts verified fill exactly the free rows, and none where the next row costs."""
    requested, _ = batch
    base = len(requested) + fixed_rows
    free = max(r for r in range(base, base + sum(requested) + 1) if cost(r) == cost(base)) - base
    assert sum(trim_drafts(requested, [[0.0] * 8] * len(requested), cost, fixed_rows)) == free


@settings(max_examples=100, deadline=None, derandomize=True)
@given(batch=batches(max_sessions=8, max_k=8), per_row=st.floats(1e-6, 1e-2), rising=st.sampled_from([0.0, 1e-4]),
       fixed_rows=EXEMPT_ROWS)
def test_where_no_row_is_cheaper_than_the_last_a_draft_must_bring_a_token(batch, per_row, rising, fixed_rows):
    """A cost per row that never falls (per_row * rows, or rising faster): the step without drafts
    is the cheapest per row, and a draft pays only where it is accepted at least as often as the
    step's tokens per row (1: every row of the step without drafts is a token). The drafts kept
    lose at most the tie margin's share of their rows' tokens: sum(1 - P) <= 2 * TIE * rows."""
    requested, rates = batch

    def cost(rows):
        return per_row * rows + rising * rows * rows

    chosen = trim_drafts(requested, rates, cost, fixed_rows)
    kept = [p for values, k in zip(ExactGoodput(requested, rates, cost, fixed_rows).drafts, chosen) for p in values[:k]]
    assert sum(1 - p for p in kept) <= 2 * Fraction(TIE) * (len(requested) + fixed_rows + len(kept)), chosen


# --- the policy by its rules: the rates it judges a session by, evidence aged, probes paid from a credit ---


class TrimSpy:
    """Stands in for verifier.server.goodput.trim_drafts, which GoodputPolicy.trim calls: records what
    the policy asked (the rates it judged each session by, the cost with the turnaround) and what
    trim_drafts chose, before any probe."""

    def __init__(self, monkeypatch):
        self.calls: list[SimpleNamespace] = []
        monkeypatch.setattr(goodput_module, "trim_drafts", self._trim)

    def _trim(self, requested, rates, cost, fixed_rows=0):
        chosen = trim_drafts(requested, rates, cost, fixed_rows)
        self.calls.append(SimpleNamespace(rates=np.array(rates, dtype=np.float64), cost=cost, chosen=list(chosen)))
        return chosen


@pytest.mark.parametrize("prior", [0.0, 0.3, 0.7, 1.0])
def test_a_new_session_is_judged_at_the_prior_not_at_other_drafters_rates(prior, monkeypatch):
    """Every position of a session with no evidence at `prior`, whatever the server-wide rates
    (other drafters' evidence) say."""
    spy = TrimSpy(monkeypatch)
    policy = GoodputPolicy(max_k=4, cost=linear_cost(0.1), prior=prior)
    old = [f"old{i}" for i in range(8)]
    for _ in range(10):
        policy.observe_batch(old, [4] * 8, [4] * 8, [0] * 8)  # other drafters: never accepted
    policy.trim(["new", "old0"], [4, 4])
    assert spy.calls[-1].rates[0].tolist() == [prior] * 4
    assert spy.calls[-1].rates[1][0] < 0.01  # a session with evidence: its own


def test_a_session_is_judged_by_its_own_steps_weighed_with_the_server_wide_rates(monkeypatch):
    """(accepted + w * base) / (drafted + w) per position, w = base_weight and base the server-wide
    rate there; a position the session never reached takes the rate of the last one it reached.
    Approximate to 1e-12: a few float operations on both sides, in other orders."""
    spy = TrimSpy(monkeypatch)
    policy = GoodputPolicy(max_k=3, cost=linear_cost(0.1))
    policy.observe("a", 3, 3, 1)  # position 1 accepted, 2 rejected, 3 not reached
    base = policy.server.rates(None, policy.prior)
    assert base[:2] == pytest.approx([(1 + 0.7) / 2, (0 + 0.85) / 2])  # the prior, then the position before
    policy.trim(["a"], [3])
    w = policy.base_weight
    first, second = (1 + w * base[0]) / (1 + w), (0 + w * base[1]) / (1 + w)
    assert spy.calls[-1].rates[0].tolist() == pytest.approx([first, second, second], rel=1e-12)
    # one step decides: a drafter whose first draft was rejected falls to w * base / (1 + w) < 0.091
    policy.observe("b", 3, 3, 0)
    policy.trim(["b"], [3])
    assert spy.calls[-1].rates[0][0] <= w / (1 + w)


@pytest.mark.parametrize("relax", [0.98, 0.5, 1e-3, 1.0])
@pytest.mark.parametrize("gap", [0, 1, 63, 64, 65, 130, 300])
@pytest.mark.parametrize("max_k, sessions", [(1, 1), (3, 2)])
def test_evidence_ages_by_relax_per_batch_toward_the_server_wide_rates(relax, gap, max_k, sessions, monkeypatch):
    """A session's counts are worth relax ** (the batches since they were last renewed, the next one
    not counted): after `gap` batches without a step its rates are (a q + w base) / (d q + w),
    q = relax ** gap, drifting toward the server-wide rates, never toward `prior`. A lone session of
    one draft, and ages past the policy's table of powers (64, then doubled), included. Approximate
    to 1e-9: relax ** gap by numpy's pow against Python's, a few ulps apart."""
    spy = TrimSpy(monkeypatch)
    policy = GoodputPolicy(max_k=max_k, cost=linear_cost(0.1), relax=relax)
    ids = [f"s{i}" for i in range(sessions)]
    policy.observe_batch(ids, [max_k] * sessions, [max_k] * sessions, [max_k] * sessions)  # all accepted
    policy.observe_batch(["x", "y", "z"], [max_k] * 3, [max_k] * 3, [0] * 3)  # server-wide rates far from theirs
    for _ in range(gap):
        policy.trim(["idle"], [0])  # batches of plain decoding: the clock moves, nothing is observed
    policy.trim(ids, [max_k] * sessions)
    base = policy.server.rates(None, policy.prior)
    q, w = relax ** gap, policy.base_weight
    want = [[(q + w * b) / (q + w) for b in base]] * sessions
    assert spy.calls[-1].rates.tolist() == [pytest.approx(row, rel=1e-9) for row in want]


def test_a_step_whose_drafts_were_all_trimmed_changes_nothing(monkeypatch):
    """It judged nothing: no session is added, no count moves, and the next trims are the same."""
    spy = TrimSpy(monkeypatch)
    policies = [GoodputPolicy(max_k=3, cost=linear_cost(0.01)) for _ in range(2)]
    for policy in policies:
        policy.observe_batch(["a", "b"], [3, 3], [3, 1], [2, 0])
    policies[0].observe_batch(["a", "new"], [3, 3], [0, 0], [0, 0])
    policies[0].observe("b", 3, 0, 0)
    assert sorted(policies[0].sessions) == sorted(policies[1].sessions) == ["a", "b"]
    assert policies[0].server.drafted == policies[1].server.drafted
    assert policies[0].server.accepted == policies[1].server.accepted
    for _ in range(3):
        assert policies[0].trim(["a", "b", "new"], [3, 3, 3]) == policies[1].trim(["a", "b", "new"], [3, 3, 3])
        assert np.array_equal(spy.calls[-2].rates, spy.calls[-1].rates)


def _proportional(rows: int) -> float:
    """Every row costs the same: only drafts always accepted pay (and tie)."""
    return float(rows)


def test_a_probe_goes_to_the_drafter_whose_last_draft_was_accepted():
    """Both drafters are trimmed (on a proportional cost not even 0.96 pays); the batch's credit
    (0.6 of a step) buys one probe row, charged its half of the two rows' step. The probe values
    drafts at counts weighed toward `prior`: the accepted drafter's 0.85 against 0.35."""
    policy = GoodputPolicy(max_k=1, cost=_proportional, probe_share=0.6)
    policy.observe_batch(["good", "bad"], [1, 1], [1, 1], [1, 0])
    assert policy.trim(["bad", "good"], [1, 1]) == [0, 1]


def test_a_probe_goes_to_stale_evidence_first():
    """Two drafters rejected once, one 100 batches ago: its counts aged by relax ** 100 toward
    `prior`, it is probed first."""
    policy = GoodputPolicy(max_k=1, cost=_proportional, probe_share=0.6)
    policy.observe("stale", 1, 1, 0)
    for _ in range(100):
        policy.trim(["idle"], [0])
    policy.observe("fresh", 1, 1, 0)
    assert policy.trim(["fresh", "stale"], [1, 1]) == [0, 1]


POLICY_OPTIONS = st.fixed_dictionaries(dict(
    decay=st.sampled_from([0.9, 0.5, 1.0]), prior=st.sampled_from([0.7, 0.0, 1.0, 0.35]),
    relax=st.sampled_from([0.98, 0.5, 1e-3, 1.0]), probe_share=st.sampled_from([0.02, 0.3, 0.0])))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rng=st.randoms(use_true_random=False), max_k=st.sampled_from([1, 2, 4, 8]), options=POLICY_OPTIONS,
       cost=step_costs(turnaround_s=st.just(0.0)) | st.sampled_from([  # and costs that trim and probe often
           TableCost({r: 0.68 + 0.005 * r for r in BUCKETS}),  # H200-shaped, as test_goodput_exploration's
           LineCost(0.0, 1e-3), LineCost(1e-3, 1e-3)]))
def test_the_policy_keeps_its_rules_over_any_run(rng, max_k, options, cost):
    """Random runs of trims (with exempt rows at times) and observations, turnarounds, new and
    forgotten sessions, sessions that step rarely. At every trim:
    - the choice a prefix of each session's drafts, at least trim_drafts's choice at the rates the
      policy judged the session by (a probe only adds trimmed drafts), and exactly that with no
      probe credit (probe_share 0) or when nothing was trimmed;
    - those rates in [0, 1]; a session's positions past the deepest its steps reached take the rate
      of that one, `prior` where they reached none (a new or a forgotten session);
    - a probe takes the trimmed drafts in the rows that cost what one more row costs, all of them
      up to the step's rows; probes cost at most probe_share of a step per batch that trimmed, by
      the cost (turnaround included) and by their share of the rows; the credit in [0, 1 step];
    the turnaround in [0, MAX_TURNAROUND_S] after every call; and a second policy given the same
    calls gives the same answers (deterministic). 1e-9 of slack on the credit: sums of floats."""
    policy = GoodputPolicy(max_k, cost, **options)
    prior, share = options["prior"], options["probe_share"]
    pool = [f"s{i}" for i in range(rng.randint(1, 12))]
    accept = {s: rng.choice([0.0, 1.0, 0.5, rng.random()]) for s in pool}  # each drafter's acceptance
    active = {s: rng.choice([1.0, 0.3, 0.02]) for s in pool}  # how often it steps
    deepest: dict[str, int] = {}  # the deepest position a session's observed steps reached
    calls, answers = [], []  # every call, replayed on a second policy; the trims' answers
    trimming, rows_paid, cost_paid = 0, 0.0, 0.0  # batches that trimmed drafts; what probes cost
    with pytest.MonkeyPatch.context() as patch:
        spy = TrimSpy(patch)
        for _ in range(rng.randint(20, 200)):
            roll = rng.random()
            if roll < 0.1:
                calls.append(("observe_turnaround", (rng.choice([-1.0, 0.0, 1e-3, rng.random() * 0.03, 5.0]),)))
                policy.observe_turnaround(*calls[-1][1])
                assert 0.0 <= policy.turnaround_s <= MAX_TURNAROUND_S
                continue
            if roll < 0.15:
                gone = rng.choice(pool)
                deepest.pop(gone, None)
                calls.append(("forget", (gone,)))
                policy.forget(gone)
                continue
            if roll < 0.2:
                pool.append(f"s{len(accept)}")
                accept[pool[-1]], active[pool[-1]] = rng.choice([0.0, 1.0, rng.random()]), rng.choice([1.0, 0.3])
            ids = [s for s in pool if rng.random() < active[s]] or [rng.choice(pool)]
            ids = rng.sample(ids, min(len(ids), rng.randint(1, 8)))
            requested = [rng.randint(0, max_k) for _ in ids]
            if rng.random() < 0.85:
                fixed_rows, asked = rng.choice([0, 0, 0, 5]), len(spy.calls)
                calls.append(("trim", (ids, requested, fixed_rows)))
                verified = policy.trim(ids, requested, fixed_rows)
                answers.append(verified)
                assert _is_prefix_choice(verified, requested), (requested, verified)
                if not any(requested):  # plain decoding: nothing to trim
                    assert verified == requested and len(spy.calls) == asked
                else:
                    judged = spy.calls[-1]
                    for s, rates in zip(ids, judged.rates):
                        assert ((rates >= 0.0) & (rates <= 1.0)).all(), (s, rates)
                        reached = deepest.get(s, 0)
                        if reached < len(rates):  # positions never reached: carried, or `prior`
                            carried = rates[reached - 1] if reached else prior
                            assert (rates[reached:] == carried).all(), (s, reached, rates)
                    kept = judged.chosen
                    assert all(k <= v for k, v in zip(kept, verified)), (kept, verified)
                    if share == 0 or sum(kept) == sum(requested):
                        assert verified == kept
                    trimming += sum(kept) < sum(requested)
                    probe = sum(verified) - sum(kept)
                    if probe:
                        step, price = fixed_rows + len(ids) + sum(kept), judged.cost
                        room = min(step, sum(requested) - sum(kept))
                        assert probe <= room and price(step + probe) == price(step + 1), (probe, room)
                        assert probe == room or price(step + probe + 1) > price(step + 1), (probe, room)
                        rows_paid += probe / step
                        cost_paid += price(step + probe) / price(step) - 1.0
                    assert rows_paid <= share * trimming + 1e-9 and cost_paid <= share * trimming + 1e-9
                    assert 0.0 <= policy.probe_credit <= MAX_PROBE_CREDIT
            else:  # steps observed as the scheduler reports them, with no trim before
                verified = [rng.randint(0, k) for k in requested]
            accepted = []
            for s, k in zip(ids, verified):
                streak = 0
                while streak < k and rng.random() < accept[s]:
                    streak += 1
                accepted.append(streak)
                if k:
                    deepest[s] = max(deepest.get(s, 0), min(k, streak + 1))  # the first rejected one too
            if len(ids) == 1 and rng.random() < 0.3:
                calls.append(("observe", (ids[0], requested[0], verified[0], accepted[0])))
            else:
                calls.append(("observe_batch", (ids, requested, verified, accepted)))
            getattr(policy, calls[-1][0])(*calls[-1][1])
    twin = GoodputPolicy(max_k, cost, **options)
    replies = [getattr(twin, name)(*args) for name, args in calls]
    assert [reply for (name, _), reply in zip(calls, replies) if name == "trim"] == answers
    assert twin.probe_credit == policy.probe_credit and twin.turnaround_s == policy.turnaround_s


def test_the_policy_refuses_what_trim_drafts_refuses():
    policy = GoodputPolicy(max_k=2, cost=linear_cost(0.1))
    with pytest.raises(ValueError, match="session 0 asks for 3 drafts with 2 rates"):
        policy.trim(["a"], [3])
    with pytest.raises(ValueError, match="session 1 asks for -1 drafts with 2 rates"):
        policy.trim(["a", "b"], [2, -1])


def test_policy_bench_writes_one_figure_per_shape(tmp_path):
    """bench.goodput_policy: per shape, the per-call figures of trim and observe_batch."""
    import json

    from bench import goodput_policy

    assert goodput_policy.main(["--out", str(tmp_path), "--calls", "3"]) == 0
    (path,) = tmp_path.glob("goodput_policy_*.json")
    report = json.loads(path.read_text())
    assert report["device"] and report["date"]
    for shape in ("1_sessions_k4", "64_sessions_k4"):
        figures = report["microseconds_per_call"][shape]
        assert figures["trim_us"] > 0 and figures["observe_us"] > 0
