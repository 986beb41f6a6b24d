"""The prompt-lookup proposer (scheduler/speculation.py), the acceptance rule
(wire/step.py `count_accepted`) and `--speculative-config` parsing, without ranks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.config import speculative_from
from scheduler.speculation import NgramIndex, SpecStats
from wire.config import SpeculativeConfig
from wire.step import count_accepted


def brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The specification: for n from hi down to lo, the latest earlier occurrence of the
    last n tokens (one that ends before the last token), and up to k tokens after it."""
    num = len(tokens)
    for n in range(min(hi, num - 1), lo - 1, -1):
        suffix = tokens[num - n:]
        for end in range(num - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return tokens[end:min(end + k, num)]
    return []


@given(tokens=st.lists(st.integers(0, 5), min_size=1, max_size=400),
       cuts=st.lists(st.integers(1, 400), max_size=12),
       lo=st.integers(1, 3), extra=st.integers(0, 3), k=st.integers(1, 8))
def test_incremental_index_proposes_what_a_full_search_finds(tokens, cuts, lo, extra, k):
    """Proposing as the sequence grows (short steps and long jumps, both indexing paths)
    gives what a search over every token gives at each length."""
    index = NgramIndex(lo, lo + extra)
    for n in sorted({min(c, len(tokens)) for c in cuts} | {len(tokens)}):
        assert index.propose(tokens[:n], k) == brute_force(tokens[:n], lo, lo + extra, k)


def test_copies_what_followed_the_latest_match():
    code = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 50, 51, 52]
    index = NgramIndex(2, 3)
    assert index.propose(code + [1, 2, 3], 4) == [4, 50, 51, 52]  # the later copy wins
    assert index.propose(code + [1, 2, 3, 4, 50], 2) == [51, 52]
    assert index.propose(code + [1, 2, 3, 4, 50, 99], 4) == []  # no bigram "50 99" before
    # one index per sequence (it indexes the tokens it has seen); a match may overlap
    # the suffix it matches
    assert NgramIndex(2, 3).propose([7, 7, 7, 7], 3) == [7]
    assert NgramIndex(2, 3).propose([7, 7, 7, 7], 0) == []


def test_count_accepted():
    assert count_accepted([5, 6, 7], [5, 6, 7, 8]) == 3  # all kept, then the bonus token
    assert count_accepted([5, 6, 7], [5, 9, 7, 8]) == 1  # the second is rejected
    assert count_accepted([5], [4, 1]) == 0
    assert count_accepted([], [3]) == 0
    with pytest.raises(AssertionError):
        count_accepted([1, 2], [1, 2])


def test_stats_and_histogram():
    stats = SpecStats()
    for drafts, kept in [(4, 4), (4, 0), (2, 1), (4, 4)]:
        stats.record(drafts, kept)
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (14, 9)
    h = stats.histogram(4)
    assert h.bounds == [0.0, 1.0, 2.0, 3.0, 4.0] and h.counts == [1, 1, 0, 0, 2, 0]
    assert h.sum == 9


def test_config_from_json():
    c = speculative_from('{"method": "ngram", "num_speculative_tokens": 5, '
                         '"prompt_lookup_max": 4, "prompt_lookup_min": 1}')
    assert c == SpeculativeConfig("ngram", 5, 4, 1)
    assert speculative_from(None) is None
    assert speculative_from('{"method": "ngram"}') == SpeculativeConfig()


@pytest.mark.parametrize("text, says", [
    ("{", "not JSON"),
    ("[1]", "JSON object"),
    ('{"num_speculative_tokens": 4}', 'needs "method"'),
    ('{"method": "eagle"}', "only ngram"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "between 1 and 64"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "must be int"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be int"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}', "<="),
    ('{"method": "ngram", "draft_model": "x"}', "unknown field(s) draft_model"),
])
def test_config_errors_say_why(text, says):
    with pytest.raises(SystemExit) as exc:
        speculative_from(text)
    assert says in str(exc.value)
