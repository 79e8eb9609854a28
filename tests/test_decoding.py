"""Decoding logic on a mock target: lossless greedy, lossless sampling, stopping, rollback."""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgespec.errors import EdgespecError
from edgespec.runtime.decoding import Generation
from edgespec.runtime.policies import FixedK
from edgespec.runtime.sampling import SamplingParams, probs
from mock import MockExact, MockTarget, NoisyOracle, SamplingDrafter, assert_joint_law


def plain_greedy(t: MockTarget, prompt, n):
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(int(np.argmax(t.logits_after(ctx))))
    return ctx[len(prompt):]


def run(target, prompt, n, drafter=None, k=0, sp=None, stop=None):
    g = Generation(target, prompt, sp or SamplingParams(), max_tokens=n, drafter=drafter,
                   policy=FixedK(k) if drafter else None, stop=stop)
    toks = [t for t, _ in g]
    return toks, g


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("err", [0.0, 0.3, 1.0])
def test_speculative_greedy_equals_plain_greedy(k, err):
    t = MockTarget(seed=k)
    prompt = [1, 2, 3]
    want = plain_greedy(t, prompt, 40)
    got, g = run(t, prompt, 40, NoisyOracle(t, err=err), k=k)
    assert got == want
    assert g.stats.tokens == 40
    # the cache holds exactly the emitted tokens except the newest (pending) one
    assert t.tokens == (prompt + got)[:-1]
    if err == 0.0:
        assert g.stats.mean_accepted > k  # a perfect drafter gets k + 1 per pass (bar the end)
    if err == 1.0:
        assert g.stats.mean_accepted < 1.5


def test_target_only_uses_one_pass_per_token():
    t = MockTarget()
    got, g = run(t, [4, 5], 10)
    assert got == plain_greedy(t, [4, 5], 10)
    assert g.stats.verify_passes == 10 and g.stats.mean_accepted == 1.0


def test_acceptance_counts_per_position():
    t = MockTarget(seed=3)
    _, g = run(t, [1, 2], 30, NoisyOracle(t, err=0.0), k=3)
    acc = g.stats.acceptance_by_position()
    assert len(acc) == 3 and all(a == 1.0 for a in acc)


def test_stops_on_eog_and_stop_string():
    t = MockTarget(seed=5)
    seq = plain_greedy(t, [1, 2], 30)
    t.eog = seq[5]
    first = seq.index(t.eog)
    got, g = run(t, [1, 2], 30, NoisyOracle(t, err=0.0), k=4)
    assert got == seq[: first + 1] and g.stats.finish_reason == "stop"

    t2 = MockTarget(seed=5)
    text = "".join(chr(97 + x % 26) for x in seq)
    stop = text[7:9]
    _, g2 = run(t2, [1, 2], 30, NoisyOracle(t2, err=0.0), k=4, stop=[stop])
    assert g2.text == text[: text.index(stop)] and g2.stats.finish_reason == "stop"



class Pieces(MockTarget):
    """A mock whose tokens are the given text pieces (empty and multi-character ones too)."""

    def __init__(self, pieces, seed):
        super().__init__(vocab=len(pieces), seed=seed)
        self.pieces = pieces

    def token_bytes(self, token):
        return self.pieces[token].encode()


ALPHABET = "ab\nU:"


@settings(max_examples=int(os.environ.get("EDGESPEC_FUZZ_EXAMPLES", "150")), deadline=None,
          database=None)
@given(pieces=st.lists(st.text(ALPHABET, max_size=3), min_size=3, max_size=8),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3),
       seed=st.integers(0, 30), k=st.integers(0, 4), n=st.integers(1, 40))
def test_streamed_pieces_join_to_the_text_cut_at_the_first_stop(pieces, stops, seed, k, n):
    """Text that could still begin a stop string is held back: the streamed pieces never show
    a stop string's start, and join to exactly the final text, for any stops and any split
    of the text into tokens (drafted or not, ended by a stop, by length or by the context)."""
    t = Pieces(pieces, seed)
    t.n_ctx = 2 + n + seed % 3  # sometimes the context, not max_tokens, ends it
    g = Generation(t, [1, 2], SamplingParams(), max_tokens=n,
                   drafter=NoisyOracle(t, err=0.3, seed=seed) if k else None, policy=FixedK(k),
                   stop=stops)
    shown = ""
    for _, piece in g:
        shown += piece
        assert not any(s in shown for s in stops)
    assert shown == g.text
    want = ""  # after each token, the earliest stop string in the text cuts
    for tok in plain_greedy(t, [1, 2], len(g.token_ids)):
        want += pieces[tok]
        hits = [want.index(s) for s in stops if s in want]
        if hits:
            want = want[:min(hits)]
            break
    assert g.text == want

def test_context_limit_ends_generation():
    t = MockTarget(n_ctx=20)
    got, g = run(t, list(range(1, 11)), 100, NoisyOracle(t, err=0.0), k=4)
    assert g.stats.finish_reason == "context"
    assert len(t.tokens) <= 20


def test_bad_inputs_raise_clear_errors():
    t = MockTarget(n_ctx=8)
    with pytest.raises(EdgespecError, match="empty prompt"):
        Generation(t, [], SamplingParams())
    with pytest.raises(EdgespecError, match="context"):
        Generation(t, list(range(9)), SamplingParams())
    with pytest.raises(EdgespecError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(EdgespecError, match="top_p"):
        SamplingParams(top_p=0)


def _first_token_counts(drafter_factory, n_runs, sp_kwargs):
    """Empirical distribution of the 2nd generated token (after a drafted 1st) over many seeds."""
    counts = {}
    for seed in range(n_runs):
        t = MockTarget(vocab=6, seed=11, sharp=1.0)
        drafter = drafter_factory(seed)
        got, _ = run(t, [1, 2], 3, drafter, k=3, sp=SamplingParams(seed=seed, **sp_kwargs))
        key = tuple(got[:2])
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("sp_kwargs", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 4}])
def test_speculative_sampling_keeps_target_distribution(sp_kwargs):
    """Pairs (x1, x2) drawn with a wrong drafter follow the target's joint law: chi-square test."""
    n = 4000
    counts = _first_token_counts(lambda s: SamplingDrafter(6, seed=1000 + s), n, sp_kwargs)
    t = MockTarget(vocab=6, seed=11, sharp=1.0)
    sp = SamplingParams(**sp_kwargs)
    p1 = probs(t.logits_after([1, 2]), sp)
    expected = {}
    for a in range(6):
        p2 = probs(t.logits_after([1, 2, a]), sp)
        for b in range(6):
            if p1[a] * p2[b] > 0:
                expected[(a, b)] = n * p1[a] * p2[b]
    assert set(counts) <= set(expected)  # never a token the target rules out (top-k)
    cells = [(counts.get(c, 0), e) for c, e in expected.items() if e >= 5]
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    # chi-square 99.9% quantile is below dof + 4.5 * sqrt(2 dof) for these sizes
    assert chi2 < dof + 4.5 * np.sqrt(2 * dof), (chi2, dof)


def test_sampling_test_detects_a_biased_sampler():
    """The chi-square check above must be able to fail: feed it draws from the drafter's q."""
    t = MockTarget(vocab=6, seed=11, sharp=1.0)
    sp = SamplingParams(temperature=1.0)
    p1 = probs(t.logits_after([1, 2]), sp)
    q = SamplingDrafter(6, seed=1000).q
    rng = np.random.default_rng(0)
    draws = rng.choice(6, size=4000, p=q)
    obs = np.bincount(draws, minlength=6)
    exp = 4000 * p1
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 > 5 + 4.5 * np.sqrt(10)


def test_negative_seed_means_random_as_in_llama_cpp():
    assert SamplingParams(temperature=1.0, seed=-1).seed is None
    t = MockTarget(vocab=6, seed=1, sharp=0.5)
    runs = {tuple(run(t, [1, 2], 12, sp=SamplingParams(temperature=1.0, seed=-1))[0]) for _ in range(6)}
    assert len(runs) > 1  # not one fixed stream


def test_absurd_draft_length_is_capped():
    import time

    from edgespec.runtime.policies import MAX_DRAFT
    from edgespec.runtime.spec import SpecConfig

    t = MockTarget()
    t0 = time.perf_counter()
    p = SpecConfig(k=1000).make_policy(t, greedy=True)  # measures the verify cost only up to the cap
    assert p.k == MAX_DRAFT and time.perf_counter() - t0 < 30
    assert SpecConfig(k=10**6, policy="fixed").make_policy(t, greedy=True).k == MAX_DRAFT


class Counting(MockTarget):
    """A mock that counts the prompt tokens it is asked to prefill."""

    prefilled = 0

    def prefill(self, tokens):
        self.prefilled += len(tokens)
        super().prefill(tokens)


@pytest.mark.parametrize("k", [0, 3])
def test_a_follow_up_prompt_prefills_only_what_the_cache_lacks(k):
    """A second turn (the first prompt, its reply, a new message) keeps the cache's common
    prefix and decodes only the rest; the output is what a fresh model gives."""
    t = Counting(seed=4)
    first = Generation(t, [1, 2, 3, 4, 5], SamplingParams(), max_tokens=12,
                       drafter=NoisyOracle(t, err=0.3) if k else None, policy=FixedK(k))
    reply = [tok for tok, _ in first]
    follow_up = [1, 2, 3, 4, 5] + reply + [7, 8, 9]
    t.prefilled = 0
    second = Generation(t, follow_up, SamplingParams(), max_tokens=12,
                        drafter=NoisyOracle(t, err=0.3) if k else None, policy=FixedK(k))
    got = [tok for tok, _ in second]
    assert second.stats.prompt_reused == 5 + len(reply) - 1  # the reply's last token was pending
    assert t.prefilled == len(follow_up) - 1 - second.stats.prompt_reused
    assert got == plain_greedy(MockTarget(seed=4), follow_up, 12)
    other = [9, 9] + follow_up  # nothing in common: a fresh start
    third = Generation(t, other, SamplingParams(), max_tokens=4)
    assert [tok for tok, _ in third] == plain_greedy(MockTarget(seed=4), other, 4)
    assert third.stats.prompt_reused == 0


def test_two_streams_on_one_model_do_not_mix():
    """Two generations on one target read in turn: the one whose cache was taken over stops
    with a clear error instead of continuing from the other's cache."""
    t = MockTarget(seed=5)
    g1 = iter(Generation(t, [1, 2, 3], SamplingParams(), max_tokens=20))
    g2 = Generation(t, [4, 5, 6], SamplingParams(), max_tokens=20)
    next(g1)
    got2 = [tok for tok, _ in g2]
    assert got2 == plain_greedy(MockTarget(seed=5), [4, 5, 6], 20)
    with pytest.raises(EdgespecError, match="another generation"):
        next(g1)


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_are_the_models_at_each_emitted_token(k):
    t = MockTarget(seed=6)
    g = Generation(t, [1, 2], SamplingParams(temperature=0.7, seed=1), max_tokens=20,
                   drafter=NoisyOracle(t, err=0.3) if k else None, policy=FixedK(k), logprobs=2)
    toks = [tok for tok, _ in g]
    ctx = [1, 2]
    for tok, (lp, top) in zip(toks, g.logprobs):
        x = t.logits_after(ctx)
        want = x - x.max() - np.log(np.exp(x - x.max()).sum())
        assert lp == pytest.approx(want[tok]) and len(top) == 2
        assert [i for i, _ in top] == list(np.argsort(-want)[:2])
        ctx.append(tok)
    assert len(g.logprobs) >= len(toks)


class ParityGrammar:
    """A toy grammar on the mock's tokens: after token a, token b may follow when a + b is odd;
    the loop's grammar interface (allows, mask, accept, clone, close)."""

    def __init__(self, last=1):
        self.last = last

    def allows(self, tokens):
        return np.array([(self.last + t) % 2 == 1 for t in tokens])

    def mask(self, logits):
        x = np.asarray(logits, np.float64).copy()
        x[~self.allows(range(len(x)))] = -np.inf
        return x

    def accept(self, token):
        self.last = token

    def clone(self):
        return ParityGrammar(self.last)

    def close(self):
        pass


@pytest.mark.parametrize("k", [1, 4])
def test_grammar_constrained_speculation_equals_constrained_plain_decoding(k):
    """Every emitted token obeys the grammar; drafts that break it are cut before
    verification; greedy output equals constrained decoding without a draft."""
    t = MockTarget(seed=8)
    plain = Generation(t, [1, 2], SamplingParams(), max_tokens=40, grammar=ParityGrammar(2))
    want = [tok for tok, _ in plain]
    g = Generation(t, [1, 2], SamplingParams(), max_tokens=40, drafter=NoisyOracle(t, err=0.5),
                   policy=FixedK(k), grammar=ParityGrammar(2))
    got = [tok for tok, _ in g]
    assert got == want
    assert all((a + b) % 2 == 1 for a, b in zip([2] + got, got))
    assert g.stats.drafted < g.stats.draft_steps  # some drafts broke the grammar and were cut


def test_grammar_constrained_sampling_keeps_the_constrained_law():
    from mock import SamplingDrafter, assert_joint_law

    sp_kw = {"temperature": 1.0}
    n, counts = 3000, {}
    for seed in range(n):
        t = MockTarget(vocab=6, seed=11, sharp=1.0)
        g = Generation(t, [1, 2], SamplingParams(seed=seed, **sp_kw), max_tokens=2,
                       drafter=SamplingDrafter(6, seed=10**6 + seed), policy=FixedK(2),
                       grammar=ParityGrammar(2))
        key = tuple(tok for tok, _ in g)
        counts[key] = counts.get(key, 0) + 1
    assert_joint_law(counts, n, sp_kw, grammar=ParityGrammar)


def boost_last(ids, scores):
    """A logits processor that depends on the prefix: the token equal to the last one gains 2."""
    out = scores.copy()
    out[int(ids[-1]) % len(out)] += 2.0
    return out


@pytest.mark.parametrize("k", [0, 3])
def test_logits_processors_see_every_token_before_the_choice(k):
    """Greedy: each verified row's processor call sees the prompt, the emitted tokens and the
    drafts before that row, so speculative output equals a plain loop applying it."""
    t = MockTarget(seed=9, sharp=1.0)
    ctx = [1, 2]
    for _ in range(30):
        ctx.append(int(np.argmax(boost_last(ctx, t.logits_after(ctx).astype(np.float32)))))
    g = Generation(t, [1, 2], SamplingParams(logits_processor=[boost_last]), max_tokens=30,
                   drafter=NoisyOracle(t, err=0.3) if k else None, policy=FixedK(k))
    assert [tok for tok, _ in g] == ctx[2:]
    assert ctx[2:] != plain_greedy(MockTarget(seed=9, sharp=1.0), [1, 2], 30)  # it did something


def test_logits_processors_keep_the_sampling_law():
    sp_kw = {"temperature": 0.9, "logits_processor": [boost_last]}
    n, counts = 3000, {}
    for seed in range(n):
        t = MockTarget(vocab=6, seed=11, sharp=1.0)
        g = Generation(t, [1, 2], SamplingParams(seed=seed, **sp_kw), max_tokens=2,
                       drafter=NoisyOracle(t, err=0.5, seed=10**6 + seed), policy=FixedK(2))
        key = tuple(tok for tok, _ in g)
        counts[key] = counts.get(key, 0) + 1
    assert_joint_law(counts, n, sp_kw)


@pytest.mark.parametrize("k", [0, 4])
@pytest.mark.parametrize("n", [1, 3, 5])
def test_stopping_criteria_end_before_the_token_they_refuse(k, n):
    """As llama-cpp-python: criteria(ids before the new token, its logits) -> True ends the
    generation ("stop") without that token; drafts past it are not emitted either, the accepted
    ones before it are (n = 1 and 3 refuse a token inside a step of perfect drafts)."""
    t = MockTarget(seed=4)
    seen = []

    def after_n(ids, logits):
        seen.append((len(ids), logits.dtype, logits.shape))
        return len(ids) >= 3 + n

    g = Generation(t, [1, 2, 3], SamplingParams(), max_tokens=40, stopping=after_n,
                   drafter=NoisyOracle(t, err=0.0) if k else None, policy=FixedK(k))
    pieces = list(g)
    assert [tok for tok, _ in pieces] == plain_greedy(MockTarget(seed=4), [1, 2, 3], n)
    assert "".join(p for _, p in pieces) == g.text and len(g.text) == n
    assert g.stats.finish_reason == "stop"
    assert seen[0] == (3, np.float32, (12,)) and seen[-1][0] == 3 + n


@pytest.mark.parametrize("rows", [2, 3])
def test_exact_mode_caps_verify_rows_and_prefills_like_llama_cpp(rows):
    """Where the engine's decodes keep one-token numbers up to `rows` tokens, greedy
    verification never sends more, the whole prompt is prefilled with its last row's logits
    choosing the first token, and the stats say the run is exact; sampling is never exact."""
    t = MockExact(rows=rows, seed=7)
    g = Generation(t, [1, 2, 3], SamplingParams(), max_tokens=40, drafter=NoisyOracle(t, err=0.0),
                   policy=FixedK(6))
    assert [tok for tok, _ in g] == plain_greedy(MockTarget(seed=7), [1, 2, 3], 40)
    assert g.stats.exact and max(t.batches) == rows and t.prefills == [[1, 2, 3]]
    assert g.stats.mean_accepted > rows - 0.5  # perfect drafts, `rows` tokens a pass
    again = Generation(t, [1, 2, 3], SamplingParams(), max_tokens=5)  # prompt cached: replay one
    assert [tok for tok, _ in again] == plain_greedy(MockTarget(seed=7), [1, 2, 3], 5)
    assert t.prefills[-1] == [3] and again.stats.prompt_reused == 2
    assert not Generation(t, [1, 2], SamplingParams(temperature=0.8, seed=1), max_tokens=4).stats.exact
    assert not Generation(MockExact(rows=1), [1, 2], SamplingParams(), max_tokens=4).stats.exact


@pytest.mark.parametrize("stream_stop", [None, ["ca"]])
def test_streamed_logprobs_join_to_the_non_streamed_ones(stream_stop):
    """Completion and chat streams carry each chunk's tokens' logprobs (llama-cpp-python's
    format); over the whole stream they are the non-streamed response's, text offsets too."""
    from edgespec.runtime.api import SpeculativeLlama

    llm = SpeculativeLlama(MockTarget(vocab=26, seed=7, n_ctx=256), draft="lookup")
    kw = dict(temperature=0, max_tokens=24, logprobs=2, stop=stream_stop)
    whole = llm.create_completion("abcab", **kw)["choices"][0]
    chunks = list(llm.create_completion("abcab", stream=True, **kw))
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    for field in ("tokens", "text_offset", "token_logprobs", "top_logprobs"):
        assert [x for p in parts for x in p[field]] == whole["logprobs"][field]
    msgs = [{"role": "user", "content": "abc"}]
    chat = llm.create_chat_completion(messages=msgs, temperature=0, max_tokens=12, logprobs=True,
                                      top_logprobs=2)["choices"][0]["logprobs"]["content"]
    streamed = [x for c in llm.create_chat_completion(messages=msgs, temperature=0, max_tokens=12,
                                                      logprobs=True, top_logprobs=2, stream=True)
                if c["choices"][0]["logprobs"] for x in c["choices"][0]["logprobs"]["content"]]
    assert streamed == chat and len(chat) == 12
