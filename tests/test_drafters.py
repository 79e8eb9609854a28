"""Prompt lookup on plain token lists; the mixed lookup + head drafter."""

import numpy as np
import pytest

from edgespec.runtime.decoding import Draft
from edgespec.runtime.drafters import HeadDrafter, MixedDrafter, PromptLookup


def test_lookup_proposes_the_continuation_of_the_latest_match():
    d = PromptLookup(max_ngram=3)
    ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert d.propose(ctx, None, 2).tokens == [7, 8]  # latest earlier occurrence of [1, 2, 3]
    assert d.propose([5, 6, 7], None, 3).tokens == []  # nothing repeats
    assert d.propose([4, 1, 2, 4], None, 5).tokens == [1, 2, 4]  # 1-gram fallback, up to the end


class RecordingHead(HeadDrafter):
    """The head drafter's own row keeping, with the head's forward replaced by a recorder."""

    name = "fake-head"

    def __init__(self):
        self.calls, self.pending = [], []
        self.sampling, self._draws = None, None

    def reset(self):
        self.calls.clear()
        self.pending = []

    def _chain(self, context, hidden, k, p_min, go_on=None):
        self.calls.append((len(context), hidden.copy()))
        return Draft([42] * k, conf=[0.9] * k, source="head")


def test_mixed_drafter_uses_lookup_on_repeats_and_feeds_the_head_every_row():
    head = RecordingHead()
    d = MixedDrafter(head, min_match=2)
    rows = [np.full((2, 4), i, np.float32) for i in range(3)]
    # [1, 2] occurred before: lookup drafts, the head is not run, its rows wait
    got = d.propose([1, 2, 3, 5, 1, 2], rows[0], 2)
    assert got.tokens == [3, 5] and got.source == "lookup2+" and not head.calls
    # only a 1-gram repeats: the head drafts, and gets both batches of rows in order
    got = d.propose([1, 2, 3, 5, 1, 2, 7, 9, 5], rows[1], 3)
    assert got.tokens == [42, 42, 42] and got.source == "head"
    (n_ctx, fed), = head.calls
    assert n_ctx == 9 and fed.shape == (4, 4) and list(fed[:, 0]) == [0, 0, 1, 1]
    d.propose([4, 6, 8], rows[2], 1)
    assert head.calls[-1][1].shape == (2, 4)  # nothing fed twice


def test_no_default_head_for_an_unknown_target():
    from types import SimpleNamespace

    import pytest

    from edgespec.errors import EdgespecError
    from edgespec.runtime.assets import default_head

    with pytest.raises(EdgespecError, match="no default head ships for target other"):
        default_head(SimpleNamespace(tokenizer_fingerprint="0000", name="other"))


def test_the_default_head_reads_the_targets_keys_only_where_the_engine_can_hand_them(tmp_path, monkeypatch):
    """Where a shared-KV head ships, "default" is it on an engine that can hand it the target's
    keys and values, and the head that reads hidden states alone on any other; a target whose
    only shipped head is shared-KV is refused in one line on such an engine."""
    from types import SimpleNamespace

    from edgespec.errors import EdgespecError
    from edgespec.runtime import assets

    kv_heads = [f for f in sorted(assets.HEADS_DIR.glob("*/*")) if assets.file_reads_kv(f)]
    assert kv_heads  # Gemma 3 270M's ships
    for f in kv_heads:
        spec = SimpleNamespace(tokenizer_fingerprint=assets.head_fingerprint(f), name=f.parent.name)
        assert assets.file_reads_kv(assets.default_head(spec))
        assert assets.default_head(spec).suffix == ".onnx"  # the faster draft step first
        other = assets.default_head(spec, kv=False)
        assert not assets.file_reads_kv(other) and assets.head_fingerprint(other) == spec.tokenizer_fingerprint
    for f in sorted(assets.HEADS_DIR.glob("*/head-int8.onnx")):  # a target without one: as before
        spec = SimpleNamespace(tokenizer_fingerprint=assets.head_fingerprint(f), name=f.parent.name)
        if not any(assets.head_fingerprint(k) == spec.tokenizer_fingerprint for k in kv_heads):
            assert assets.default_head(spec) == assets.default_head(spec, kv=False) == f
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / kv_heads[0].name).symlink_to(kv_heads[0])
    monkeypatch.setattr(assets, "HEADS_DIR", tmp_path)
    spec = SimpleNamespace(tokenizer_fingerprint=assets.head_fingerprint(kv_heads[0]), name="t")
    assert assets.default_head(spec) == tmp_path / "t" / kv_heads[0].name
    with pytest.raises(EdgespecError, match="cannot hand it; run the target on llama.cpp"):
        assets.default_head(spec, kv=False)


def test_drafters_ask_the_policy_before_drafting():
    """A source the policy holds at zero drafts nothing (no head steps computed), while its
    rows still reach the head the next time it may draft."""
    head = RecordingHead()
    d = MixedDrafter(head, min_match=2)
    limits = {"lookup2+": 0, "head": 0, "lookup1": 0}
    rows = [np.full((1, 4), i, np.float32) for i in range(2)]
    got = d.propose([1, 2, 3, 5, 1, 2], rows[0], 3, limit=limits.get)
    assert got.tokens == [] and not head.calls
    limits.update({"lookup2+": 1, "head": 2})
    assert d.propose([1, 2, 3, 5, 1, 2], rows[1], 3, limit=limits.get).tokens == [3]
    got = d.propose([7, 8, 9], None, 3, limit=limits.get)
    assert got.tokens == [42, 42] and head.calls[0][1].shape == (2, 4)


def test_a_head_held_back_leaves_the_pass_to_a_one_token_match():
    """Where the policy holds the head at zero and no 2-gram repeats, the tokens after the
    latest occurrence of the last token are drafted, under their own source; where the head may
    draft, it does, and the 1-token match is not used."""
    head = RecordingHead()
    d = MixedDrafter(head, min_match=2)
    limits = {"lookup2+": 3, "head": 0, "lookup1": 2}
    ctx = [5, 7, 8, 9, 6, 5]  # only [5] occurred before: 7, 8 followed it
    got = d.propose(ctx, np.zeros((1, 4), np.float32), 3, limit=limits.get)
    assert got.tokens == [7, 8] and got.source == "lookup1" and not head.calls
    limits["lookup1"] = 0
    assert d.propose(ctx, None, 3, limit=limits.get).tokens == []
    limits.update({"head": 1, "lookup1": 2})
    got = d.propose(ctx, None, 3, limit=limits.get)
    assert got.tokens == [42] and got.source == "head" and head.calls[0][1].shape == (1, 4)
    assert d.propose([3, 4], np.ones((1, 4), np.float32), 3, limit=limits.get).tokens == [42]


class KeepingLimit:
    """A policy's limit that previews its trim: it keeps a source's draft up to its first
    confidence below that source's floor, and records the drafts it is told were set aside."""

    def __init__(self, limits, floors):
        self.limits, self.floors, self.set_aside = limits, floors, []

    def __call__(self, source):
        return self.limits[source]

    def kept(self, source, conf, u=None):
        return next((i for i, c in enumerate(conf) if c < self.floors[source]), len(conf))

    def seen(self, source, conf):
        self.set_aside.append((source, list(conf)))


def test_a_head_draft_the_policy_would_trim_away_may_leave_the_pass_to_a_one_token_match():
    """With `set_aside_peeks` on (off as shipped: measured not to pay), a head held short may
    still take a step (a peek); where the policy's preview says that
    draft would be trimmed to nothing and the one-token match would be verified, the match
    drafts instead (timed on its own, not with the head's step), and the policy is told of the
    set-aside draft. A head draft it would keep stands; where it would trim the match too, or
    there is no match, the head's draft is returned for the policy to trim."""
    head = RecordingHead()
    d = MixedDrafter(head, min_match=2)
    ctx = [5, 7, 8, 9, 6, 5]  # only [5] occurred before: 7, 8 followed it (scores 1/3, 1/2)
    rows = lambda: np.zeros((1, 4), np.float32)  # noqa: E731
    floors = {"head": 0.95, "lookup1": 0.3}  # the head's drafts are 0.9 sure
    lim = KeepingLimit({"lookup2+": 3, "head": 2, "lookup1": 2}, floors)
    got = d.propose(ctx, rows(), 3, limit=lim)  # as shipped (switch off): the head's draft
    assert got.tokens == [42, 42] and got.source == "head" and not lim.set_aside
    d.set_aside_peeks = True
    got = d.propose(ctx, rows(), 3, limit=lim)
    assert got.tokens == [7, 8] and got.source == "lookup1" and len(head.calls) == 2
    assert lim.set_aside == [("head", [0.9, 0.9])]
    assert got.step_s is not None and got.step_s < 0.01
    floors["head"] = 0.5  # now the head's draft would be verified: it stands
    got = d.propose(ctx, rows(), 3, limit=lim)
    assert got.tokens == [42, 42] and got.source == "head" and len(lim.set_aside) == 1
    floors.update(head=0.95, lookup1=0.4)  # both would be trimmed away: the head's goes on
    got = d.propose(ctx, rows(), 3, limit=lim)
    assert got.tokens == [42, 42] and got.source == "head" and len(lim.set_aside) == 1
    floors["lookup1"] = 0.3
    got = d.propose([3, 4], rows(), 3, limit=lim)  # no match at all
    assert got.tokens == [42, 42] and got.source == "head" and len(lim.set_aside) == 1


def test_a_long_pause_costs_the_head_one_short_catch_up():
    """Rows pile up while the head is held at zero; it then reads only the last
    `max_catch_up` of them, the newest last, and keeps no more than that meanwhile."""
    head = RecordingHead()
    rows = [np.full((5, 4), i, np.float32) for i in range(20)]
    for r in rows:
        head.propose([1, 2, 3], r, 3, limit=lambda s: 0)
    assert sum(map(len, head.pending)) < head.max_catch_up + 5
    head.propose([1, 2, 3], None, 3)
    (_, fed), = head.calls
    assert len(fed) == head.max_catch_up and fed[-1, 0] == 19


def _scan(context, k, max_ngram, min_ngram):
    """Prompt lookup by brute force: the latest earlier occurrence of the longest tail n-gram."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        tail = context[len(context) - n:]
        for s in range(len(context) - n - 1, -1, -1):
            if context[s:s + n] == tail:
                return context[s + n:s + n + k], n
    return [], 0


def test_lookup_index_equals_a_full_scan_as_the_context_grows_or_changes():
    """The n-gram index is kept up to date token by token; a context that is not an extension
    of the last one (a new prompt, an edit) rebuilds it. Either way: what a scan finds."""
    rng = np.random.default_rng(7)
    for min_ngram in (1, 2):
        pl = PromptLookup(min_ngram=min_ngram)
        for _ in range(100):
            ctx = [int(x) for x in rng.integers(0, 6, rng.integers(1, 5))]
            for _ in range(40):
                if rng.random() < 0.05:
                    ctx = ctx[:rng.integers(1, len(ctx) + 1)]
                ctx.append(int(rng.integers(0, 6)))
                k = int(rng.integers(0, 5))
                d = pl.propose(ctx, None, k)
                assert (d.tokens, pl.last_match) == _scan(ctx, k, 3, min_ngram)


class FakeClock:
    """The drafter's clock, advanced only by the fake head: the test times nothing real."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class SlowHead:
    """A head runtime whose forward takes 5 ms (of the fake clock) per row it reads (a draft
    step reads one)."""

    def __init__(self, clock):
        self.n, self.k, self.v, self.clock = 0, None, None, clock
        self.last_logits = np.array([0.0, 3.0, 1.0], np.float32)

    def reset(self):
        self.n = 0

    def forward(self, tok_emb, hidden, pos0, commit, cache=None):
        self.clock.now += 0.005 * len(hidden)
        if commit:
            self.n = pos0 + len(hidden)
        return hidden, cache


def test_a_head_reports_its_step_without_the_catch_up(monkeypatch):
    """After a pause the head first reads every row that waited: that one-off cost is not a
    draft step, or a head the policy rarely lets draft would look ever dearer. The step it
    reports is a one-row forward, measured on chains and on short catch-ups."""
    import edgespec.runtime.drafters as drafters

    clock = FakeClock()
    monkeypatch.setattr(drafters, "time", clock)
    d = HeadDrafter.__new__(HeadDrafter)
    d.head, d.ids, d.pending, d.sampling = SlowHead(clock), np.array([5, 6, 7]), [], None
    d.embed, d._one_row_s, d.name = np.zeros((32, 2), np.float32), None, "slow"
    ctx = list(range(9))
    first = d.propose(ctx[:3], np.zeros((2, 2), np.float32), 3)  # prompt rows, then 2 steps
    assert first.tokens == [6, 6, 6] and first.step_s == pytest.approx(0.005)
    # 20 rows waited: reading them takes 100 ms, the step it reports stays one row's
    late = d.propose(ctx[:3] + list(range(20)), np.zeros((20, 2), np.float32), 1)
    assert late.tokens == [6] and late.step_s == pytest.approx(0.005)
    # a short catch-up (one row read, one drafted) is a step too
    short = d.propose(ctx[:3] + list(range(21)), np.zeros((1, 2), np.float32), 1)
    assert short.step_s == pytest.approx(0.005)


def test_lookup_scores_its_drafts_by_the_length_of_the_match():
    """The n-gram, extended backwards while both occurrences agree, sets each drafted token's
    score (m + j) / (m + j + 2): long copies score high, one-token matches low."""
    d = PromptLookup(max_ngram=3)
    got = d.propose([7, 8, 9, 1, 2, 3, 4, 5, 0, 7, 8, 9, 1, 2, 3], None, 2)
    assert got.tokens == [4, 5] and got.conf == [6 / 8, 7 / 9]  # 3-gram + 3 more tokens agree
    got = d.propose([6, 1, 2, 3, 4, 5, 0, 9, 1, 2, 3], None, 2)
    assert got.tokens == [4, 5] and got.conf == [3 / 5, 4 / 6]  # 6 and 9 differ: the 3-gram only
    got = d.propose([4, 1, 5, 1], None, 2)
    assert got.tokens == [5, 1] and got.conf == [1 / 3, 2 / 4]
    got = d.propose([1] * 100, None, 4)
    m = 3 + PromptLookup.MATCH_CAP
    assert got.tokens == [1] and got.conf == [m / (m + 2)]  # the extension is capped
    assert d.propose([5, 6, 7], None, 3).conf == []


class FadingHead:
    """A head whose draft-vocabulary logits at step j have top probability `tops[j]`; counts
    the steps computed (`forward` for the hidden-state head, `step` for the shared-KV one)."""

    def __init__(self, tops, vocab=20):
        self.tops, self.vocab, self.steps, self.n, self.k, self.v = tops, vocab, 0, 0, None, None

    def reset(self):
        self.n = 0

    def _logits(self):
        p = self.tops[self.steps]
        self.steps += 1
        return np.log(np.array([p] + [(1 - p) / (self.vocab - 1)] * (self.vocab - 1)))

    def forward(self, x, hidden, pos, commit=True, cache=None):
        self.last_logits = self._logits()
        return np.zeros((len(x), 4), np.float32), cache

    def step(self, x, prev, pos, keys, values):
        return prev, self._logits()[None]


class SureLimit:
    """A policy's limit that lets a chain go on while its last draft was at least `floor` sure."""

    def __init__(self, k, floor=0.5):
        self.k, self.floor, self.asked = k, floor, []

    def __call__(self, source):
        return self.k

    def go_on(self, source, conf, u=None):
        self.asked.append(list(conf))
        return conf[-1] >= self.floor


@pytest.mark.parametrize("kind", ["hidden", "shared-kv"])
def test_a_head_computes_its_next_step_only_where_the_policy_lets_the_chain_go_on(kind):
    """The policy's `go_on` is asked after each draft step: a chain whose draft just fell to
    0.1 computes no further step (the unsure draft is the policy's to trim); a plain limit,
    with no `go_on`, gets every step it allowed."""
    from edgespec.runtime.drafters import SharedKVDrafter

    def drafter(tops):
        d = object.__new__(SharedKVDrafter if kind == "shared-kv" else HeadDrafter)
        d.head, d.ids, d.embed = FadingHead(tops), np.arange(100, 120), np.zeros((200, 4), np.float32)
        d.sampling, d._draws, d._one_row_s, d.source, d.pending = None, None, None, "head", []
        if kind == "shared-kv":
            d.n, d._ids, d._h, d._k, d._v = 3, [1, 2, 3], np.zeros((3, 4), np.float32), [], []
        return d

    ctx, rows = [1, 2, 3, 4], np.zeros((3, 4), np.float32)
    tops = [0.95, 0.9, 0.1, 0.9, 0.9]
    d, lim = drafter(tops), SureLimit(5)
    got = d.propose(ctx, None if kind == "shared-kv" else rows, 5, limit=lim)
    assert d.head.steps == 3 and len(got.tokens) == 3, (d.head.steps, got)
    assert got.conf == pytest.approx(tops[:3]) and lim.asked[-1] == pytest.approx(tops[:3])
    d = drafter(tops)
    got = d.propose(ctx, None if kind == "shared-kv" else rows, 4, limit=lambda s: 4)
    assert d.head.steps == 4 and len(got.tokens) == 4
