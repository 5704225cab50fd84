"""Proposers: what they propose for a given context, and the limits they respect."""

import pytest

from verifier.proposers import NgramProposer, OracleProposer, RandomProposer


def test_random_proposer_is_seeded_and_in_vocabulary():
    a, b, c = RandomProposer(50, seed=7), RandomProposer(50, seed=7), RandomProposer(50, seed=8)
    draws_a = [a.propose([1, 2], 5) for _ in range(4)]
    assert draws_a == [b.propose([1, 2], 5) for _ in range(4)]
    assert draws_a != [c.propose([1, 2], 5) for _ in range(4)]
    assert all(len(d) == 5 and all(0 <= t < 50 for t in d) for d in draws_a)
    assert a.propose([1], 0) == []


def test_ngram_proposes_what_followed_the_latest_match():
    #            0  1  2  3  4  5  6  7  8  9
    context = [5, 6, 7, 8, 5, 6, 9, 1, 5, 6]
    # the tail (5, 6) occurred at 0 (followed by 7 8 5) and at 4 (followed by 9 1 5): the latest wins
    assert NgramProposer().propose(context, 3) == [9, 1, 5]
    assert NgramProposer().propose(context, 1) == [9]
    assert NgramProposer().propose(context, 0) == []


def test_ngram_prefers_the_longest_ngram():
    # tail 3-gram (1, 2, 3) matches at 0 (followed by 7); the 1-gram (3) alone matches later at 5 (followed by 9)
    context = [1, 2, 3, 7, 4, 3, 9, 1, 2, 3]
    assert NgramProposer(max_n=3).propose(context, 1) == [7]
    assert NgramProposer(max_n=1).propose(context, 1) == [9]


def test_ngram_min_size_refuses_short_matches():
    context = [4, 8, 1, 9, 8]  # only the 1-gram (8) recurs
    assert NgramProposer(max_n=3, min_n=1).propose(context, 2) == [1, 9]
    assert NgramProposer(max_n=3, min_n=2).propose(context, 2) == []


def test_ngram_takes_a_shorter_continuation_when_nothing_longer_follows():
    context = [3, 4, 3, 4]  # tail (3, 4) matched at 0, followed by only (3, 4): two tokens, not five
    assert NgramProposer().propose(context, 5) == [3, 4]
    assert NgramProposer().propose([1, 2, 3], 4) == []  # no earlier occurrence of anything


@pytest.mark.parametrize("sizes", [(0, 1), (3, 2)], ids=["min0", "min-over-max"])
def test_ngram_rejects_bad_sizes(sizes):
    min_n, max_n = sizes
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(max_n=max_n, min_n=min_n)


def test_oracle_proposes_the_rest_of_the_known_continuation():
    oracle = OracleProposer(prompt_len=2, continuation=[7, 8, 9])
    assert oracle.propose([1, 2], 2) == [7, 8]
    assert oracle.propose([1, 2, 7, 8], 4) == [9]
