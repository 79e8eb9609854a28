"""The sampling chain against llama.cpp's own samplers (the libllama llama-cpp-python loads,
no model needed): logit bias, penalties, top-k, typical, top-p, min-p and temperature, in the
order llama-cpp-python chains them, give the same distribution as `probs`."""

import ctypes

import numpy as np
import pytest

from edgespec.errors import EdgespecError
from edgespec.runtime.sampling import SamplingParams, adjusted, chain, probs, sample

lc = pytest.importorskip("llama_cpp")

V = 300


def llama_cpp_distribution(logits: np.ndarray, sp: SamplingParams, recent: list[int]) -> np.ndarray:
    """llama.cpp's chain as llama-cpp-python builds it, applied to `logits`; the distribution
    its final draw would use."""
    V = logits.size
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    bias = sp.logit_bias or {}
    arr = (lc.llama_logit_bias * len(bias))(*[lc.llama_logit_bias(t, b) for t, b in bias.items()])
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_logit_bias(V, len(bias), arr))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_penalties(
        V, sp.penalty_last_n, sp.repeat_penalty, sp.frequency_penalty, sp.presence_penalty))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(sp.top_k))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_typical(sp.typical_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(sp.top_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(sp.min_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(sp.temperature))
    for tok in recent:
        lc.llama_sampler_accept(chain, tok)
    data = (lc.llama_token_data * V)(*[lc.llama_token_data(i, float(x), 0.0) for i, x in enumerate(logits)])
    cur = lc.llama_token_data_array(ctypes.cast(data, ctypes.POINTER(lc.llama_token_data)), V, -1, False)
    lc.llama_sampler_apply(chain, ctypes.byref(cur))
    ids = np.array([cur.data[i].id for i in range(cur.size)])
    kept = np.array([cur.data[i].logit for i in range(cur.size)], np.float32)
    lc.llama_sampler_free(chain)
    out = np.zeros(V)
    live = np.isfinite(kept)
    # the weights llama.cpp's dist sampler draws with: expf(logit - max), in float32
    out[ids[live]] = np.exp(kept[live] - kept[live].max())
    return out / out.sum()


CASES = {
    "temperature": dict(temperature=0.7),
    "llama-cpp-python defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "top-p before temperature": dict(temperature=0.3, top_p=0.6),
    "min-p": dict(temperature=1.2, min_p=0.2),
    "typical": dict(temperature=0.9, typical_p=0.5),
    "penalties": dict(temperature=0.8, repeat_penalty=1.3, frequency_penalty=0.4,
                      presence_penalty=0.6, penalty_last_n=8),
    "logit bias": dict(temperature=0.8, logit_bias={3: 5.0, 7: -100.0, 11: 2.5}),
    "all": dict(temperature=0.6, top_k=60, typical_p=0.9, top_p=0.9, min_p=0.02, repeat_penalty=1.2,
                frequency_penalty=0.1, presence_penalty=0.2, logit_bias={5: 3.0}),
}


@pytest.mark.parametrize("name", CASES)
def test_probs_is_llama_cpps_sampler_chain(name):
    rng = np.random.default_rng(len(name))
    logits = (rng.normal(size=V) * 3).astype(np.float32)
    top = [int(t) for t in np.argsort(-logits)[:3]]  # penalties must hit likely tokens
    recent = [int(t) for t in rng.integers(0, 40, size=20)] + top + [top[0], 3, 3, 5]
    sp = SamplingParams(**CASES[name])
    ours, theirs = probs(logits, sp, recent), llama_cpp_distribution(logits, sp, recent)
    assert set(np.flatnonzero(ours)) == set(np.flatnonzero(theirs))
    np.testing.assert_allclose(ours, theirs, atol=2e-5)
    if sp.repeat_penalty != 1.0:  # the recent tokens matter: the check would see them ignored
        assert np.abs(probs(logits, sp) - theirs).max() > 1e-3


WIDE = {  # rows whose survivors lie far below the top logit: the chain's first pass widens
    "top-k wider than the first margin": dict(temperature=0.8, top_k=400),
    "top-p alone, flat tail": dict(temperature=1.0, top_p=0.9),
    "top-p and a tiny min-p": dict(temperature=0.7, top_p=0.99, min_p=1e-7),
    "min-p alone, tiny": dict(temperature=1.0, min_p=1e-6),
    "defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
}


@pytest.mark.parametrize("name", WIDE)
@pytest.mark.parametrize("spread", [1.0, 12.0])
def test_the_truncating_chain_on_a_large_vocabulary(name, spread):
    """20,000 tokens with logits spread thin (1) or wide (12): the survivors found by the
    margins are llama.cpp's, whether they sit within 8 logits of the top or far below it."""
    rng = np.random.default_rng(len(name) + int(spread))
    logits = (rng.standard_t(3, size=20000) * spread).astype(np.float32)
    sp = SamplingParams(**WIDE[name])
    theirs = llama_cpp_distribution(logits, sp, [])
    ours = probs(logits, sp)
    assert set(np.flatnonzero(ours)) == set(np.flatnonzero(theirs))
    np.testing.assert_allclose(ours, theirs, atol=2e-5)


def test_chain_keeps_only_the_survivors_and_draws_from_them():
    logits = np.full(262144, -5.0, np.float32)
    logits[[7, 70000, 262143]] = [3.0, 2.5, 2.0]
    d = chain(logits, SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05))
    assert sorted(d.ids.tolist()) == [7, 70000, 262143]  # min-p drops the -5 tail
    rng = np.random.default_rng(0)
    seen = {d.draw(rng) for _ in range(200)}
    assert seen == {7, 70000, 262143}
    np.testing.assert_allclose(d.p.sum(), 1.0)
    assert d.prob(7) > d.prob(70000) > d.prob(262143) > 0 and d.prob(8) == 0


def test_greedy_takes_the_argmax_of_the_biased_penalised_logits():
    logits = np.array([5.0, 4.0, 1.0, -2.0])
    assert sample(logits, SamplingParams(), None, [0]) == 0  # no penalty asked: the argmax
    sp = SamplingParams(repeat_penalty=2.0)  # 5 / 2 < 4: the repeated token loses
    assert sample(logits, sp, None, [0]) == 1 and sample(logits, sp, None, [2]) == 0
    assert sample(logits, SamplingParams(logit_bias={3: 10.0}), None, []) == 3
    np.testing.assert_allclose(adjusted(logits, SamplingParams(repeat_penalty=2.0), [3, 0]),
                               [2.5, 4.0, 1.0, -4.0])  # positive divided, negative multiplied


def test_bad_sampling_settings_are_clear_errors():
    for bad in (dict(min_p=2.0), dict(typical_p=0.0), dict(repeat_penalty=0.0),
                dict(frequency_penalty=float("nan")), dict(logit_bias={"x": 1}),
                dict(penalty_last_n=-1)):
        with pytest.raises(EdgespecError):
            SamplingParams(**bad)


@pytest.mark.parametrize("seed", [0, 1, 42, 2 ** 31, 4_000_000_000])
def test_draws_are_llama_cpps_dist_sampler(seed):
    """LlamaDraws + Dist.pick choose what llama.cpp's own chain (llama-cpp-python's defaults,
    its dist sampler seeded with `seed`) chooses, token for token over 40 draws."""
    from edgespec.runtime.sampling import LlamaDraws

    rng = np.random.default_rng(seed % 1000)
    rows = [(rng.normal(size=V) * 2.5).astype(np.float32) for _ in range(40)]
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed)
    ch = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    for s in (lc.llama_sampler_init_top_k(40), lc.llama_sampler_init_typical(1.0, 1),
              lc.llama_sampler_init_top_p(0.95, 1), lc.llama_sampler_init_min_p(0.05, 1),
              lc.llama_sampler_init_temp(0.8), lc.llama_sampler_init_dist(seed)):
        lc.llama_sampler_chain_add(ch, s)
    theirs = []
    for row in rows:
        data = (lc.llama_token_data * V)(*[lc.llama_token_data(i, float(x), 0.0) for i, x in enumerate(row)])
        cur = lc.llama_token_data_array(ctypes.cast(data, ctypes.POINTER(lc.llama_token_data)), V, -1, False)
        lc.llama_sampler_apply(ch, ctypes.byref(cur))
        theirs.append(cur.data[cur.selected].id)
    lc.llama_sampler_free(ch)
    draws = LlamaDraws(seed)
    ours = [chain(row, sp).pick(draws[i]) for i, row in enumerate(rows)]
    assert ours == theirs
    assert len(set(ours)) > 3  # it sampled, not argmax
