"""measure/divergence.py: why a greedy run's text leaves the reference's, on a mock target whose
batch numerics the test controls."""

import numpy as np

from edgespec.measure.divergence import Diagnosis, first_difference
from mock import MockTarget


class BatchFlip(MockTarget):
    """A mock whose last row of a decode of `flip_at` or more tokens prefers token `flip_to`
    (llama.cpp's numbers depending on the batch, made large)."""

    def __init__(self, flip_at=3, flip_to=5, **kw):
        super().__init__(**kw)
        self.flip_at, self.flip_to = flip_at, flip_to

    def prefill(self, tokens, last_logits=False):
        if not last_logits:
            return super().prefill(tokens)
        return self.decode(tokens, all_logits=False)[0][-1]

    def decode(self, tokens, hidden=False, all_logits=True, copy=True, top_only=False):
        logits, hid = super().decode(tokens, hidden, all_logits, copy, top_only)
        if len(tokens) >= self.flip_at:
            logits = logits.copy()
            logits[-1, self.flip_to] = logits[-1].max() + 1.0
        return logits, hid


def greedy(t, ids, n):
    ctx, out = list(ids), []
    for _ in range(n):
        out.append(int(np.argmax(t.logits_after(ctx))))
        ctx.append(out[-1])
    return out


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 4, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_batch_numerics_lm_head_and_length_are_told_apart():
    t = BatchFlip(vocab=12, seed=3)
    ids = [1, 2, 3, 4]
    ref = greedy(t, ids, 10)
    ctx = ids + ref[:4]
    never = next(x for x in range(12) if x != t.flip_to and x != ref[4]
                 and x != int(np.argmax(t.logits_after(ctx))))
    assert t.flip_to != ref[4]
    batch = ref[:4] + [t.flip_to] + ref[5:]  # the token the full head picks in a batch of 3+
    head = ref[:4] + [never] + ref[5:]  # a token no split of the full head picks
    d = Diagnosis(t)
    s = d.summary([ids] * 4, [ref] * 4, [ref, batch, head, ref[:6]])
    assert s["counts"] == {"same": 1, "batch numerics": 1, "lm head": 1, "length": 1}
    b, h = s["per_prompt"][1], s["per_prompt"][2]
    assert b["at"] == h["at"] == 4 and b["reference_token"] == ref[4] and b["run_token"] == t.flip_to
    row = t.logits_after(ctx)
    assert h["margin"] == round(float(row[ref[4]] - row[never]), 4) and h["margin"] > 0
    assert s["median_margin"] is not None


def test_no_batch_effect_means_lm_head():
    """With batch-invariant numbers every departure is the run's own LM head."""
    t = BatchFlip(flip_at=10**6, vocab=12, seed=4)
    ids = [2, 7]
    ref = greedy(t, ids, 8)
    out = ref[:2] + [(ref[2] + 1) % 12] + ref[3:]
    assert Diagnosis(t).explain(ids, ref, out)["why"] == "lm head"


class FixedSearch:
    """A low-rank head stand-in: a fixed candidate set and a fixed pick, whatever the row."""

    def __init__(self, candidates, pick, vocab=12):
        self.cands, self.pick, self.vocab = list(candidates), pick, vocab
        self.rows = 0

    def candidates(self, hidden):
        self.rows += len(hidden)
        return np.array([self.cands] * len(hidden))

    def top_logits(self, hidden):
        out = np.full((len(hidden), self.vocab), -np.inf, np.float32)
        out[:, self.pick] = 1.0
        return out


def test_an_lm_head_departure_says_what_the_search_did_on_the_reference_row():
    """Given the runs' low-rank head, an "lm head" departure says whether the reference's token
    was outside the search's candidates, inside and rescored to another, or picked on the
    one-token row (the run's own row differed); other causes carry no search."""
    t = BatchFlip(flip_at=10**6, vocab=12, seed=4)
    ids = [2, 7]
    ref = greedy(t, ids, 8)
    other = (ref[2] + 1) % 12
    out = ref[:2] + [other] + ref[3:]
    rest = [x for x in range(12) if x != ref[2]]
    cases = {"reference not a candidate": FixedSearch(rest[:4], other),
             "rescored to another": FixedSearch([ref[2], other], other),
             "picks the reference here": FixedSearch([ref[2], other], ref[2])}
    for want, search in cases.items():
        s = Diagnosis(t, search).summary([ids] * 2, [ref] * 2, [out, ref])
        assert s["per_prompt"][0]["why"] == "lm head" and s["per_prompt"][0]["search"] == want
        assert s["lm_head_search"] == {want: 1} and search.rows == 1
    assert Diagnosis(t).summary([ids], [ref], [out])["lm_head_search"] == {}
