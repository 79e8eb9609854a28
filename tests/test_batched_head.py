"""The batched LM head (runtime/batched_head.py) on tiny GGUF files written here: every row's
logits as llama.cpp computes them (the LM-head blocks as stored, activations rounded to Q8_0
blocks with an f16 scale), for Q8_0 and Q4_0 heads, the same numbers whatever the batch."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from edgespec.errors import EdgespecError
from edgespec.gguf_meta import TensorRows, read_header
from edgespec.runtime.batched_head import BatchedHead, as_llama_rounds, supports
from edgespec.targets import load_target_spec
from test_targets import write_tiny_gguf

V, E = 300, 64


def tiny(tmp_path, quant):
    emb = np.random.default_rng(0).normal(size=(V, E))
    path = write_tiny_gguf(tmp_path / f"{quant or 'f32'}.gguf", vocab=tuple(f"t{i}" for i in range(V)),
                           n_embd=E, token_embd=emb, quant=quant)
    return load_target_spec(path)


def llama_cpp_logits(spec, h: np.ndarray) -> np.ndarray:
    """What llama.cpp's CPU kernels compute: each activation block rounded to Q8_0 (integers
    from the f32 scale, the f16 scale in the product), times the stored weight blocks."""
    w = TensorRows(read_header(spec.path), "token_embd.weight")[:].astype(np.float64)
    x = h.reshape(len(h), -1, 32).astype(np.float32)
    d = np.abs(x).max(-1, keepdims=True) / np.float32(127)
    q = np.rint(np.divide(x, d, out=np.zeros_like(x), where=d > 0))
    xq = (q * d.astype(np.float16).astype(np.float32)).reshape(len(h), -1)
    return xq.astype(np.float64) @ w.T


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_every_row_is_llama_cpps_logits(tmp_path, monkeypatch, quant):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    spec = tiny(tmp_path, quant)
    assert supports(spec)
    head = BatchedHead(spec, log=lambda m: None)
    assert head.folder.parent == tmp_path / "cache" / "batched-head"
    h = np.random.default_rng(1).normal(size=(7, E)).astype(np.float32) * 3
    got = head.logits(h)
    want = llama_cpp_logits(spec, h)
    assert got.shape == (7, V)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-4)
    # the weights really are the stored blocks: with unrounded activations it would differ
    w = TensorRows(read_header(spec.path), "token_embd.weight")[:]
    assert np.abs(got - h @ w.T).max() > 1e-3
    one = np.concatenate([head.logits(h[i:i + 1]) for i in range(len(h))])
    np.testing.assert_array_equal(one, got)  # a row's logits do not depend on the batch


def test_the_f16_scale_is_the_one_llama_cpp_keeps():
    x = np.random.default_rng(2).normal(size=(3, 64)).astype(np.float32)
    xs = as_llama_rounds(x).reshape(3, -1, 32)
    d = np.abs(x.reshape(3, -1, 32)).max(-1) / np.float32(127)
    np.testing.assert_allclose(np.abs(xs).max(-1) / 127, d.astype(np.float16).astype(np.float32), rtol=1e-6)
    # the integers stay llama.cpp's: rounding x / d and xs / f16(d) agree
    np.testing.assert_array_equal(np.rint(x.reshape(3, -1, 32) / d[..., None]),
                                  np.rint(xs / d.astype(np.float16).astype(np.float32)[..., None]))
    xq = dequantize(quantize(x, Q.Q8_0), Q.Q8_0)  # the gguf package's own Q8_0 round trip
    np.testing.assert_allclose(xq, np.rint(xs / d.astype(np.float16).astype(np.float32)[..., None]).reshape(3, -1)
                               * np.repeat(d.astype(np.float16).astype(np.float32), 32, axis=1), rtol=1e-6, atol=1e-7)


def test_other_head_types_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    spec = tiny(tmp_path, None)  # an F32 head
    assert not supports(spec)
    with pytest.raises(EdgespecError, match="F32.*Q8_0 or Q4_0"):
        BatchedHead(spec, log=lambda m: None)


@pytest.mark.integration
def test_gemma_rows_through_the_batched_head_are_llama_cpps():
    """Real Gemma 3 270M: a one-row decode gives llama.cpp's own logits (to float rounding);
    a 4-row verify decode gives each row what llama.cpp's head gives the same hidden state."""
    from edgespec.runtime.llama_target import LlamaTarget

    full = LlamaTarget("gemma3-270m", n_ctx=256, lm_head="full")
    bat = LlamaTarget("gemma3-270m", n_ctx=256, lm_head="batched", spec=full.spec)
    assert bat.batched_head is not None and bat.lowrank_head is None and "onnxruntime" in bat.describe_lm_head(False)
    ids = full.tokenize("The lighthouse keeper climbed the stairs every evening and")
    for e in (full, bat):
        e.reset()
        e.prefill(ids[:-1])
    a, _ = full.decode(ids[-1:])
    b, hb = bat.decode(ids[-1:], hidden=True)
    np.testing.assert_allclose(b, a, atol=1e-3)
    assert hb.shape == (1, bat.n_embd)
    more = full.tokenize(" then he lit the lamp", add_bos=False)[:4]
    rows, h = bat.decode(more, hidden=True)
    assert rows.shape == (4, bat.n_vocab)
    np.testing.assert_allclose(rows, bat.batched_head.logits(h), atol=0)  # the rows the trunk gave
    ref = [TensorRows(read_header(full.spec.path), "token_embd.weight").dot_rows(
        np.argsort(-r)[None, :64], h[i:i + 1], q8_x=True)[0] for i, r in enumerate(rows)]
    for r, want in zip(rows, ref):  # the top 64 of each row, rescored as llama.cpp would
        np.testing.assert_allclose(np.sort(r)[::-1][:64], want, atol=1e-3)


def test_auto_keeps_the_batched_head_only_where_its_one_row_pass_is_no_dearer(monkeypatch):
    """`lm_head="auto"` times a one-row sampled pass through the batched head and through
    llama.cpp's own once per library, model, CPU, threads and import state (an app that
    imported llama_cpp first leaves llama.cpp's OpenMP threads spinning while onnxruntime runs),
    keeps the choice in edgespec's cache, and drops the batched head where it is dearer."""
    import edgespec
    from edgespec.runtime import llama_target as lt

    timed = []

    def fake(self, rounds=12):
        timed.append(rounds)
        return dict(ms)

    monkeypatch.setattr(lt.LlamaTarget, "time_one_row_heads", fake)
    monkeypatch.setattr(edgespec, "GOMP_AT_IMPORT", "preloaded:test-a")
    ms = {"batched": 15.0, "llama.cpp": 12.0}
    dear = lt.LlamaTarget("gemma3-270m", n_ctx=256)
    assert dear.batched_head is None and dear.draft_k_sampled == 3 and timed == [12]
    again = lt.LlamaTarget("gemma3-270m", n_ctx=256, spec=dear.spec)  # the kept choice
    assert again.batched_head is None and timed == [12]
    monkeypatch.setattr(edgespec, "GOMP_AT_IMPORT", "edgespec:test-b")  # another state: timed
    ms = {"batched": 12.4, "llama.cpp": 12.0}
    cheap = lt.LlamaTarget("gemma3-270m", n_ctx=256, spec=dear.spec)
    assert cheap.batched_head is not None and cheap.draft_k_sampled == 6 and len(timed) == 2
    told = lt.LlamaTarget("gemma3-270m", n_ctx=256, spec=dear.spec, lm_head="batched")
    assert told.batched_head is not None and len(timed) == 2  # asked for: never timed


def test_an_engine_without_drafts_samples_as_llama_cpp_does(monkeypatch):
    """With no drafter every pass is one row, which the batched head does not make cheaper:
    `auto` then keeps llama.cpp's own head and C sampler chain (never timing the choice);
    named, the batched head is still loaded."""
    from edgespec.runtime import llama_target as lt
    from edgespec.runtime.generate import open_target
    from edgespec.runtime.sampling import SamplingParams

    monkeypatch.setattr(lt.LlamaTarget, "time_one_row_heads",
                        lambda self, rounds=12: pytest.fail("no choice to time"))
    plain = open_target("gemma3-270m", n_ctx=256, draft=None)
    assert plain.batched_head is None and plain.lowrank is not None
    assert plain.native_sampler(SamplingParams(temperature=0.8, top_k=40), 1) is not None
    told = open_target("gemma3-270m", n_ctx=256, draft=None, lm_head="batched")
    assert told.batched_head is not None


def test_the_one_row_timing_is_real_and_leaves_the_cache_empty():
    from edgespec.runtime.llama_target import LlamaTarget

    e = LlamaTarget("gemma3-270m", n_ctx=256, lm_head="batched")
    ms = e.time_one_row_heads(rounds=3)
    assert set(ms) == {"batched", "llama.cpp"} and all(0 < v < 10_000 for v in ms.values())
    assert e.tokens == [] and e.batched_head is not None


@pytest.mark.parametrize("first", ["llama_cpp", "edgespec"])
def test_edgespec_knows_whether_llama_cpp_came_first(first):
    import subprocess
    import sys

    code = f"import {first}, edgespec; print(edgespec.GOMP_AT_IMPORT)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in __import__("os").environ.items() if k != "GOMP_SPINCOUNT"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("preloaded:" if first == "llama_cpp" else "edgespec:")
