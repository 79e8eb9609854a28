"""The decode loop with the real drafters and the cost policy inside it, on the mock target:
the trained-head drafter (numpy head from a checkpoint), the mixed head + lookup drafter,
greedy and sampled, and the cost policy's probes and trimming as the loop applies them."""

import numpy as np
import pytest

from edgespec.runtime.decoding import Draft, Generation
from edgespec.runtime.drafters import HeadDrafter, MixedDrafter, PromptLookup
from edgespec.runtime.formats import HeadConfig
from edgespec.runtime.policies import CostAware, FixedK
from edgespec.runtime.sampling import SamplingParams
from edgespec.targets import load_target_spec
from mock import MockTarget, NoisyOracle, assert_joint_law, write_numpy_checkpoint


class FixedCost(CostAware):
    """The cost policy with the curve and draft-step cost the test gives: the mock's own
    (microsecond, machine-dependent) timings are not what these tests are about."""

    def observe_verify(self, n, seconds):
        pass

    def observe_draft_time(self, seconds, steps, source=""):
        pass
from test_targets import write_tiny_gguf

N_EMBD = 32


@pytest.fixture(scope="module")
def head_ckpt(tmp_path_factory):
    """A tiny target GGUF (its embedding rows feed the head) and a random head trained for it."""
    tmp = tmp_path_factory.mktemp("loop")
    vocab = ("<pad>", "<eos>", "<bos>", *(f"t{i}" for i in range(61)))
    spec = load_target_spec(write_tiny_gguf(tmp / "t.gguf", vocab=vocab, n_embd=N_EMBD))
    c = HeadConfig(n_embd=N_EMBD, n_draft_vocab=12, n_head=2, n_head_kv=1, head_dim=8, n_ff=32,
                   layer_types=["sliding", "global"], sliding_window=8, embed_scale=2.0)
    ckpt = write_numpy_checkpoint(tmp / "head", c, spec.tokenizer_fingerprint, np.arange(12))
    c.n_draft_vocab = 6  # for the 6-token mock of the distribution tests
    small = write_numpy_checkpoint(tmp / "head6", c, spec.tokenizer_fingerprint, np.arange(6))
    return spec, ckpt, small


def plain_greedy(t: MockTarget, prompt, n):
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(int(np.argmax(t.logits_after(ctx))))
    return ctx[len(prompt):]


def counting_resets(drafter):
    """Count resets of the head's own KV cache: one per generation means it stayed complete."""
    head = drafter.head if isinstance(drafter, HeadDrafter) else drafter.head.head
    calls = []
    inner = head.reset
    head.reset = lambda: (calls.append(1), inner())[1]
    return calls


@pytest.mark.parametrize("mixed", [False, True])
def test_head_drafters_in_the_loop_are_lossless_and_feed_every_row(head_ckpt, mixed):
    spec, ckpt, _ = head_ckpt
    t = MockTarget(vocab=12, seed=4, n_embd=N_EMBD)
    head = HeadDrafter(ckpt, spec)
    drafter = MixedDrafter(head, PromptLookup()) if mixed else head
    resets = counting_resets(drafter)
    prompt = [1, 2, 3, 4, 5]
    g = Generation(t, prompt, SamplingParams(), max_tokens=60, drafter=drafter, policy=FixedK(3))
    got = [tok for tok, _ in g]
    assert got == plain_greedy(t, prompt, 60)
    st = g.stats
    assert st.drafted > 0 and st.tokens == st.accepted + st.verify_passes
    assert len(resets) == 1  # only the generation's own reset: no row was ever skipped
    if mixed:  # greedy mock text repeats: lookup drafts are accepted far more than chance
        assert st.accepted / st.drafted > 0.3
    # the passes, drafts and acceptances by source add up to the totals
    rows = st.by_source.values()
    assert [sum(r[i] for r in rows) for i in range(3)] == [st.verify_passes, st.drafted, st.accepted]
    assert set(st.by_source) - {"none"} <= ({"lookup", "lookup1", head.source} if mixed else {head.source})
    assert st.by_source[head.source][1] > 0 or (mixed and st.by_source.get("lookup", [0, 0])[1] > 0)


@pytest.mark.parametrize("sp_kw", [{"temperature": 1.0},
                                   {"temperature": 0.8, "top_k": 4, "top_p": 0.9, "min_p": 0.05}])
def test_head_drafter_sampling_keeps_target_distribution(head_ckpt, sp_kw):
    """When sampling, the head draws its drafts from its own distribution under the request's
    cuts and reports it (q): the rejection rule min(1, p/q), with the residual max(0, p - q),
    must keep the target's joint distribution of the first two tokens (chi-square)."""
    spec, _, ckpt = head_ckpt
    drafter = HeadDrafter(ckpt, spec)
    probe = HeadDrafter(ckpt, spec)
    probe.set_sampling(SamplingParams(seed=0, **sp_kw))
    d = probe.propose([1, 2, 3], np.ones((2, N_EMBD), np.float32), 2)
    assert len(d.tokens) == 2 and all(q is not None and abs(q[1].sum() - 1) < 1e-9 for q in d.q)
    if "top_k" in sp_kw:  # q is cut as the target's p is: at most top_k tokens
        assert all(len(q[0]) <= sp_kw["top_k"] for q in d.q)
    probe.set_sampling(None)
    probe.reset()
    assert all(q is None for q in probe.propose([1, 2, 3], np.ones((2, N_EMBD), np.float32), 2).q)
    n, counts = 3000, {}
    for seed in range(n):
        t = MockTarget(vocab=6, seed=11, sharp=1.0, n_embd=N_EMBD)
        g = Generation(t, [1, 2], SamplingParams(seed=seed, **sp_kw), max_tokens=2, drafter=drafter,
                       policy=FixedK(2))
        key = tuple(tok for tok, _ in g)
        counts[key] = counts.get(key, 0) + 1
    assert_joint_law(counts, n, sp_kw)


@pytest.mark.parametrize("err", [0.5, 1.0])
def test_one_hot_drafts_keep_target_distribution(err):
    """NoisyOracle drafts one-hot (q = None), right or wrong, from its own random stream:
    accepting with p(d) and resampling from p without d keeps the target's law for any such q."""
    sp_kw = {"temperature": 0.8, "top_k": 5}
    n, counts = 3000, {}
    for seed in range(n):
        t = MockTarget(vocab=6, seed=11, sharp=1.0)
        g = Generation(t, [1, 2], SamplingParams(seed=seed, **sp_kw), max_tokens=2,
                       drafter=NoisyOracle(t, err=err, seed=10**6 + seed), policy=FixedK(2))
        key = tuple(tok for tok, _ in g)
        counts[key] = counts.get(key, 0) + 1
    assert_joint_law(counts, n, sp_kw)


@pytest.mark.parametrize("drafter", ["one-hot", "q"])
def test_penalties_bias_and_cuts_keep_the_target_law(drafter):
    """Penalties depend on the tokens before each verified row (drafts included): the
    rejection rule must use each row's own distribution to keep the joint law."""
    from mock import SamplingDrafter

    sp_kw = {"temperature": 0.9, "repeat_penalty": 3.0, "presence_penalty": 0.5,
             "logit_bias": {2: 1.0}, "min_p": 0.05, "top_p": 0.95}
    n, counts = 3000, {}
    for seed in range(n):
        t = MockTarget(vocab=6, seed=11, sharp=1.0)
        d = (NoisyOracle(t, err=0.5, seed=10**6 + seed) if drafter == "one-hot"
             else SamplingDrafter(6, seed=10**6 + seed))  # streams apart from the sampler's
        g = Generation(t, [1, 2], SamplingParams(seed=seed, **sp_kw), max_tokens=2, drafter=d,
                       policy=FixedK(2))
        key = tuple(tok for tok, _ in g)
        counts[key] = counts.get(key, 0) + 1
    assert_joint_law(counts, n, sp_kw)


def test_cost_policy_in_the_loop_probes_when_drafting_does_not_pay():
    """Dear verification and wrong drafts: the loop verifies target-only passes, with a whole
    try (verified whole) every `probe_every` passes or more rarely, so the estimates can
    recover; the drafter is never asked for drafts that would be thrown away."""
    t = MockTarget(seed=2)
    policy = FixedCost(4, [0.010, 0.020, 0.030, 0.040, 0.050], draft_step_s=0.002, prior=0.5,
                       probe_every=8)
    g = Generation(t, [1, 2, 3], SamplingParams(), max_tokens=80, drafter=NoisyOracle(t, err=1.0),
                   policy=policy)
    got = [tok for tok, _ in g]
    assert got == plain_greedy(t, [1, 2, 3], 80)
    st = g.stats
    probes = st.drafted_at[0]  # passes that verified any draft
    assert 1 <= probes <= st.verify_passes // 8 + 1
    assert st.drafted == 4 * probes == st.draft_steps  # whole drafts, verified whole, none wasted


def test_cost_policy_in_the_loop_drafts_fully_when_it_pays_and_trims_by_confidence():
    t = MockTarget(seed=3)
    cheap = [0.010, 0.0101, 0.0102, 0.0103, 0.0104]
    g = Generation(t, [1, 2], SamplingParams(), max_tokens=60, drafter=NoisyOracle(t, err=0.0),
                   policy=FixedCost(4, cheap, draft_step_s=1e-5))
    assert [tok for tok, _ in g] == plain_greedy(t, [1, 2], 60)
    assert g.stats.mean_accepted > 4  # perfect drafts, verified whole: k + 1 per pass

    class Unsure(NoisyOracle):
        """Perfect drafts whose confidence collapses after the second token."""

        def propose(self, context, hidden, k, p_min=0.0, limit=None):
            d = super().propose(context, hidden, k, p_min, limit)
            return Draft(d.tokens, conf=[0.95, 0.95, 0.01, 0.01][:len(d.tokens)], source="head")

    t = MockTarget(seed=3)
    g = Generation(t, [1, 2], SamplingParams(), max_tokens=60, drafter=Unsure(t, err=0.0),
                   policy=FixedCost(4, cheap, draft_step_s=1e-5))
    assert [tok for tok, _ in g] == plain_greedy(t, [1, 2], 60)
    st = g.stats
    assert len(st.drafted_at) == 2  # never more than the two confident drafts verified
    assert st.draft_steps > st.drafted  # the trimmed ones were computed, not verified


class Timed(MockTarget):
    """A mock whose verify pass over n tokens takes (1 + 0.1 n) ms: checking more is cheap."""

    def decode(self, tokens, **kw):
        import time

        time.sleep(0.001 * (1 + 0.1 * len(tokens)))
        return super().decode(tokens, **kw)


def test_cost_policy_forgets_a_poisoned_curve_within_the_run():
    """A curve stored while the machine was busy (every multi-token pass dear) would stop all
    drafting; the loop's own timings replace it and the policy drafts again within the run."""
    t = Timed(seed=3)
    poisoned = [0.0011, 0.050, 0.100, 0.300, 0.060]  # the shape of a curve measured under load
    policy = CostAware(4, poisoned, draft_step_s=1e-5, probe_every=4)
    g = Generation(t, [1, 2], SamplingParams(), max_tokens=120, drafter=NoisyOracle(t, err=0.0),
                   policy=policy)
    got = [tok for tok, _ in g]
    assert got == plain_greedy(t, [1, 2], 120)
    assert all(policy.c[n] < 0.005 for n in range(5))  # learned: every length about 1-1.5 ms
    assert policy.limit("") == 4 and g.stats.mean_accepted > 2.5


@pytest.mark.parametrize("source", ["head", "head:0123abcd"])
def test_a_held_head_reads_no_hidden_states_between_its_tries(head_ckpt, source):
    """Where the head does not pay, the policy holds it at zero between rare tries; the passes
    in between read no hidden states (they cost every pass something on a real engine). Each
    try still sees the right rows: contiguous, each the target's state at its position. The
    same for a head under a name of its own."""
    spec, ckpt, _ = head_ckpt
    t = MockTarget(vocab=12, seed=5, n_embd=N_EMBD)
    head = HeadDrafter(ckpt, spec, source=source)
    seen = []
    chain = head._chain

    def checked(context, hidden, k, p_min, go_on=None):
        pos0 = len(context) - 1 - len(hidden)
        for j, row in enumerate(hidden):  # hidden at m pairs (token m - 1, token m)
            m = pos0 + j
            want = t.proj[context[m - 1] if m else 0, context[m]] + m
            assert np.allclose(row, want), f"row for position {m} is not the target's"
        seen.append(len(hidden))
        return chain(context, hidden, k, p_min, go_on)

    head._chain = checked
    costs = [0.010, 0.013, 0.016, 0.019]
    policy = FixedCost(3, costs, draft_step_s=0.002, prior=0.05, probe_every=4, max_probe_every=64)
    policy.c.est = list(costs)  # every length timed: failed tries back off
    reads = []
    decode = t.decode

    def reading(tokens, hidden=False, **kw):  # rows carry their position (greedy text cycles)
        reads.append(hidden)
        n0 = len(t.tokens)
        logits, hid = decode(tokens, hidden, **kw)
        return logits, None if hid is None else hid + np.arange(n0, n0 + len(tokens))[:, None]

    t.decode = reading
    g = Generation(t, [1, 2, 3, 4], SamplingParams(), max_tokens=300, drafter=head, policy=policy)
    assert [tok for tok, _ in g] == plain_greedy(t, [1, 2, 3, 4], 300)
    st = g.stats
    # every verified draft came from rows it was given (peeks its scores trimmed away too)
    assert seen and 0 < st.drafted_at[0] <= len(seen)
    assert st.hidden_passes == sum(reads[1:])  # (reads[0] is the prompt's rows, none here)
    assert st.hidden_passes < st.verify_passes / 3  # held at zero: mostly no hidden states
    assert {s for s in policy.accs if s.startswith("head")} == {source}  # its estimates, its name


def test_hidden_states_an_engine_computes_anyway_are_always_read(head_ckpt):
    """Greedy passes through the low-rank LM head (or an ONNX target) compute the hidden states
    anyway: the head then keeps a complete cache even while the policy holds it."""
    spec, ckpt, _ = head_ckpt
    t = MockTarget(vocab=12, seed=5, n_embd=N_EMBD)
    asked = []
    t.hidden_free = lambda top_only: (asked.append(top_only), top_only)[1]
    head = HeadDrafter(ckpt, spec)
    costs = [0.010, 0.013, 0.016, 0.019]
    policy = FixedCost(3, costs, draft_step_s=0.002, prior=0.05, probe_every=4, max_probe_every=64)
    policy.c.est = list(costs)
    g = Generation(t, [1, 2, 3, 4], SamplingParams(), max_tokens=200, drafter=head, policy=policy)
    assert [tok for tok, _ in g] == plain_greedy(t, [1, 2, 3, 4], 200)
    assert asked == [True] and g.stats.hidden_passes == g.stats.verify_passes
    assert g.stats.drafted_at  # (how often it drafts is the policy's: tests/test_policies.py)
    t2 = MockTarget(vocab=12, seed=5, n_embd=N_EMBD)
    t2.hidden_free = lambda top_only: top_only  # sampling passes read full logits: not free
    policy = FixedCost(3, costs, draft_step_s=0.002, prior=0.05, probe_every=4, max_probe_every=64)
    policy.c.est = list(costs)
    g = Generation(t2, [1, 2, 3, 4], SamplingParams(temperature=0.8, seed=1), max_tokens=200,
                   drafter=HeadDrafter(ckpt, spec), policy=policy)
    for _ in g:
        pass
    assert g.stats.hidden_passes < g.stats.verify_passes  # not free: read only before tries


def test_each_head_file_drafts_under_a_name_of_its_own(head_ckpt, tmp_path):
    """Two heads benched in one run (or used one after the other) never share acceptance
    estimates: the shipped head drafts as "head", any other head file under a name drawn from
    its path, the same each time it is loaded."""
    import shutil

    from edgespec.runtime.drafters import make_drafter

    spec, ckpt, _ = head_ckpt
    other = tmp_path / "copy"
    shutil.copytree(ckpt, other)
    a, a2, b = make_drafter(str(ckpt), spec), make_drafter(f"head:{ckpt}", spec), make_drafter(str(other), spec)
    assert isinstance(a, MixedDrafter) and isinstance(a2, HeadDrafter)
    assert a.source == a2.source == a.head.source != b.source
    assert a.source.startswith("head:") and a.source != "head"


def test_sampled_text_depends_on_the_seed_not_on_the_drafts():
    """Each token is the target's draw for its position: with the same seed, no drafts, right
    drafts and wrong drafts give the same text; another seed another one."""
    sp = dict(temperature=0.9, top_k=5, top_p=0.95)

    def run(seed, drafter):
        t = MockTarget(vocab=12, seed=3, sharp=1.0)
        d = None if drafter is None else NoisyOracle(t, err=drafter, seed=99)
        g = Generation(t, [1, 2], SamplingParams(seed=seed, **sp), max_tokens=24, drafter=d,
                       policy=FixedK(3 if d else 0))
        return [tok for tok, _ in g], g.stats

    plain, _ = run(5, None)
    for err in (0.0, 0.5, 1.0):
        toks, st = run(5, err)
        assert toks == plain and st.drafted > 0
    assert run(6, None)[0] != plain
