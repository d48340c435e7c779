"""The n-gram proposer: what prompt lookup offers for a request's tokens."""

import pytest

from services.scheduler.core.proposer import NgramProposer, Proposer


def test_ngram_proposes_what_followed_the_latest_earlier_match():
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    # the suffix [1, 2, 3] was last seen at 6..8, followed by 7, 8
    assert NgramProposer(2, 3).propose(tokens, 2) == [7, 8]
    assert NgramProposer(2, 3).propose(tokens, 5) == [7, 8, 1, 2, 3]


def test_ngram_prefers_the_longest_suffix_that_matches():
    # [2, 3] last occurs at 6-7 (then 6), but the 3-gram [1, 2, 3] only at 0-2 (then 4)
    tokens = [1, 2, 3, 4, 0, 5, 2, 3, 6, 0, 1, 2, 3]
    assert NgramProposer(2, 3).propose(tokens, 1) == [4]
    assert NgramProposer(2, 2).propose(tokens, 1) == [6]


def test_ngram_proposes_nothing_without_a_match_or_budget():
    proposer = NgramProposer(2, 4)
    assert proposer.propose([1, 2, 3, 4, 5], 3) == []
    assert proposer.propose([7, 7], 3) == []  # the only 2-gram is the suffix itself
    assert proposer.propose([1, 2, 1, 2], 0) == []
    assert proposer.propose([], 3) == []


def test_ngram_overlapping_repeats_propose_the_run_on():
    assert NgramProposer(1, 2).propose([5, 5, 5], 4) == [5]  # follows the match at 0-1


def test_ngram_sizes_are_checked():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError):
        NgramProposer(0, 2)


def test_ngram_is_a_proposer():
    proposer: Proposer = NgramProposer()
    assert proposer.propose([1, 2, 9, 1, 2], 1) == [9]
