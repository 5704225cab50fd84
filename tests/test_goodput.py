"""The goodput policy as a pure function (verifier/server/goodput.py): optimal against brute force,
and the three regimes the service relies on (useless drafts trimmed away, good drafts kept, rows
that fill a graph bucket taken because they are free); the policy equal to a plain-Python reference
(tests/goodput_reference.py) bit for bit, at every batch size."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

import goodput_reference
from goodput_reference import ReferencePolicy, add_reduce
from verifier.server import goodput as goodput_module
from verifier.server.goodput import MAX_TURNAROUND_S, DecayedRates, GoodputPolicy, StepCost, expected_tokens, trim_drafts


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


# --- the policy against the plain-Python reference (tests/goodput_reference.py), bit for bit ---

BATCH_SIZES = [1, 2, 3, 8, 64]


def test_add_reduce_has_the_bits_of_numpys_sum():
    rng = np.random.default_rng(0)
    for n in list(range(300)) + [1000, 1025]:
        values = (rng.random(n) * 10.0 ** rng.integers(-8, 8, n)).tolist()  # magnitudes where the order shows
        assert add_reduce(values) == float(np.add.reduce(np.array(values, dtype=np.float64))), n


def _random_cost(rng):
    if rng.random() < 0.2:
        per_row = rng.choice([0.0, 1e-5, rng.random() * 1e-3])
        return lambda rows: 4e-4 + per_row * rows  # a cost without span
    buckets = sorted(rng.sample(range(1, 40), rng.randint(1, 6)))
    flat = rng.random() < 0.5  # two buckets of one cost: equal goodputs, the last prefix's tie-break
    return StepCost({r: 4e-4 + (0.0 if flat and i < 2 else rng.random() * 2e-4) + 1e-5 * r
                     for i, r in enumerate(buckets)})


def _near_tie(requested, rates, rng):
    """A step cost under which two prefixes of the best-first drafts have goodputs within an ulp or
    two of each other: which one wins shows the last bit of the tokens' sums."""
    drafts = sorted((p for k, r in zip(requested, rates) for p in itertools.accumulate(r[:k], lambda a, b: a * b)),
                    reverse=True)
    if len(drafts) < 2:
        return _random_cost(rng)
    base = len(requested)
    n, m = sorted(rng.sample(range(1, len(drafts) + 1), 2))
    tokens = base + np.add.accumulate(np.array(drafts))  # [prefix] as trim_drafts sums them
    dearer = 1e-3 * float(tokens[m - 1] / tokens[n - 1])
    return StepCost({base + n: 1e-3, base + m: dearer, base + len(drafts) + 1: 1.0})


@pytest.mark.parametrize("sessions", BATCH_SIZES)
@pytest.mark.parametrize("seed", range(8))
def test_trim_drafts_is_the_reference(sessions, seed):
    rng = random.Random(seed)
    for _ in range(300 if sessions < 64 else 60):
        width = rng.randint(1, 12)
        requested = [rng.randint(0, width) for _ in range(sessions)]
        if not any(requested):
            continue
        levels = [0.0, 1.0, 0.5, rng.random()]  # few levels: ties between drafts and between prefixes
        rates = [[rng.choice(levels) if rng.random() < 0.5 else rng.random() for _ in range(width)]
                 for _ in range(sessions)]
        cost = _near_tie(requested, rates, rng) if rng.random() < 0.5 else _random_cost(rng)
        want = goodput_reference.trim_drafts(requested, rates, cost)
        assert trim_drafts(requested, np.array(rates), cost) == want
        assert trim_drafts(requested, rates, cost) == want


def _same_state(policy: GoodputPolicy, reference: ReferencePolicy) -> None:
    assert policy.batch == reference.batch and policy.probe_credit == reference.probe_credit
    assert policy.turnaround_s == reference.turnaround_s
    assert policy.server.drafted == reference.server_drafted and policy.server.accepted == reference.server_accepted
    assert sorted(policy.sessions) == sorted(reference.sessions)
    rows = [policy.sessions[s] for s in reference.sessions]
    drafted, accepted, reached_at = (np.array([counts[i] for counts in reference.sessions.values()]).reshape(len(rows), reference.max_k)
                                     for i in range(3))
    assert np.array_equal(policy._counts[0, rows], drafted) and np.array_equal(policy._counts[1, rows], accepted)
    assert np.array_equal(policy._reached_at[rows], reached_at)
    empty = [0, *policy._free_rows]  # the row of sessions with no counts, and forgotten sessions' rows: cleared
    assert not policy._counts[:, empty].any() and not policy._reached_at[empty].any()


@pytest.mark.parametrize("sessions", BATCH_SIZES)
@pytest.mark.parametrize("seed", range(8))
def test_policy_is_the_reference_bit_for_bit(sessions, seed, monkeypatch):
    """The policy and the plain-Python reference through the same random turnarounds, trims,
    observations and forgotten sessions, in batches of up to `sessions` sessions: the same returns,
    the same numbers trimmed and sorted, the same state after every call."""
    rng = random.Random(seed)
    if seed % 2:  # relax ** age nudged off numpy's pow in both tables: then the lone element (raised by
        # numpy's scalar path, see GoodputPolicy._relaxed) and the table differ on any host
        tabulate, table = GoodputPolicy._tabulate_relax, ReferencePolicy.power_table

        def nudged(policy, ages):
            tabulate(policy, ages)
            policy._relax_powers = policy._relax_powers * (1 - 2.0 ** -30)

        monkeypatch.setattr(GoodputPolicy, "_tabulate_relax", nudged)
        monkeypatch.setattr(ReferencePolicy, "power_table",
                            lambda reference, ages: (np.array(table(reference, ages)) * (1 - 2.0 ** -30)).tolist())

    # the numbers each trim is given (rates) and each sorts (the drafts' values, the probe's): seen
    # bit for bit, not only through the choices they lead to
    seen = {"policy": [], "reference": []}

    def recording(module, name, side, numbers):
        function = getattr(module, name)

        def record(*args):
            seen[side].append(np.array(args[numbers], dtype=np.float64))
            return function(*args)
        monkeypatch.setattr(module, name, record)

    recording(goodput_module, "trim_drafts", "policy", 1)
    recording(goodput_module, "_best_first", "policy", 0)
    recording(goodput_reference, "trim_drafts", "reference", 1)
    recording(goodput_reference, "best_first", "reference", 0)

    def on_both(call):
        got, want = call(policy), call(reference)
        assert got == want
        _same_state(policy, reference)
        assert len(seen["policy"]) == len(seen["reference"])
        assert all(map(np.array_equal, seen["policy"], seen["reference"]))
        for numbers in seen.values():
            numbers.clear()
        return got

    for case in range(12):
        max_k = rng.choice([1, 1, 2, 3, 4, 8, 9, 12])
        options = dict(decay=rng.choice([0.9, 0.5, 1.0]), prior=rng.choice([0.7, 0.0, 1.0, rng.random()]),
                       relax=rng.choice([0.98, 0.9, 0.1, 1e-3, 1.0]), probe_share=rng.choice([0.02, 0.3, 0.0]))
        cost = _random_cost(rng)
        policy, reference = GoodputPolicy(max_k, cost, **options), ReferencePolicy(max_k, cost, **options)
        pool = [f"s{i}" for i in range(3 * sessions + 4)]  # enough active sessions for full batches
        accept = {s: rng.choice([0.0, 1.0, 0.5, rng.random()]) for s in pool}  # each drafter's acceptance
        # how often each session steps: some rarely, so that the age of its counts passes the power
        # table's end (64 ages at first; 130 for relax 1e-3, whose powers underflow there)
        active = {s: rng.choice([1.0, 0.3, 0.005]) for s in pool}
        for _ in range(600 if case == 0 else rng.randint(1, 150)):
            roll = rng.random()
            if roll < 0.1:
                gap = rng.choice([0.0, 1e-3, rng.random() * 0.03])
                on_both(lambda p: p.observe_turnaround(gap))
                continue
            if roll < 0.15:
                gone = rng.choice(pool)
                on_both(lambda p: p.forget(gone))
                continue
            if roll < 0.2:
                pool.append(f"s{len(accept)}")
                accept[pool[-1]], active[pool[-1]] = rng.choice([0.0, 1.0, rng.random()]), rng.choice([1.0, 0.3])
            size = rng.choice([1, sessions, sessions, sessions]) if sessions > 1 else 1
            ids = [s for s in pool if rng.random() < active[s]]
            ids = rng.sample(ids, min(size, len(ids))) or [rng.choice(pool)]
            requested = [rng.randint(0, max_k) for _ in ids]
            if rng.random() < 0.85:
                verified = on_both(lambda p: p.trim(ids, requested))
            else:  # observed without a trim (observe's own calls; a session observed twice in a batch)
                verified = [rng.randint(0, k) for k in requested]
            accepted = []
            for s, k in zip(ids, verified):
                streak = 0
                while streak < k and rng.random() < accept[s]:
                    streak += 1
                accepted.append(streak)
            if len(ids) == 1 and rng.random() < 0.3:
                on_both(lambda p: p.observe(ids[0], requested[0], verified[0], accepted[0]))
            else:
                on_both(lambda p: p.observe_batch(ids, requested, verified, accepted))


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
