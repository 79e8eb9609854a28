"""The low-rank LM head on llama.cpp: hidden states read through the eval callback (the LM head
skipped), candidates from the int8 low-rank scores, their logits as llama.cpp computes them."""

import subprocess
import sys

import numpy as np
import pytest

from edgespec.errors import EdgespecError

pytestmark = pytest.mark.integration

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


@pytest.fixture(scope="module")
def engines():
    from edgespec.runtime.llama_target import LlamaTarget

    full = LlamaTarget("gemma3-270m", n_ctx=1024, lm_head="full")
    lr = LlamaTarget("gemma3-270m", n_ctx=1024, lm_head="lowrank", spec=full.spec)
    yield full, lr
    full.close()
    lr.close()


def test_probe_hidden_states_equal_embeddings_and_keep_the_cache(engines):
    """hidden_states() stops the graph after the output norm: the rows equal llama.cpp's
    embeddings-mode output, and the KV cache written by that cut-short decode is whole (the next
    decode's logits equal those of an engine that ran the full graph)."""
    full, lr = engines
    ids = full.tokenize(PROMPT)
    for e in (full, lr):
        e.reset()
        e.prefill(ids[:4])
    _, want = full.decode(ids[4:-1], hidden=True)
    got = lr.hidden_states(ids[4:-1])
    assert got.shape == want.shape == (len(ids) - 5, full.n_embd)
    np.testing.assert_array_equal(got, want)
    a, _ = full.decode(ids[-1:], all_logits=True)
    b, _ = lr.decode(ids[-1:], all_logits=True)  # not top_only: llama.cpp's full LM head
    np.testing.assert_array_equal(a, b)


def test_probe_gate_reads_what_the_probe_alone_reads(engines, monkeypatch):
    """The C gate in front of the probe (runtime/probe_gate.py) is built here (a C compiler is
    part of the setup) and changes nothing read: an engine whose probe answers every tensor in
    Python gives the same final hidden states, layer keys and values, prompt rows and low-rank
    tops, bit for bit; and while nothing is read the gate keeps the graph whole (llama.cpp's
    own logits, as an engine without the probe computes them)."""
    from edgespec.runtime import probe_gate
    from edgespec.runtime.llama_target import LlamaTarget

    full, lr = engines
    assert probe_gate.gate_library() is not None and lr._gate is not None
    monkeypatch.setattr(probe_gate, "gate_library", lambda: None)
    alone = LlamaTarget("gemma3-270m", n_ctx=1024, lm_head="lowrank", spec=full.spec)
    try:
        assert alone._gate is None
        ids = full.tokenize(PROMPT)
        reads = []
        for e in (lr, alone):
            e.reset()
            e.prefill(ids[:3])
            rows = e.prefill_hidden(ids[3:12], 4)
            top, hid = e.decode(ids[12:15], hidden=True, top_only=True)
            e.set_kv_layers((16, 17))
            _, kv = e.decode(ids[15:18], hidden=True)
            e.set_kv_layers(())
            logits, _ = e.decode(ids[18:20], all_logits=True)
            reads.append((rows, hid, np.argmax(top, axis=1), kv, logits))
        full.reset()  # the same batches through llama.cpp's whole graph, no probe
        full.prefill(ids[:3])
        for a, b in ((3, 12), (12, 15), (15, 18)):
            full.decode(ids[a:b])
        want, _ = full.decode(ids[18:20], all_logits=True)
        for a, b in zip(*reads):
            np.testing.assert_array_equal(a, b)
        assert reads[0][3].shape == (3, lr.n_embd + 2 * 2 * lr.kv_width)
        np.testing.assert_array_equal(reads[0][4], want)
    finally:
        alone.close()


def test_lowrank_rows_hold_llama_cpp_logits_at_the_candidates(engines):
    """Greedy verification batches: each row is -inf but at its 128 candidates, whose values are
    llama.cpp's logits (activations rounded to Q8_0 as its kernels do), and the top token is
    llama.cpp's at (nearly) every position of a greedy continuation."""
    from edgespec.exporters.lowrank_basis import _greedy

    full, lr = engines
    assert lr.lowrank is not None and lr.draft_k == 6 and full.lowrank is None and full.draft_k == 3
    ids = full.tokenize(PROMPT)
    seq = _greedy(full, ids, 24)
    for e in (full, lr):
        e.reset()
        e.prefill(ids[:-1])
    same = total = 0
    for s in range(len(ids) - 1, len(seq) - 1, 8):
        chunk = seq[s:s + 8]
        a, _ = full.decode(chunk, all_logits=True)
        b, h = lr.decode(chunk, all_logits=True, hidden=True, top_only=True)
        assert h.shape == (len(chunk), full.n_embd)
        finite = np.isfinite(b)
        assert (finite.sum(1) == 128).all()  # this batch's candidates only, none left over
        np.testing.assert_allclose(b[finite], a[finite], atol=2e-3, rtol=1e-4)
        same += int((a.argmax(1) == b.argmax(1)).sum())
        total += len(chunk)
    assert total == len(seq) - len(ids) > 16 and same >= total - 1
    # last-position-only batches give one row
    one, none = lr.decode(seq[-1:], all_logits=False, top_only=True)
    assert one.shape == (1, full.n_vocab) and none is None


def test_basis_file_checks(engines, tmp_path):
    from edgespec.runtime.llama_target import LlamaTarget
    from edgespec.runtime.assets import shipped_basis
    from edgespec.runtime.lowrank import read_basis

    full, _ = engines
    shipped = shipped_basis(full.spec)
    assert shipped is not None
    u = read_basis(shipped, full.spec)
    assert u.shape == (full.n_embd, 256)
    np.testing.assert_allclose(u.T @ u, np.eye(256), atol=2e-2)  # orthonormal (stored as f16)
    other = tmp_path / "other.npz"
    np.savez(other, basis=u, target_fingerprint="0000000000000000")
    with pytest.raises(EdgespecError, match="another target"):
        read_basis(other, full.spec)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    with pytest.raises(EdgespecError, match="not a low-rank basis"):
        read_basis(junk, full.spec)
    with pytest.raises(EdgespecError, match="choose auto, full, lowrank"):
        LlamaTarget("gemma3-270m", lm_head="fastest", spec=full.spec)


def test_export_basis_builds_cached_head_and_checks(tmp_path, monkeypatch):
    """A small basis end to end: calibration writes an orthonormal [E, r] basis for the target,
    the engine builds its int8 scores into the cache once (a second engine reuses them), and the
    check reports agreement with llama.cpp and both cost curves."""
    from edgespec.exporters.lowrank_basis import check_lowrank, export_lowrank_basis
    from edgespec.runtime.llama_target import LlamaTarget
    from edgespec.runtime.lowrank import read_basis
    from edgespec.targets import load_target_spec

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "b.npz"
    r = export_lowrank_basis("gemma3-270m", out, rank=32, n_tokens=512, check=False, log=lambda m: None)
    assert r["rank"] == 32 and r["calibration_tokens"] >= 512
    u = read_basis(out)
    assert u.shape == (640, 32)
    np.testing.assert_allclose(u.T @ u, np.eye(32), atol=2e-2)
    e1 = LlamaTarget("gemma3-270m", n_ctx=256, lm_head=str(out))
    folder = e1.lowrank_head.folder
    assert (folder / "model.onnx").is_file() and (folder / "scores.bin").stat().st_size == 32 * 262144
    mtime = (folder / "scores.bin").stat().st_mtime_ns
    e1.close()
    e2 = LlamaTarget("gemma3-270m", n_ctx=256, lm_head=str(out))
    assert e2.lowrank_head.folder == folder and (folder / "scores.bin").stat().st_mtime_ns == mtime
    e2.close()
    # opened by path instead of by name: the same content, the same cache entry
    from edgespec.targets import resolve_target

    e3 = LlamaTarget(str(resolve_target("gemma3-270m")), n_ctx=256, lm_head=str(out))
    assert e3.lowrank_head.folder == folder
    e3.close()
    res = check_lowrank("gemma3-270m", out, n_prompts=1, max_tokens=8, log=lambda m: None)
    assert res["positions"] == 8 and len(res["ms_full"]) == len(res["ms_lowrank"]) == 8
    # the shipped rank-256 basis finds llama.cpp's own top token (rank 32 is only a smoke test)
    from edgespec.runtime.assets import shipped_basis

    spec = load_target_spec("gemma3-270m")
    shipped = check_lowrank("gemma3-270m", shipped_basis(spec), n_prompts=2, max_tokens=8, log=lambda m: None)
    assert shipped["positions"] == 16 and shipped["top1_agreement_with_llama_cpp"] >= 15 / 16


@pytest.mark.parametrize("argv, msg", [
    (["generate", "--target", "gemma3-270m", "--prompt", "hi", "--lm-head", "fastest"], "choose auto, full"),
    (["export", "lowrank-basis", "gemma3-270m", "--out", "x.txt"], "ends in .npz"),
    (["export", "lowrank-basis", "gemma3-270m", "--out", "x.npz", "--rank", "4"], "--rank must be"),
])
def test_cli_refuses_bad_lowrank_input(argv, msg, tmp_path):
    p = subprocess.run([sys.executable, "-m", "edgespec", *argv], capture_output=True, text=True,
                       cwd=tmp_path)
    assert p.returncode == 2
    assert msg in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_scores_build_into_place_once_and_rank_like_float_scores(tmp_path, monkeypatch):
    """The cache entry appears whole (built in a temp folder, renamed); a second build finds it
    and leaves it alone; the int8 graph's candidates hold the float scores' best; old entries
    are evicted beyond the kept count."""
    import onnxruntime as ort

    from edgespec.cache import built_folder, cache_root
    from edgespec.runtime.lowrank import _build

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "c"))
    rng = np.random.default_rng(0)
    w = rng.normal(size=(300, 16)).astype(np.float32)  # a [V, E] LM head

    class Rows:
        n_rows = 300

        def __getitem__(self, sl):
            return w[sl]

    basis = np.linalg.qr(rng.normal(size=(16, 8)))[0].astype(np.float32)
    spec = type("Spec", (), {"n_embd": 16})
    calls = []

    def build(tmp):
        calls.append(tmp)
        _build(tmp, spec, Rows(), basis, 4)

    folder = built_folder("lowrank", "k1", build)
    first = (folder / "scores.bin").read_bytes()
    assert len(first) == 8 * 300 and folder == cache_root() / "lowrank" / "k1"
    assert built_folder("lowrank", "k1", build) == folder and len(calls) == 1
    assert (folder / "scores.bin").read_bytes() == first
    assert sorted(p.name for p in folder.parent.iterdir()) == ["k1"]  # no temp folder left
    sess = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    h = rng.normal(size=(5, 16)).astype(np.float32)
    cand = sess.run(["candidates"], {"h": h})[0]
    best = ((h @ basis) @ (w @ basis).T).argmax(1)
    assert cand.shape == (5, 4) and all(b in c for b, c in zip(best, cand))
    import os
    import time

    old = time.time() - 1000
    os.utime(folder, (old, old))  # k1 is now the least recently used
    built_folder("lowrank", "k2", build, keep=1)
    assert sorted(p.name for p in folder.parent.iterdir()) == ["k2"]
