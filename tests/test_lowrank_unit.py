"""The low-rank LM head's parts on a tiny Q8_0 GGUF written here (no real model): exact rows
(TensorRows.dot_rows, with activations rounded to Q8_0 as llama.cpp's kernels do) and
LowRankHead's candidates and their logits."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from edgespec.gguf_meta import TensorRows, read_header
from edgespec.targets import load_target_spec
from test_targets import write_tiny_gguf

V, E = 300, 64


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    vocab = tuple(f"t{i}" for i in range(V))
    emb = np.random.default_rng(0).normal(size=(V, E))
    path = write_tiny_gguf(tmp_path_factory.mktemp("q8") / "t.gguf", vocab=vocab, n_embd=E,
                           token_embd=emb, q8_0=True)
    return load_target_spec(path)


def test_dot_rows_reads_q8_0_blocks_in_place(tiny_q8):
    rows = TensorRows(read_header(tiny_q8.path), "token_embd.weight")
    assert rows.qtype == Q.Q8_0 and (rows.n_rows, rows.n_cols) == (V, E)
    idx = np.random.default_rng(1).integers(0, V, (3, 7))
    x = np.random.default_rng(2).normal(size=(3, E)).astype(np.float32)
    w = rows[idx.ravel()].reshape(3, 7, E)  # dequantized by the gguf package
    np.testing.assert_allclose(rows.dot_rows(idx, x), np.einsum("tmk,tk->tm", w, x), rtol=1e-5, atol=1e-4)
    # q8_x: x rounded to Q8_0 blocks first; the gguf package's own quantizer is the reference
    xq = dequantize(quantize(x, Q.Q8_0), Q.Q8_0)
    got = rows.dot_rows(idx, x, q8_x=True)
    np.testing.assert_allclose(got, np.einsum("tmk,tk->tm", w, xq), rtol=1e-4, atol=1e-3)
    assert not np.allclose(got, rows.dot_rows(idx, x), rtol=1e-6, atol=1e-6)  # it did round


@pytest.mark.parametrize("rank", [E, 16])
def test_lowrank_head_candidates_hold_exact_logits(tiny_q8, tmp_path, monkeypatch, rank):
    """Full rank: the search finds every row's top token. Low rank: each row is -inf but at its
    candidates, which carry the exact (Q8_0-rounded) logits."""
    from edgespec.runtime.lowrank import LowRankHead

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    rows = TensorRows(read_header(tiny_q8.path), "token_embd.weight")
    w = rows[:]
    h = np.random.default_rng(3).normal(size=(20, E)).astype(np.float32)
    basis = np.linalg.eigh(h.T @ h + w.T @ w)[1][:, ::-1][:, :rank].astype(np.float32).copy()
    head = LowRankHead(tiny_q8, basis, candidates=8, log=lambda m: None)
    assert head.info.key == f"lowrank-r{rank}-c8"
    assert head.folder.parent == tmp_path / "cache" / "lowrank"
    out = head.top_logits(h)
    finite = np.isfinite(out)
    assert out.shape == (20, V) and (finite.sum(1) == 8).all()
    exact = rows.dot_rows(np.tile(np.arange(V), (20, 1)), h, q8_x=True)
    np.testing.assert_allclose(out[finite], exact[finite], rtol=1e-5, atol=1e-5)
    if rank == E:
        assert (out.argmax(1) == exact.argmax(1)).all()
    again = LowRankHead(tiny_q8, basis, candidates=8, log=lambda m: None)  # cached: same folder
    assert again.folder == head.folder
