"""Prompt lookup on plain token lists."""

from edgespec.runtime.drafters import PromptLookup


def test_lookup_proposes_the_continuation_of_the_latest_match():
    d = PromptLookup(max_ngram=3)
    ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert d.propose(ctx, None, 2).tokens == [7, 8]  # latest earlier occurrence of [1, 2, 3]
    assert d.propose([5, 6, 7], None, 3).tokens == []  # nothing repeats
    assert d.propose([4, 1, 2, 4], None, 5).tokens == [1, 2, 4]  # 1-gram fallback, up to the end
