"""Integration: the real Gemma 3 270M on llama.cpp, and the same weights in torch."""

import numpy as np
import pytest

pytestmark = pytest.mark.integration

PROMPT = "The history of the Roman Empire"


@pytest.fixture(scope="module")
def llama():
    from edgespec.runtime.llama_target import LlamaTarget

    return LlamaTarget("gemma3-270m", n_ctx=2048)


def greedy_steps(t, prompt_ids, n):
    """Plain greedy, one token per decode; returns tokens, hidden states, logits per step."""
    t.reset()
    t.prefill(prompt_ids[:-1])
    pending, toks, hid, logit_rows = prompt_ids[-1], [], [], []
    for _ in range(n):
        lg, h = t.decode([pending], hidden=True)
        pending = int(np.argmax(lg[0]))
        toks.append(pending)
        hid.append(h[0])
        logit_rows.append(lg[0])
    return toks, np.stack(hid), np.stack(logit_rows)


def test_spec_and_tokens(llama):
    assert llama.n_vocab == 262144 and llama.n_embd == 640
    ids = llama.tokenize(PROMPT)
    assert ids[0] == llama.spec.bos_id
    assert llama.detokenize(ids[1:]) == PROMPT
    assert llama.is_eog(llama.spec.eos_id)


def test_llama_and_torch_agree(llama):
    """llama.cpp's greedy continuation (16 tokens), fed to torch: torch's argmax agrees at >= 15
    positions, and where not, llama.cpp's token is within 0.5 of torch's top logit (two engines'
    arithmetic: the batch-invariant llama.cpp build parts from torch at one near-tie here);
    final hidden states with cosine >= 0.99."""
    torch = pytest.importorskip("torch")
    from edgespec.training.torch_target import forward_hidden, load_torch_target

    ids = llama.tokenize(PROMPT)
    toks, hid, _ = greedy_steps(llama, ids, 16)
    model = load_torch_target("gemma3-270m")
    logits, th = forward_hidden(model, torch.tensor([ids + toks]))
    n = len(ids)
    rows = logits[0, n - 1:-1]
    top = rows.argmax(-1).tolist()
    assert sum(a == b for a, b in zip(top, toks)) >= 15, (top, toks)
    for i, (a, b) in enumerate(zip(top, toks)):
        assert a == b or float(rows[i, a] - rows[i, b]) < 0.5, (i, float(rows[i, a] - rows[i, b]))
    th = th[0, n - 1:-1].numpy()
    cos = (th * hid).sum(1) / np.linalg.norm(th, axis=1) / np.linalg.norm(hid, axis=1)
    assert cos.min() >= 0.99, cos


def test_batched_decode_matches_hidden_and_last_only_logits(llama):
    ids = llama.tokenize(PROMPT)
    toks, hid, rows = greedy_steps(llama, ids, 6)
    llama.reset()
    llama.prefill(ids[:-1])
    lg, h = llama.decode([ids[-1]] + toks[:5], hidden=True)
    assert lg.shape == (6, 262144) and h.shape == (6, 640)
    assert [int(x) for x in lg.argmax(1)] == toks
    cos = (h * hid).sum(1) / np.linalg.norm(h, axis=1) / np.linalg.norm(hid, axis=1)
    assert cos.min() > 0.999
    llama.truncate(len(ids) - 1)
    last, none = llama.decode([ids[-1]] + toks[:5], hidden=False, all_logits=False)
    assert last.shape == (1, 262144) and none is None
    assert int(last[0].argmax()) == toks[5]


def _kl(p_logits, q_logits):
    lp = p_logits.astype(np.float64) - p_logits.max()
    lp -= np.log(np.exp(lp).sum())
    lq = q_logits.astype(np.float64) - q_logits.max()
    lq -= np.log(np.exp(lq).sum())
    return float((np.exp(lp) * (lp - lq)).sum())


def _rollback_kls(llama, fresh, ids, start, steps, rng, stale_once=False):
    """KL(plain decode || decode after verify passes with rejected drafts), per step."""
    llama.reset()
    llama.prefill(ids[:start])
    fresh.reset()
    fresh.prefill(ids[:start])
    kls = []
    for pos in range(start, start + steps):
        junk = [int(x) for x in rng.integers(1000, 200000, int(rng.integers(1, 8)))]
        got, _ = llama.decode([ids[pos]] + junk)  # a verify pass whose drafts are all wrong
        want, _ = fresh.decode([ids[pos]])  # the same prefix, one token at a time, no rollback
        kls.append(_kl(want[0], got[0]))
        llama.truncate(pos + 1 + int(stale_once and pos == start))
    return np.array(kls)


def test_rollback_past_sliding_window_matches_fresh_decode(llama):
    """Past the 512-token window, many rollbacks: logits match a fresh decode of the prefix.

    Batched and single-token decodes differ a little in llama.cpp, so the check is on
    KL divergence; one stale token left in the cache (the negative control) is caught.
    """
    from edgespec.runtime.llama_target import LlamaTarget

    rng = np.random.default_rng(0)
    text = " ".join(f"item {i} costs {int(x)} coins;" for i, x in enumerate(rng.integers(1, 999, 200)))
    ids = llama.tokenize(text)[:700]
    assert len(ids) == 700
    fresh = LlamaTarget("gemma3-270m", n_ctx=2048)
    ok = _rollback_kls(llama, fresh, ids, 600, 40, rng)
    bad = _rollback_kls(llama, fresh, ids, 600, 40, rng, stale_once=True)
    fresh.close()
    assert np.median(ok) < 1e-4 and ok.max() < 0.03, ok
    assert np.median(bad) > 3e-4 or bad.max() > 0.05, bad  # the check can fail


def test_deep_rollback_redecodes(llama):
    """Rolling back further than the sliding-window cache holds falls back to re-decoding."""
    ids = llama.tokenize(" ".join(f"w{i}" for i in range(1500)))[:1400]
    llama.reset()
    llama.prefill(ids)
    before = llama.n_redecodes
    llama.truncate(300)
    assert llama.n_redecodes == before + 1 and llama.tokens == ids[:300]
    got, _ = llama.decode([ids[300]])
    llama.reset()
    llama.prefill(ids[:300])
    want, _ = llama.decode([ids[300]])
    assert _kl(want[0], got[0]) < 1e-3


def test_tensor_rows_dot_rows_matches_dequantized_rows(llama):
    """The Q8_0 fast path of TensorRows.dot_rows (the low-rank LM head's exact rescoring) gives
    the dot products of the dequantized rows."""
    from edgespec.gguf_meta import TensorRows, read_header

    rows = TensorRows(read_header(llama.spec.path), "token_embd.weight")
    assert rows.qtype.name == "Q8_0"
    idx = np.random.default_rng(0).integers(0, rows.n_rows, (3, 40))
    x = np.random.default_rng(1).normal(size=(3, rows.n_cols)).astype(np.float32)
    want = np.einsum("tmk,tk->tm", rows[idx.ravel()].reshape(3, 40, -1), x)
    np.testing.assert_allclose(rows.dot_rows(idx, x), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("probe", [True, False])
def test_prefill_hidden_reads_the_last_rows_from_the_prompts_own_batches(probe):
    """`prefill_hidden` (the head's prompt rows): the same rows as decoding the rest of the
    prompt and then those rows apart, up to batch rounding, with the cache holding the whole
    prompt after; the rows may span n_batch chunks."""
    from edgespec.runtime.engine import Engine
    from edgespec.runtime.llama_target import LlamaTarget

    eng = LlamaTarget("smollm2-135m", n_ctx=256, n_batch=16, lm_head="full", probe=probe)
    try:
        ids = eng.tokenize("The history of the city begins with a small village on the river, " * 3)
        assert len(ids) > 40
        eng.reset()
        apart = Engine.prefill_hidden(eng, ids, 20)
        eng.reset()
        got = eng.prefill_hidden(ids, 20)
        assert eng.tokens == ids and got.shape == apart.shape == (20, eng.n_embd)
        cos = (got * apart).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(apart, axis=1)
        assert cos.min() > 0.99
        lg, _ = eng.decode([ids[0]], all_logits=False)  # the cache goes on from there
        assert np.isfinite(lg).all() and len(eng.tokens) == len(ids) + 1
    finally:
        eng.close()
