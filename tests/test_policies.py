"""Draft-length policies: the cost-aware choice follows measured costs and acceptance."""

import pytest

from edgespec.runtime.decoding import Draft
from edgespec.runtime.policies import PEEK_SEEN, CostAware, PolicyStore


def test_cost_policy_drafts_when_verification_is_cheap_and_drafts_good():
    cheap = CostAware(4, [0.010, 0.011, 0.012, 0.013, 0.014], draft_step_s=0.0005, prior=0.8)
    assert cheap.limit("") == 4
    dear = CostAware(4, [0.010, 0.014, 0.018, 0.022, 0.026], draft_step_s=0.002, prior=0.3)
    ks = [dear.limit("") for _ in range(32)]
    assert ks.count(0) == 30 and ks.count(4) == 2  # only the periodic tries draft (all k)
    assert dear.trim(Draft([1, 2, 3, 4])) == 4  # the last try is verified untrimmed


def test_tries_that_change_nothing_back_off():
    """A source that never pays is tried ever more rarely once the tried pass length is timed
    (three timings): its cost tends to nothing."""
    p = CostAware(3, [0.010, 0.013, 0.016, 0.019], draft_step_s=0.002, prior=0.1,
                  probe_every=4, max_probe_every=32)
    tries = []
    for i in range(200):
        n = p.limit("head")
        if n:
            tries.append(i)
        p.observe_verify(n + 1, [0.010, 0.013, 0.016, 0.019][n])
        p.update(n, 0, "head")
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps[:6] == [4, 4, 8, 16, 32, 32]  # doubling once the tried length is timed
    good = CostAware(3, [0.010, 0.011, 0.012, 0.013], draft_step_s=1e-4, prior=0.1, probe_every=4)
    for _ in range(40):  # tries that get accepted raise the estimate: the source drafts again
        p_n = good.limit("head")
        good.update(p_n, p_n, "head")
    assert good.limit("head") == 3


def test_cost_policy_learns_from_acceptance_and_trims_by_confidence():
    p = CostAware(3, [0.010, 0.013, 0.016, 0.019], draft_step_s=0.001, prior=0.5)
    for _ in range(60):
        p.update(3, 3)  # every draft accepted
    assert p.limit("") == 3
    assert p.trim(Draft([1, 2, 3], conf=[0.95, 0.9, 0.05])) == 2
    for _ in range(200):
        p.update(3, 0)  # every first draft rejected
    assert p.acc[0] < 0.05 and p._best(p.acc) == 0


def test_cost_policy_keeps_apart_estimates_per_draft_source():
    """A mixed drafter: lookup drafts keep being accepted, head drafts rejected. The policy
    still lets lookup draft but holds the head at nothing, bar the periodic tries."""
    p = CostAware(3, [0.010, 0.013, 0.016, 0.019], draft_step_s=0.001, prior=0.5)
    for _ in range(100):
        p.update(3, 3, "lookup")
        p.update(3, 0, "head")
    assert p.limit("lookup") == 3
    assert p.trim(Draft([1, 2, 3], source="lookup")) == 3
    limits = [p.limit("head") for _ in range(32)]
    assert limits.count(0) == 30 and limits.count(3) == 2


def test_the_spec_takes_the_engines_draft_length_when_none_is_given():
    from types import SimpleNamespace

    from edgespec.runtime.spec import SpecConfig

    # sampling verifies with the full LM head: an engine may default to fewer drafts there
    lowrank = SimpleNamespace(draft_k=6, draft_k_sampled=3)
    assert SpecConfig(policy="fixed").make_policy(lowrank, greedy=True).k == 6
    assert SpecConfig(k=2, policy="confidence").make_policy(lowrank, greedy=True).k == 2
    assert SpecConfig(policy="fixed").make_policy(lowrank, greedy=False).k == 3
    assert SpecConfig(k=5).draft_k(lowrank, greedy=True, drafting=False) == 0  # no drafter


def test_verify_cost_is_measured_and_cached_per_lm_head(tmp_path, monkeypatch):
    """Greedy verification with a low-rank LM head costs less than sampling's full head: the
    cost policy measures each with the decode it will get, cached under separate keys in
    edgespec's cache (never the user's), keyed by the model file's content."""
    from types import SimpleNamespace

    from edgespec import cache
    from edgespec.runtime import policies
    from edgespec.runtime.lowrank import LowRankInfo

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    seen = []

    class Engine:
        engine, version, n_threads, tokens = "fake", "1.0", 2, []
        model_file = tmp_path / "t.gguf"
        lowrank = LowRankInfo(256, 128, "token_embd.weight")
        spec = SimpleNamespace(path=str(tmp_path / "t.gguf"))

        def reset(self):
            self.tokens = []

        def prefill(self, ids):
            self.tokens = list(ids)

        def tokenize(self, text):
            return [1, 2, 3]

        def truncate(self, n):
            self.tokens = self.tokens[:n]

        def decode(self, toks, hidden=False, copy=True, top_only=False):
            seen.append(top_only)

    (tmp_path / "t.gguf").write_bytes(b"x")
    eng = Engine()
    policies.measure_verify_cost(eng, 2, repeats=1, top_only=True)
    policies.measure_verify_cost(eng, 2, repeats=1, top_only=False)
    n = len(seen)
    assert set(seen[: n // 2]) == {True} and set(seen[n // 2:]) == {False}
    policies.measure_verify_cost(eng, 2, repeats=1, top_only=False)  # cached: no decode
    assert len(seen) == n
    keys = list(cache.read_json(policies.COST_FILE))
    assert [k.rsplit("|", 1)[1] for k in keys] == ["lowrank-r256-c128", "full"]
    assert all(cache.file_identity(eng.model_file) in k for k in keys)
    # a copy of the same file (another path, same content) finds the same curves
    (tmp_path / "copy.gguf").write_bytes(b"x")
    eng.model_file = tmp_path / "copy.gguf"
    policies.measure_verify_cost(eng, 2, repeats=1, top_only=True)
    assert len(seen) == n
    assert (tmp_path / "cache" / policies.COST_FILE).is_file()


def test_verify_cost_is_learned_robustly_from_the_loops_timings():
    from edgespec.runtime.policies import VerifyCost

    c = VerifyCost([0.010, 0.020, 0.030])
    for _ in range(10):
        c.observe(1, 0.020)  # the machine is twice as busy as the prior says
    assert c[0] == pytest.approx(0.020)
    assert c[1] == pytest.approx(0.040) and c[2] == pytest.approx(0.060)  # unseen: scaled prior
    c.observe(1, 5.0)  # one stall is not the machine
    assert c[0] == pytest.approx(0.020)
    for _ in range(16):  # a lasting change takes over within one window
        c.observe(1, 0.005)
    assert c[0] == pytest.approx(0.005)
    c.observe(9, 1.0)  # lengths past the curve are ignored
    assert len(c.learned()) == 3


def test_learned_curve_is_stored_as_the_next_prior(tmp_path, monkeypatch):
    from edgespec import cache
    from edgespec.runtime.policies import COST_FILE, CostAware, VerifyCost

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    p = CostAware(2, VerifyCost([0.01, 0.02, 0.03], key="k1"), store=PolicyStore("k1|greedy"))
    for _ in range(5):
        p.observe_verify(2, 0.004)
    p.finish()
    stored = cache.read_json(COST_FILE)["k1"]
    assert stored[1] == pytest.approx(0.004) and stored[0] == pytest.approx(0.002)


def _sure_drafts(p, true: list[float], passes: int) -> list[int]:
    """Drive a policy with sure drafts (confidence 0.95, all accepted) whose passes take `true`
    seconds by length; the lengths it verified, pass by pass."""
    ks = []
    for _ in range(passes):
        k = p.limit("")
        n = p.trim(Draft([7] * k, conf=[0.95] * k)) if k else 0
        p.observe_verify(n + 1, true[n])
        p.update(n, n)
        ks.append(n)
    return ks


def test_cost_policy_explores_lengths_its_prior_calls_dear():
    """A prior whose tail is too steep would keep drafts short for ever (no timing of the long
    lengths ever arrives); tries one draft longer every `probe_every` passes time them, and
    the policy moves to the long drafts the machine really pays for."""
    true = [0.010, 0.011, 0.012, 0.013, 0.014]
    p = CostAware(4, [0.010, 0.011, 0.012, 0.060, 0.080], draft_step_s=1e-4, prior=0.9, probe_every=8)
    ks = _sure_drafts(p, true, 80)
    assert ks[0] == 2 and ks[-1] == 4  # short at first, long once the long lengths were timed
    assert p.c[4] == pytest.approx(0.014)


def test_acceptance_carries_over_between_generations(tmp_path, monkeypatch):
    """A new generation starts from the acceptance the last one ended with (same key), not from
    the optimistic prior: drafts that never pay are not retried at every prompt."""
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    costs = [0.010, 0.011, 0.012, 0.013]
    store = PolicyStore("k|sampled")
    first = CostAware(3, costs, draft_step_s=1e-4, state=store.load(), store=store)
    assert first.limit("head") == 3  # optimistic at first
    for _ in range(40):
        first.update(3, 0, "head")
    first.finish()
    second = CostAware(3, costs, draft_step_s=1e-4, state=store.load())
    assert second.acc_for("head")[0] < 0.05 and second.limit("head") == 0
    other = PolicyStore("other")
    assert CostAware(3, costs, draft_step_s=1e-4, state=other.load()).limit("head") == 3


def test_a_memory_store_carries_state_between_its_own_generations_only(tmp_path, monkeypatch):
    """The bench's rows each learn on their own (policies.MemoryStore): a row's next generation
    starts from what its last one learned, another row's and the disk cache's state stay apart,
    and nothing of the acceptance state reaches the cache."""
    from edgespec import cache
    from edgespec.runtime.policies import ACCEPTANCE_FILE, MemoryStore, VerifyCost, make_policy

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    costs = [0.010, 0.011, 0.012, 0.013]
    disk = PolicyStore("k|greedy")
    learned = CostAware(3, costs, draft_step_s=1e-4, store=disk)
    for _ in range(40):
        learned.update(3, 0, "head")
    learned.finish()  # the disk cache now says the head never pays
    row, other = MemoryStore(), MemoryStore()
    first = CostAware(3, costs, draft_step_s=1e-4, state=row.load(), store=row)
    assert first.limit("head") == 3  # a fresh start, not the disk cache's state
    for _ in range(40):
        first.update(3, 3, "head")
    first.finish()
    again = CostAware(3, costs, draft_step_s=1e-4, state=row.load(), store=row)
    assert again.acc_for("head")[0] > 0.95
    assert CostAware(3, costs, draft_step_s=1e-4, state=other.load()).acc_for("head")[0] == 0.8
    assert cache.read_json(ACCEPTANCE_FILE)["k|greedy"]["head"]["acc"][0] < 0.05  # untouched

    class Engine:  # what make_policy's cost measurement reads: a live curve already measured
        def cost_policy(self, k, greedy):
            return None

    monkeypatch.setattr("edgespec.runtime.policies.measure_verify_cost",
                        lambda engine, n, top_only=True: VerifyCost(costs))
    assert make_policy("cost", 3, Engine(), store=row).store is row


def test_try_back_off_carries_over_between_generations(tmp_path, monkeypatch):
    """Short generations must not each start trying a source that never pays afresh (one
    engine's generations share its live cost curve, as `measure_verify_cost` hands out)."""
    from edgespec.runtime.policies import VerifyCost

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    costs = [0.010, 0.013, 0.016, 0.019]
    live = VerifyCost(costs)

    def generation(n_passes):
        store = PolicyStore("k|sampled")
        p = CostAware(3, live, draft_step_s=0.002, prior=0.1, probe_every=4, max_probe_every=64,
                      state=store.load(), store=store)
        tries = 0
        for _ in range(n_passes):
            n = p.limit("head")
            tries += n > 0
            p.observe_verify(n + 1, costs[n])
            p.update(n, 0, "head")
        p.finish()
        return tries

    first = [generation(40) for _ in range(6)]
    assert first[0] >= 3 and sum(first[3:]) <= 2  # backed off, and it stays backed off


def test_a_draft_near_paying_keeps_being_tried():
    """The third draft is accepted about 60% of the time and needs about 68% to pay: the
    estimate sits near the edge, so tries stay frequent instead of backing off for good."""
    import itertools

    costs = [0.010, 0.012, 0.014, 0.017]
    p = CostAware(3, costs, draft_step_s=1e-4, prior=0.95, probe_every=4, max_probe_every=64)
    p.accs[""] = [0.99, 0.99, 0.5]
    outcome = itertools.cycle([3, 2, 3, 2, 3])  # the third draft accepted 3 times in 5
    tries = []
    for i in range(200):
        n = p.limit("")
        if n == 3:
            tries.append(i)
            acc = next(outcome)
        else:
            acc = n
        p.observe_verify(n + 1, costs[n])
        p.update(n, acc)
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert len(tries) > 20 and max(gaps[5:]) <= 8


def test_lengths_no_draft_could_pay_for_are_not_tried_once_timed():
    """When even a perfect draft of more than one token cannot pay at the timed costs, tries
    stop at one token: a try never pays for lengths the machine has shown to be too dear."""
    from edgespec.runtime.policies import VerifyCost

    costs = [0.010, 0.016, 0.060, 0.080]
    c = VerifyCost(costs)
    for n, sec in enumerate(costs, 1):
        for _ in range(3):
            c.observe(n, sec)
    p = CostAware(3, c, draft_step_s=1e-4, prior=0.1, probe_every=4)
    tried = {p.limit("") for _ in range(40)}
    assert tried == {0, 1}


def test_lengths_a_busy_stretch_made_dear_are_timed_again_once_stale():
    """A busy stretch times every length dear; the lengths in use recover within a window, but
    the long ones then look too dear to verify, so no new timing would ever correct them: once
    their timings are STALE passes old they go by their neighbours again, are tried, and the
    policy drafts long once more. With timings that never go stale it stays short."""
    from edgespec.runtime.policies import VerifyCost

    true = [0.010, 0.011, 0.012, 0.013, 0.014]

    def run(stale):
        c = VerifyCost(true)
        c.STALE = stale
        for n in range(1, 6):  # the busy stretch: every length dearer, the long ones most
            for _ in range(16):
                c.observe(n, 3.0 * true[n - 1] + (0.05 if n > 3 else 0.0))
        p = CostAware(4, c, draft_step_s=1e-4, prior=0.9, probe_every=8)
        return _sure_drafts(p, true, 400), p

    stuck, p = run(None)
    assert max(stuck[50:]) <= 2 and p.c[4] > 0.04  # the trap: never long again
    ks, p = run(64)
    assert max(ks[:40]) <= 2  # dear at first: the stretch's timings are fresh
    assert ks[-1] == 4 and p.c[4] == pytest.approx(0.014)  # long again, timed right


def test_soon_says_when_a_held_source_may_draft_again():
    """`soon(source, n)` is true at least n asks before every try (a drafter that reads hidden
    states needs them only then) and false for most passes of a source that never pays."""
    p = CostAware(3, [0.010, 0.013, 0.016, 0.019], draft_step_s=0.002, prior=0.1,
                  probe_every=4, max_probe_every=64)
    lead = 5
    soon, tries = [], []
    for i in range(400):
        soon.append(p.soon("head", lead))
        n = p.limit("head")
        if n:
            tries.append(i)
        p.observe_verify(n + 1, [0.010, 0.013, 0.016, 0.019][n])
        p.update(n, 0, "head")
    assert len(tries) >= 5
    for t in tries:
        assert all(soon[max(0, t - lead + 1):t + 1]), f"try at {t} not announced {lead} asks ahead"
    assert sum(soon) < len(soon) / 3
    good = CostAware(3, [0.010, 0.011, 0.012, 0.013], draft_step_s=1e-4, prior=0.9)
    assert good.soon("head", 1)  # a source that pays drafts now
    never = CostAware(3, [0.010, 0.030, 0.060, 0.090], draft_step_s=0.01, prior=0.5)
    never.c.est = list(never.c.curve)  # timed: no draft could ever pay
    assert never.limit("head") == 0 and not never.soon("head", 1000)


def test_the_policy_learns_what_a_drafters_confidence_is_worth():
    """A head whose drafts say 0.3 but are accepted 9 times in 10 (a distilled head is as unsure
    as its target, while greedy verification only needs the argmax): taken at its word no draft
    pays at these costs; after some verified drafts the policy keeps them. The learned table
    is kept with the acceptance estimates for the next generation."""
    costs = [0.010, 0.015, 0.020, 0.025]
    store = PolicyStore("calib-test")
    p = CostAware(3, costs, draft_step_s=1e-3, state=store.load(), store=store)
    draft = Draft([5, 6, 7], conf=[0.3, 0.3, 0.3], source="head")
    assert p.trim(draft) == 0  # 1.3 tokens in 16 ms is slower than 1 in 10 ms
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(60):
        p.trim(draft)
        hits = [rng.random() < 0.9 for _ in range(3)]
        accepted = next((j for j, h in enumerate(hits) if not h), 3)
        p.update(3, accepted, "head")
    assert p.calibrated("head", [0.3])[0] > 0.8
    assert p.trim(draft) >= 2
    assert p.calibrated("head", [0.95])[0] == 0.95  # a bin no draft fell in keeps the prior
    p.finish()
    again = CostAware(3, costs, draft_step_s=1e-3, state=store.load())
    assert again.calibrated("head", [0.3]) == pytest.approx(p.calibrated("head", [0.3]), abs=0.01)
    assert CostAware(3, costs, draft_step_s=1e-3).trim(draft) == 0  # nothing learned: as before


def test_a_free_scored_source_is_judged_by_its_scores_not_held_back():
    """Prompt lookup costs microseconds and scores its drafts by match length: the policy never
    holds it back before drafting (misses on one-token matches must not stop long copies from
    drafting), trims each draft by what its score band is accepted at, and checks the first
    token of a band it trims away now and then, less often while that band keeps failing."""
    costs = [0.010, 0.015, 0.018, 0.021]
    p = CostAware(3, costs, draft_step_s=1e-3, prior=0.8, probe_every=4, max_probe_every=16)
    weak = Draft([1, 2, 3], conf=[0.34, 0.5, 0.6], source="lookup")
    strong = Draft([4, 5, 6], conf=[0.9, 0.91, 0.92], source="lookup")
    tries = []
    for i in range(30):
        n = p.trim(weak)
        p.observe_draft_time(3e-6, 3, "lookup")
        if n:
            tries.append(i)
        p.update(n, 0, "lookup")  # the weak band's first token is always wrong
    assert p.acc_for("lookup")[0] < 0.5  # by its estimates alone it would be held at zero
    assert p.limit("lookup") == 3  # yet it is asked for whole drafts
    assert p.trim(strong) == 3  # and a long match is verified whole
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert len(tries) >= 2 and gaps == sorted(gaps) and gaps[-1] > tries[0]
    assert p.calibrated("lookup", [0.34])[0] < 0.34  # the band learned it fails
    dear = CostAware(3, costs, draft_step_s=1e-3, prior=0.8)  # a source that costs a step
    head = Draft([1, 2, 3], conf=[0.34, 0.5, 0.6], source="head")
    for _ in range(PEEK_SEEN):  # once its first drafts have been seen (see the peek tests)
        dear.update(dear.trim(head) or 1, 0, "head")
    assert dear.limit("head") == 0  # held back before drafting, as before


def test_drafts_their_scores_trim_away_teach_the_estimate_so_they_stop_being_computed():
    """A head whose confidences say its drafts will not be accepted: each draft is trimmed to
    nothing, and since trimmed drafts are never verified, the acceptance estimates learn what
    the scores expect instead: the policy soon stops asking the head to draft at all (bar the
    periodic tries), so its steps are not computed for nothing."""
    p = CostAware(3, [0.010, 0.013, 0.016, 0.019], draft_step_s=0.002, prior=0.8,
                  probe_every=16)
    asked = []
    for _ in range(64 + PEEK_SEEN):  # the first PEEK_SEEN drafts are seen (peeks) whatever they say
        n = p.limit("head")
        asked.append(n)
        if n:
            drafted = p.trim(Draft([1, 2, 3][:n], conf=[0.05, 0.04, 0.03][:n], source="head"))
            assert drafted in (0, n)  # trimmed to nothing unless a try (verified whole)
            p.update(drafted, 0, "head")
    assert asked[0] > 0 and asked[-16:].count(0) >= 15, asked
    assert sum(1 for n in asked if n) <= 12 + PEEK_SEEN, asked


def test_sampled_drafts_are_verified_as_far_as_their_draws_make_paying_likely():
    """Under sampling a draft stands where the target's draw picks it: a likely token under a
    low draw. Once the policy has seen that (drafts under high draws rejected, under low ones
    accepted), it cuts a chain before its first high draw and verifies a chain of low draws
    whole; greedy drafts (no draws) are judged by their scores alone, as before."""
    p = CostAware(4, [0.010, 0.011, 0.012, 0.013, 0.014], draft_step_s=1e-6, prior=0.6)
    conf = [0.8, 0.8, 0.8, 0.8]
    for i in range(300):  # accepted exactly where the draw is below 0.6
        u = [((i * 7 + j * 3) % 10) / 10 + 0.05 for j in range(4)]
        n = p.trim(Draft([1, 2, 3, 4], conf=conf, source="lookup", u=u))
        n_acc = next((j for j in range(n) if u[j] >= 0.6), n)
        p.update(n, n_acc, "lookup")
    table = p.by_draw["lookup"]
    low, high = table[0][0] / table[0][1], table[4][0] / table[4][1]
    assert low > 0.9 and high < 0.1, table
    assert p.trim(Draft([1, 2, 3, 4], conf=conf, source="lookup", u=[0.1, 0.2, 0.95, 0.1])) == 2
    assert p.trim(Draft([1, 2, 3, 4], conf=conf, source="lookup", u=[0.1, 0.2, 0.1, 0.3])) == 4
    assert p.trim(Draft([1, 2, 3, 4], conf=conf, source="lookup", u=[0.97, 0.1, 0.1, 0.1])) == 0
    greedy = p.trim(Draft([1, 2, 3, 4], conf=conf, source="lookup"))  # no draws: scores alone
    assert greedy == p._best(p.calibrated("lookup", conf), "lookup")
    state = p.state()["lookup"]  # kept for the next generation
    again = CostAware(4, [0.010, 0.011, 0.012, 0.013, 0.014], state={"lookup": state})
    assert again.by_draw["lookup"] == [[round(a, 2), round(n, 2)] for a, n in table]


def _teach_head(p, sure_share, n=400, seed=0):
    """Feed `p` n head drafts as the decode loop would (limit, trim, update): a `sure_share` of
    first drafts at confidence 0.9, accepted 9 times in 10, the rest at 0.15, never accepted.
    Returns the limits asked."""
    import numpy as np

    rng, asked = np.random.default_rng(seed), []
    for _ in range(n):
        k = p.limit("head")
        asked.append(k)
        if not k:
            p.update(0, 0, "head")
            continue
        sure = rng.random() < sure_share
        conf = ([0.9] * k) if sure else ([0.15] * k)
        n_ver = p.trim(Draft([1] * k, conf=conf, source="head"))
        n_acc = next((j for j in range(n_ver) if not (sure and rng.random() < 0.9)), n_ver)
        p.observe_draft_time(1e-3 * k, k, "head")
        p.update(n_ver, n_acc, "head")
    return asked


def test_a_held_head_peeks_where_its_sure_drafts_pay():
    """A head right 9 times in 10 when sure (0.9) and never when unsure (0.15): averaged over
    its drafts, acceptance of the first draft says drafting does not pay at these costs, yet its
    sure drafts do. The policy keeps asking it for a first step (a peek), verifies the sure
    drafts and trims the unsure ones, where a head sure too rarely to win back its step is held
    back as before (bar the periodic tries)."""
    costs = [0.010, 0.015, 0.018, 0.021]
    often = CostAware(3, costs, draft_step_s=1e-3, prior=0.8, probe_every=16)
    asked = _teach_head(often, sure_share=0.35)
    assert often._best(often.acc_for("head"), "head") == 0  # the running estimate says no
    assert sum(1 for k in asked[-100:] if k) >= 95, asked[-100:]  # yet it peeks
    assert often.trim(Draft([1, 2, 3], conf=[0.9, 0.9, 0.9], source="head")) == 3
    assert often.trim(Draft([1, 2, 3], conf=[0.15, 0.15, 0.15], source="head")) == 0
    rare = CostAware(3, costs, draft_step_s=1e-3, prior=0.8, probe_every=16)
    asked = _teach_head(rare, sure_share=0.04)
    assert sum(1 for k in asked[-100:] if k) <= 12, asked[-100:]
    state = often.state()["head"]  # what it saw of first drafts carries to the next generation
    assert sum(state["first"]) >= PEEK_SEEN
    again = CostAware(3, costs, draft_step_s=1e-3, state={"head": state}, probe_every=16)
    again._scored.add("head")
    assert again.limit("head") > 0 and again.first["head"] == state["first"]


def test_a_chain_goes_on_while_a_next_draft_as_sure_would_be_verified():
    """`go_on`: after each draft step of a costly scored source, whether a next draft as sure
    as the last would be verified (its calibrated acceptance); a try drafts whole; a free
    source (prompt lookup) is never asked to stop."""
    costs = [0.010, 0.015, 0.018, 0.021]
    p = CostAware(3, costs, draft_step_s=1e-3, prior=0.8, probe_every=16)
    _teach_head(p, sure_share=0.35)
    assert p.go_on("head", [0.9]) and p.go_on("head", [0.9, 0.9])
    assert not p.go_on("head", [0.9, 0.15])
    p._trying["head"] = (3, 0)
    assert p.go_on("head", [0.9, 0.15])
    p._trying.clear()
    p.trim(Draft([1, 2], conf=[0.2, 0.2], source="lookup"))
    p.observe_draft_time(3e-6, 2, "lookup")
    assert p.go_on("lookup", [0.01])


def test_the_policy_previews_its_trim_and_counts_set_aside_first_drafts():
    """`kept` says what `trim` would verify of a draft with these confidences and changes
    nothing (no draft waits for verification, no first draft counted); `seen` counts a set-aside
    draft's first confidence where the peeks look, as a trimmed one would be."""
    costs = [0.010, 0.015, 0.018, 0.021]
    p = CostAware(3, costs, draft_step_s=1e-3, prior=0.8, probe_every=16)
    _teach_head(p, sure_share=0.35)
    before = (list(p.first["head"]), dict(p._conf), [list(c) for c in p.calib["head"]])
    for conf in ([0.9, 0.9, 0.9], [0.15, 0.15, 0.15], [0.9, 0.15, 0.9]):
        assert p.kept("head", conf) == p.trim(Draft([1] * 3, conf=conf, source="head"))
        p._conf.pop("head")
    p.first["head"] = list(before[0])
    assert p.kept("head", [0.15, 0.15]) == 0 and p.kept("head", [0.9, 0.9]) == 2
    assert (p.first["head"], p._conf, p.calib["head"]) == before
    p.seen("head", [0.15, 0.15])
    low = int(0.15 * 10)
    assert p.first["head"][low] == before[0][low] + 1
    assert sum(p.first["head"]) == sum(before[0]) + 1
    p._trying["head"] = (3, 0)
    assert p.kept("head", [0.15, 0.15, 0.15]) == 3  # a try is verified whole
