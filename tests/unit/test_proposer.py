"""The n-gram proposer: what prompt lookup offers for a request's tokens."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.core.proposer import NgramProposer, Proposer, TokenView


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


def test_per_match_bounds_the_drafts_by_the_match_length():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    assert NgramProposer(1, 4).propose(tokens, 8) == [4, 5, 6, 7, 8, 9, 1, 2]
    assert NgramProposer(1, 4, per_match=1).propose(tokens, 8) == [4, 5, 6, 7]  # n = 3
    assert NgramProposer(1, 4, per_match=1).propose(tokens, 2) == [4, 5]  # k still bounds
    assert NgramProposer(1, 2, per_match=1).propose(tokens, 8) == [4, 5, 6]  # n = 2
    # only the last token matches: two drafts
    assert NgramProposer(1, 4, per_match=1).propose([5, 6, 7, 8, 6], 8) == [7, 8]


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=60),
       st.lists(st.integers(1, 5), min_size=1, max_size=20), st.integers(1, 3),
       st.integers(0, 2), st.integers(1, 5), st.integers(0, 2))
def test_the_index_proposes_what_the_scan_does(tokens, growth, min_n, extra, k, per_match):
    """The incremental index, fed as a request grows (a few tokens a step), agrees with a scan
    of the whole list at every size."""
    proposer = NgramProposer(min_n, min_n + extra, per_match)
    index = proposer.new_state()
    size = 0
    for step in growth:
        size = min(len(tokens), size + step)
        view = TokenView(tokens[: size // 2], tokens[size // 2: size])
        assert proposer.propose(view, k, index) == proposer.propose(tokens[:size], k)


def test_the_token_view_reads_prompt_then_output():
    view = TokenView([1, 2, 3], [4, 5])
    assert len(view) == 5 and view[3] == 4 and view[-1] == 5
    assert view[1:4] == [2, 3, 4] and view[:2] == [1, 2] and view[3:] == [4, 5]
