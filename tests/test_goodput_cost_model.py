"""The goodput trim's cost model (verifier/server/goodput.py trim_drafts, per_row_capped) on step-cost
tables recorded on the H200, as a pure function: optimal against brute force in exact arithmetic,
drafts that are always accepted verified on any table, useless ones trimmed to plain decoding; and
the policy on the serve bench's order of runs (random drafts, then oracle drafts on the same server).

The tables, in seconds by verify rows:
- DENSE_2B: Qwen3.5-2B, bench/results/gpu_2026-12-03.json, as recorded: decode_ms (1 row),
  verify_ms by K (K + 1 rows of one sequence), batch 8 and 64 decode (8, 64 rows) and verify8
  (72, 576 rows). Flat to a few dozen rows, then linear. The figures' sequences differ (72 rows of
  8 sequences cost less than 64 of 64): StepCost's running max makes the table never fall.
- MOE_MEASURED: Qwen3.6-35B-A3B FP8 at full size, bench/results/fp8_real_size_2026-12-04_*.json:
  decode and K = 8 at batch 1 and 64 (1, 9, 64, 576 rows), that bench's four graph buckets.
- MOE_EXPERTS: the same model at every graph bucket of the default list, from a fit of those four
  figures to fixed + per distinct expert + per row (6.94 ms + 0.0783 ms x E(R) + 0.0754 ms x R, each
  figure within 0.05 ms), E(R) = 256 (1 - (1 - 8/256)^R) the distinct experts R rows bring in when
  each picks 8 of 256 at random; the bench counted 8, 63.1, 218.3 and 256 (E: 8, 63.5, 222.4, 256).
  Steep: a row's cost is mostly the experts it brings in while few are in.
"""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import numpy as np
import pytest

from test_goodput_exploration import BUCKETS
from verifier.server.goodput import GoodputPolicy, StepCost, per_row_capped, trim_drafts

DENSE_2B = StepCost({rows: ms / 1000 for rows, ms in {
    1: 1.712, 2: 1.759, 3: 1.811, 5: 1.804, 9: 1.953, 17: 2.348, 8: 2.036, 72: 2.912, 64: 4.025, 576: 9.775}.items()})
MOE_MEASURED = StepCost({1: 7.676e-3, 9: 12.563e-3, 64: 29.198e-3, 576: 70.409e-3})
MOE_EXPERTS = StepCost({rows: (6.94 + 0.0783 * 256 * (1 - (1 - 8 / 256) ** rows) + 0.0754 * rows) / 1000
                        for rows in BUCKETS})
TABLES = {"dense_2b": DENSE_2B, "moe_measured": MOE_MEASURED, "moe_experts": MOE_EXPERTS}

RATES = [0.0, 0.125, 0.25, 0.5, 0.75, 0.875, 1.0]  # dyadic: the products and sums of drafts are exact


def _with(cost, turnaround_s: float):
    return lambda rows: cost(rows) + turnaround_s


def exact_goodput(ks, rates, cost, fixed_rows: int) -> Fraction:
    """Expected tokens per second of verifying ks[s] drafts of session s, exactly: tokens over the
    model cost R * min_{base <= r <= R} cost(r) / r (a fixed row counted as a token)."""
    tokens = Fraction(fixed_rows)
    for k, r in zip(ks, rates):
        alive = Fraction(1)
        tokens += 1
        for rate in r[:k]:
            alive *= Fraction(rate)
            tokens += alive
    base = len(ks) + fixed_rows
    rows = base + sum(ks)
    per_row = min(Fraction(cost(r)) / r for r in range(base, rows + 1))
    return tokens / (per_row * rows)


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("seed", range(25))
def test_trim_is_an_optimal_choice_by_brute_force(table, seed):
    """Every per-session prefix choice enumerated: trim_drafts's choice has the largest goodput
    exactly, and of the choices that tie for it, the most drafts."""
    rng = random.Random(seed)
    sessions = rng.randint(1, 4)
    requested = [rng.randint(0, 4) for _ in range(sessions)]
    rates = [[rng.choice(RATES) for _ in range(4)] for _ in range(sessions)]
    fixed_rows = rng.choice([0, 0, 5, 60])  # rows of sessions exempt from trimming
    cost = _with(TABLES[table], rng.choice([0.0, 0.0, 0.004]))
    chosen = trim_drafts(requested, rates, cost, fixed_rows)
    choices = {ks: exact_goodput(ks, rates, cost, fixed_rows) for ks in itertools.product(*[range(q + 1) for q in requested])}
    best = max(choices.values())
    assert choices[tuple(chosen)] == best, (chosen, float(choices[tuple(chosen)]), float(best))
    assert sum(chosen) == max(sum(ks) for ks, g in choices.items() if g == best)


def test_the_model_is_the_measured_cost_where_per_row_cost_falls():
    costs = np.array([1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0, 3.0, 9.0])  # rows 2 .. 10: buckets of 4, 8, 10
    model = per_row_capped(costs, 2)
    # rows 5 to 10 charged the 4-row step's cost per row (0.25), not the next buckets' whole jumps
    assert model.tolist() == [1.0, 1.0, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5]
    assert (np.diff(model) >= 0).all() and (np.diff(model / np.arange(2, 11)) <= 0).all()


@pytest.mark.parametrize("seed", range(200))
def test_drafts_always_accepted_are_all_verified_on_any_table(seed):
    """Rates of 1.0: every draft is verified whatever the (never falling) table, the turnaround and
    the exempt rows: a row that brings a token for sure is never charged more than a row of the
    step without it."""
    rng = random.Random(seed)
    if seed < 30:
        cost = list(TABLES.values())[seed % 3]
    else:  # random jumps, some far steeper than any row count grows
        rows = sorted(rng.sample(range(1, 700), rng.randint(1, 8)))
        times = list(itertools.accumulate(rng.choice([0.0, 1e-4, 1e-2, 1.0, 50.0]) * rng.random() + 1e-6 for _ in rows))
        cost = StepCost(dict(zip(rows, times)))
    cost = _with(cost, rng.choice([0.0, 1e-3, 0.02]))
    sessions = rng.choice([1, 2, 3, 8, 37, 64])
    requested = [rng.randint(0, 8) for _ in range(sessions)]
    fixed_rows = rng.choice([0, 0, 9, 100])
    assert trim_drafts(requested, [[1.0] * 8] * sessions, cost, fixed_rows) == requested


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("sessions", [1, 2, 3, 8, 37, 64])
def test_useless_drafts_are_trimmed_to_plain_decoding(table, sessions):
    """Rates near 0 on the recorded tables: no draft, except rows a graph bucket makes free (the
    measured MoE table's buckets of 9 and 64 rows; ties go to more drafts)."""
    cost = TABLES[table]
    for rate in (0.0, 1e-3, 0.01):
        chosen = trim_drafts([4] * sessions, [[rate] * 4] * sessions, cost)
        free = max(r for r in range(sessions, 5 * sessions + 1) if cost(r) == cost(sessions)) - sessions
        assert sum(chosen) <= free, (rate, chosen)
        assert sum(chosen) == (free if rate == 0.0 else sum(chosen))


@pytest.mark.parametrize("table", TABLES)
def test_exempt_rows_price_the_step_at_its_real_size(table):
    """A session's drafts judged at the step's real rows: with 60 exempt rows in it, the trim is the
    one for a batch of those rows plus the trimmable ones, priced by the same table."""
    cost = TABLES[table]
    rates = [[0.5] * 4] * 4
    with_fixed = trim_drafts([4] * 4, rates, cost, fixed_rows=60)
    brute = max(itertools.product(range(5), repeat=4), key=lambda ks: (exact_goodput(ks, rates, cost, 60), sum(ks)))
    assert with_fixed == list(brute)
    with pytest.raises(ValueError, match="fixed_rows"):
        trim_drafts([1], [[0.5]], cost, fixed_rows=-1)


def _serve(policy, ids, k: int, accept, steps: int, cost) -> tuple[list[int], float]:
    """`steps` batches of every session; -> drafts verified per batch, and the table's seconds."""
    verified, seconds = [], 0.0
    for _ in range(steps):
        ks = policy.trim(ids, [k] * len(ids))
        policy.observe_batch(ids, [k] * len(ids), ks, [accept(v) for v in ks])
        verified.append(sum(ks))
        seconds += cost(len(ids) + sum(ks))
    return verified, seconds


@pytest.mark.parametrize("table", TABLES)
def test_oracle_sessions_after_random_ones_are_verified_in_full(table):
    """The serve bench's order on one server: 64 sessions of random drafts for 45 steps, closed,
    then 64 new sessions of oracle drafts. The random sessions cost at most 5% more than plain
    decoding; the oracle sessions, whose server-wide rates say drafts are useless, are verified in
    full from their second step: their own evidence decides, not other drafters' (the first, with
    none, verifies what pays at `prior`: at least every session's first draft on these tables)."""
    cost = TABLES[table]
    policy = GoodputPolicy(max_k=4, cost=cost)
    for _ in range(20):
        policy.observe_turnaround(0.003)
    random_ids = [f"r{i}" for i in range(64)]
    _, seconds = _serve(policy, random_ids, 4, lambda k: 0, 45, cost)
    assert seconds <= 1.05 * 45 * cost(64), seconds / (45 * cost(64))
    for sid in random_ids:
        policy.forget(sid)
    assert policy.server.rates(None, policy.prior)[0] < 0.05  # what sessions opened after it would have borrowed
    verified, _ = _serve(policy, [f"o{i}" for i in range(64)], 4, lambda k: k, 45, cost)
    assert verified[0] >= 64 and verified[1:] == [256] * 44, verified
