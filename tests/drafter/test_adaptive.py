"""Adaptive K: the rule's arithmetic on synthetic acceptance sequences with answers worked by hand,
and the loop asking it for each step's K and telling it each step's acceptance."""

import grpc
import pytest

from drafter.adaptive import AdaptiveK, best_k, expected_tokens
from drafter.loop import DraftLoop
from drafter.messages import ModelInfo, Session, StepOutcome


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(0.5, 2) == 1.75  # 1 + 1/2 + 1/4
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.8, 3) - (1 + 0.8 + 0.64 + 0.512)) < 1e-12
    with pytest.raises(ValueError, match="acceptance rate a"):
        expected_tokens(1.5, 2)


def test_best_k_known_answers():
    # c = 0.1: a = 0.5 -> 1.364, 1.458, 1.442 for K = 1, 2, 3; a = 0.8 peaks at K = 6 (2.470 vs 2.459 and 2.448)
    assert [best_k(a, 8) for a in (0.0, 0.3, 0.5, 0.8, 1.0)] == [1, 1, 2, 6, 8]
    assert best_k(0.8, 4) == 4  # clamped to k_max
    assert best_k(0.8, 8, cost=0.0) == 8  # free rows: always the most
    assert best_k(0.9, 8, cost=1.0) == 1  # a row as dear as a step: (1 + a) / 2 is the best per cost
    # an exact tie keeps the smaller K: a = 0, no cost -> every K gives 1 token
    assert best_k(0.0, 8, cost=0.0) == 1
    with pytest.raises(ValueError, match="k_max"):
        best_k(0.5, 0)
    with pytest.raises(ValueError, match="cost"):
        best_k(0.5, 4, cost=-1)


def test_decayed_counts_on_a_synthetic_sequence():
    rule = AdaptiveK(8)
    assert rule.rate is None and rule.k == 8  # nothing judged yet: try the most
    rule.observe(0, 0)  # a plain step teaches nothing
    assert rule.rate is None
    rule.observe(8, 8)  # all accepted: S = 8, N = 8 (no rejection seen)
    assert rule.rate == 1.0 and rule.k == 8
    rule.observe(8, 2)  # S = 0.8 * 8 + 2 = 8.4, N = 0.8 * 8 + 3 = 9.4
    assert abs(rule.successes - 8.4) < 1e-12 and abs(rule.trials - 9.4) < 1e-12
    assert rule.k == best_k(8.4 / 9.4, 8)
    for _ in range(30):  # a long run of immediate rejections drives a (and K) to the floor
        rule.observe(rule.k, 0)
    assert rule.rate < 0.01 and rule.k == 1
    rule.observe(1, 1)  # one success after the run: K comes back up as a recovers
    assert rule.k >= 1 and rule.rate > 0.1


def test_first_rejection_counts_once_and_later_drafts_not_at_all():
    one, other = AdaptiveK(8, decay=0.5), AdaptiveK(8, decay=0.5)
    one.observe(2, 1)  # accepted, rejected
    other.observe(8, 1)  # accepted, rejected, six never judged
    assert (one.successes, one.trials) == (other.successes, other.trials) == (1.0, 2.0)


def test_invalid_settings_name_the_field():
    for kwargs, field in (({"k_max": 0}, "k_max"), ({"k_max": 4, "decay": 1.0}, "decay"), ({"k_max": 4, "cost": float("nan")}, "cost")):
        with pytest.raises(ValueError, match=field):
            AdaptiveK(**kwargs)
    with pytest.raises(ValueError, match="accepted"):
        AdaptiveK(4).observe(2, 3)


class _Many:
    def propose(self, context, k):
        return list(range(10, 10 + k))


def test_the_loop_asks_the_rule_for_k_and_reports_acceptance():
    info = ModelInfo("verifier.v1", "m", "qwen3_5_text", 50, (0,), 200, 8, ("gdn",), "woa", False, 1, "cpu", "float32")
    rule = AdaptiveK(8)
    loop = DraftLoop(Session("s", 3, 9, None, [1, 2, 3]), info, _Many(), 8, 100, adaptive=rule)
    sent = []
    for accepted in (0, 1, 3):
        step = loop.next_step()
        sent.append(len(step.draft_ids))
        tokens = list(step.draft_ids[:accepted]) + [7]
        loop.advance(step, StepOutcome(grpc.StatusCode.OK, "", "s", "", accepted, tokens, step.expected_position + len(tokens), None))
    # K = 8 first; 0 of 8 -> a = 0 -> K = 1; 1 of 1 -> S = 1, N = 1.8, a = 5/9 -> K = 3 (1.566 per cost
    # against 1.553 at K = 2 and 1.522 at K = 4)
    assert sent == rule.history == [8, 1, 3]
    assert loop.drafted == sent and loop.accepted == [0, 1, 3]
    # the loop's k caps the rule, and a greedy session never carries probabilities
    capped = DraftLoop(Session("s", 3, 9, None, [1, 2, 3]), info, _Many(), 2, 100, adaptive=AdaptiveK(8))
    step = capped.next_step()
    assert len(step.draft_ids) == 2 and step.draft_probs is None
