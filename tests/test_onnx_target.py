"""The ONNX target graph: a tiny Gemma 3 (transformers) exported with its KV cache, run by
onnxruntime in chunks past its sliding window and rolled back by slicing the cache, gives the
logits and hidden states of one full forward pass of the torch model."""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from edgespec.exporters.onnx_target import export_graph

    torch.manual_seed(0)
    types = ["sliding_attention", "sliding_attention", "full_attention"]
    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=16, sliding_window=6, layer_types=types,
                           query_pre_attn_scalar=16, max_position_embeddings=128)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0, 0.3)
    spec = SimpleNamespace(arch="gemma3", n_layer=3, n_embd=32, n_head=2, n_head_kv=1,
                           head_dim=16, layer_types=["sliding", "sliding", "global"],
                           sliding_window=6, rope_base_local=10000.0, rope_base_global=1e6)
    path = tmp_path_factory.mktemp("onnx-target") / "model.onnx"
    export_graph(model, spec, path)
    return model, path


def _run(sess, emb, position, kv, n_logits):
    feed = {"inputs_embeds": emb, "position": np.array(position, dtype=np.int64),
            "n_logits": np.array(n_logits, dtype=np.int64)}
    for i in range(3):
        feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = kv[2 * i], kv[2 * i + 1]
    out = sess.run(None, feed)
    return out[0], out[1], out[2:]


def test_onnx_target_chunks_and_rollback_match_one_torch_pass(tiny_onnx):
    import onnxruntime as ort

    model, path = tiny_onnx
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_hidden = model.model(input_ids=ids).last_hidden_state[0].numpy()  # after the norm
        ref_logits = model(ids).logits[0].numpy()
        emb = model.model.embed_tokens(ids)[0].numpy()  # Gemma scales inside
    kv = [np.zeros((1, 1, 0, 16), np.float32)] * 6
    # prefill 9 tokens with the last logits only, then 5 at once (a verify pass), then 6 more
    lg, _, kv = _run(sess, emb[:9], 0, kv, 1)
    np.testing.assert_allclose(lg[0], ref_logits[8], atol=2e-4, rtol=1e-3)
    lg, hid, kv = _run(sess, emb[9:14], 9, kv, 5)
    np.testing.assert_allclose(lg, ref_logits[9:14], atol=2e-4, rtol=1e-3)
    np.testing.assert_allclose(hid, ref_hidden[9:14], atol=2e-4, rtol=1e-3)
    # a rejected draft: feed 3 wrong tokens, roll back by slicing, continue with the real ones
    wrong = emb[[0, 1, 2]]
    _, _, kv_bad = _run(sess, wrong, 14, kv, 3)
    kv = [a[:, :, :14] for a in kv_bad]
    lg, _, kv = _run(sess, emb[14:20], 14, kv, 6)
    np.testing.assert_allclose(lg, ref_logits[14:20], atol=2e-4, rtol=1e-3)
    assert kv[0].shape == (1, 1, 20, 16)


def test_onnx_target_bad_inputs(tmp_path):
    from edgespec.errors import EdgespecError
    from edgespec.exporters.onnx_target import export_onnx_target
    from edgespec.runtime.generate import open_target

    with pytest.raises(EdgespecError, match="unknown --quant"):
        export_onnx_target("gemma3-270m", tmp_path / "x", quant="int3", check=False)
    with pytest.raises(EdgespecError, match="unknown --lm-head"):
        export_onnx_target("gemma3-270m", tmp_path / "x", lm_head="tiny", check=False)
    with pytest.raises(EdgespecError, match="--rank must be a multiple of 32"):
        export_onnx_target("gemma3-270m", tmp_path / "x", rank=100, check=False)
    with pytest.raises(EdgespecError, match="--candidates"):
        export_onnx_target("gemma3-270m", tmp_path / "x", candidates=0, check=False)
    assert not (tmp_path / "x").exists()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "keep.txt").write_text("user data")
    with pytest.raises(EdgespecError, match="not an edgespec ONNX target folder"):
        export_onnx_target("gemma3-270m", tmp_path / "junk", quant="fp32", check=False)
    assert (tmp_path / "junk" / "keep.txt").read_text() == "user data"
    with pytest.raises(EdgespecError, match="not an ONNX target folder"):
        open_target(tmp_path / "junk")  # a folder is taken for an ONNX target


def test_ort_engine_trims_sliding_caches_and_rolls_back_exactly(tiny_onnx, monkeypatch):
    """OrtTarget's own logic (embedding rows, cache trimming on sliding layers, slicing rollback
    and the re-decode when a rollback goes deeper than the kept margin) on the tiny graph."""
    import onnxruntime as ort

    from edgespec.runtime import ort_target

    model, path = tiny_onnx
    monkeypatch.setattr(ort_target, "MARGIN", 2)  # window 6 + 2 kept: trimming happens here
    eng = ort_target.OrtTarget.__new__(ort_target.OrtTarget)
    eng.sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    eng.meta = {"n_head_kv": 1, "head_dim": 16, "embed_scale": float(32 ** 0.5)}
    eng.embed = model.model.embed_tokens.weight.detach().numpy()
    eng.n_layer, eng.sliding, eng.window = 3, [True, True, False], 6
    eng.n_ctx, eng.n_batch, eng.n_redecodes, eng.lowrank = 128, 512, 0, False
    eng.past_names = [f"past_key_values.{i}.{kv}" for i in range(3) for kv in ("key", "value")]
    eng.out_names = ["logits", "hidden"] + [f"present.{i}.{kv}" for i in range(3) for kv in ("key", "value")]
    eng.reset()
    ids = [int(x) for x in torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(2))]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    eng.prefill(ids[:10])
    assert eng.kv[0].shape[2] == 8 and eng.kv[4].shape[2] == 10  # sliding trimmed, global full
    lg, hid = eng.decode(ids[10:14], hidden=True)
    np.testing.assert_allclose(lg, ref[10:14], atol=2e-4, rtol=1e-3)
    assert hid.shape == (4, 32)
    eng.decode([1, 2], all_logits=False)
    eng.truncate(14)  # shallow: slicing
    assert eng.n_redecodes == 0 and eng.tokens == ids[:14]
    lg, _ = eng.decode(ids[14:18])
    np.testing.assert_allclose(lg, ref[14:18], atol=2e-4, rtol=1e-3)
    eng.decode([3, 4, 5, 6])
    eng.truncate(18)  # deeper than the margin: re-decodes the kept tokens
    assert eng.n_redecodes == 1 and eng.tokens == ids[:18]
    lg, _ = eng.decode(ids[18:24])
    np.testing.assert_allclose(lg, ref[18:24], atol=2e-4, rtol=1e-3)


class _Rows:
    """TensorRows' dot_rows on an in-memory [V, E] matrix."""

    def __init__(self, w):
        self.w = w

    def dot_rows(self, rows, x, q8_x=False):
        return np.einsum("tmk,tk->tm", self.w[rows], x)


@pytest.mark.parametrize("rank", [32, 8])
def test_lowrank_lm_head_candidates_and_exact_rescoring(tiny_onnx, tmp_path, rank):
    """The low-rank export: with a full-rank basis the candidates hold every row's argmax; with
    a low rank the engine's top-only rows are -inf except at the candidates, which carry the exact
    logits, and the buffer is cleared between calls."""
    import onnxruntime as ort

    from edgespec.exporters.onnx_target import export_graph
    from edgespec.runtime import ort_target

    model, _ = tiny_onnx
    spec = SimpleNamespace(arch="gemma3", n_layer=3, n_embd=32, n_head=2, n_head_kv=1,
                           head_dim=16, layer_types=["sliding", "sliding", "global"],
                           sliding_window=6, rope_base_local=10000.0, rope_base_global=1e6)
    q, _ = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(3)))
    basis = q[:, :rank].contiguous()
    w = model.lm_head.weight.detach()
    lowrank = {"basis": basis, "scores": (w @ basis).T.contiguous(), "candidates": 8}
    path = tmp_path / "lr.onnx"
    export_graph(model, spec, path, lowrank)
    eng = ort_target.OrtTarget.__new__(ort_target.OrtTarget)
    eng.sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    eng.meta = {"n_head_kv": 1, "head_dim": 16, "embed_scale": float(32 ** 0.5)}
    eng.embed = model.model.embed_tokens.weight.detach().numpy()
    eng.n_layer, eng.sliding, eng.window, eng.n_vocab = 3, [True, True, False], 6, 64
    eng.n_ctx, eng.n_batch, eng.n_redecodes, eng.lowrank = 128, 512, 0, True
    eng.past_names = [f"past_key_values.{i}.{kv}" for i in range(3) for kv in ("key", "value")]
    eng.out_names = ["logits", "hidden", "candidates"] + [
        f"present.{i}.{kv}" for i in range(3) for kv in ("key", "value")]
    from edgespec.runtime.lowrank import TopRows

    eng.top = TopRows(_Rows(w.numpy()), 64)
    eng.reset()
    ids = [int(x) for x in torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(4))]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    eng.prefill(ids[:6])
    for s, e in ((6, 11), (11, 12), (12, 16)):
        top, hid = eng.decode(ids[s:e], hidden=True, top_only=True)
        assert top.shape == (e - s, 64) and hid.shape == (e - s, 32)
        finite = np.isfinite(top)
        assert (finite.sum(1) == 8).all()  # exactly the candidates, nothing left from before
        np.testing.assert_allclose(top[finite], ref[s:e][finite], atol=2e-4, rtol=1e-3)
        if rank == 32:  # the search is exact: every argmax is found
            assert (top.argmax(1) == ref[s:e].argmax(1)).all()
        full, _ = eng.decode([ids[e - 1]], all_logits=True)  # without top_only: every logit
        assert np.isfinite(full).all() and full.shape == (1, 64)
        eng.truncate(e)


def test_lowrank_quantization_keeps_basis_fp32_and_scores_dynamic(tiny_onnx, tmp_path):
    """int8 export of a low-rank graph: the layers become 8-bit MatMulNBits, the basis projection
    stays fp32, the scores get dynamic int8 (MatMulInteger); the result still runs."""
    import onnx
    import onnxruntime as ort

    from edgespec.exporters.onnx_target import _lowrank_matmuls, _quantize, export_graph

    model, _ = tiny_onnx
    spec = SimpleNamespace(arch="gemma3", n_layer=3, n_embd=32, n_head=2, n_head_kv=1,
                           head_dim=16, layer_types=["sliding", "sliding", "global"],
                           sliding_window=6, rope_base_local=10000.0, rope_base_global=1e6)
    w = model.lm_head.weight.detach()
    basis = torch.linalg.qr(torch.randn(32, 32))[0][:, :16].contiguous()  # rank 16 = K/V width
    path = tmp_path / "lr.onnx"
    export_graph(model, spec, path, {"basis": basis, "scores": (w @ basis).T.contiguous(), "candidates": 4})
    m = onnx.load(str(path))
    b, s = _lowrank_matmuls(m)
    assert len(b) == 1 and len(s) == 1  # by name: the K/V projections share the basis's shape
    q = _quantize(m, "int8", True, tmp_path, log=lambda _: None)
    ops = [n.op_type for n in q.graph.node]
    assert ops.count("MatMulNBits") >= 3 * 7 and "MatMulInteger" in ops
    assert [n.op_type for n in q.graph.node if n.name in b] == ["MatMul"]
    out = tmp_path / "q.onnx"
    onnx.save(q, str(out))
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    feed = {"inputs_embeds": np.random.default_rng(0).normal(size=(3, 32)).astype(np.float32),
            "position": np.array(0, np.int64), "n_logits": np.array(3, np.int64),
            "n_candidates": np.array(2, np.int64)}
    for i in range(3):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = np.zeros((1, 1, 0, 16), np.float32)
    logits, hidden, cand = sess.run(["logits", "hidden", "candidates"], feed)
    assert logits.shape == (3, 64) and cand.shape == (2, 4) and (cand < 64).all()
