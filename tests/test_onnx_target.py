"""The ONNX target graph: a tiny Gemma 3 (transformers) exported with its KV cache, run by
onnxruntime in chunks past its sliding window and rolled back by slicing the cache, gives the
logits and hidden states of one full forward pass of the torch model."""

from pathlib import Path
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


def target_folder(tmp, model, graph: Path, lowrank: dict | None = None):
    """A real ONNX target folder around a graph of the tiny model, and the GGUF file it
    tokenizes with (the model's own embedding rows): what `export onnx-target` writes."""
    import json
    import shutil

    from edgespec.runtime.formats import TARGET_META
    from edgespec.targets import load_target_spec
    from test_targets import write_tiny_gguf

    folder = tmp / "target"
    folder.mkdir()
    shutil.copy(graph, folder / "model.onnx")
    vocab = ("<pad>", "<eos>", "<bos>", *(f"t{i}" for i in range(61)))
    gguf = write_tiny_gguf(tmp / "tiny.gguf", n_layer=3, vocab=vocab, n_embd=32, window=6, pattern=3,
                           token_embd=model.model.embed_tokens.weight.detach().numpy())
    spec = load_target_spec(gguf)
    meta = {"target": str(gguf), "target_path": str(gguf), "target_fingerprint": spec.tokenizer_fingerprint,
            "quant": "fp32", "n_layer": 3, "n_embd": 32, "n_head_kv": 1, "head_dim": 16, "n_vocab": 64,
            "embed_scale": float(32 ** 0.5), "sliding_window": 6,
            "layer_types": ["sliding", "sliding", "global"],
            "lm_head": lowrank or {"kind": "full"}}
    (folder / TARGET_META).write_text(json.dumps(meta))
    return folder, spec


def test_ort_engine_trims_sliding_caches_and_rolls_back_exactly(tiny_onnx, tmp_path, monkeypatch):
    """OrtTarget on a real target folder: embedding rows from the GGUF, cache trimming on
    sliding layers, slicing rollback and the re-decode when a rollback goes deeper than the kept
    margin (the margin is shrunk so that 24 tokens reach it)."""
    from edgespec.runtime import ort_target

    model, path = tiny_onnx
    monkeypatch.setattr(ort_target, "kept_positions", lambda window: window + 2)
    folder, spec = target_folder(tmp_path, model, path)
    eng = ort_target.OrtTarget(folder, n_ctx=128, spec=spec)
    assert eng.engine == "onnxruntime" and eng.lowrank is None and eng.describe_lm_head() == "ONNX fp32"
    ids = [int(x) for x in torch.randint(3, 64, (24,), generator=torch.Generator().manual_seed(2))]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    eng.prefill(ids[:10])
    assert eng.kv[0].shape[2] == 8 and eng.kv[4].shape[2] == 10  # sliding trimmed, global full
    lg, hid = eng.decode(ids[10:14], hidden=True)
    np.testing.assert_allclose(lg, ref[10:14], atol=2e-4, rtol=1e-3)
    assert hid.shape == (4, 32)
    eng.decode([5, 6], all_logits=False)
    eng.truncate(14)  # shallow: slicing
    assert eng.n_redecodes == 0 and eng.tokens == ids[:14]
    lg, _ = eng.decode(ids[14:18])
    np.testing.assert_allclose(lg, ref[14:18], atol=2e-4, rtol=1e-3)
    eng.decode([3, 4, 5, 6])
    eng.truncate(18)  # deeper than the margin: re-decodes the kept tokens
    assert eng.n_redecodes == 1 and eng.tokens == ids[:18]
    lg, _ = eng.decode(ids[18:24])
    np.testing.assert_allclose(lg, ref[18:24], atol=2e-4, rtol=1e-3)
    eng.close()


@pytest.mark.parametrize("rank", [32, 8])
def test_lowrank_lm_head_candidates_and_exact_rescoring(tiny_onnx, tmp_path, rank):
    """The low-rank export: with a full-rank basis the candidates hold every row's argmax; with
    a low rank the engine's top-only rows are -inf except at the candidates, which carry the exact
    logits (rescored from the GGUF's rows), and the buffer is cleared between calls."""
    from edgespec.exporters.onnx_target import export_graph
    from edgespec.runtime.ort_target import OrtTarget

    model, _ = tiny_onnx
    spec = SimpleNamespace(arch="gemma3", n_layer=3, n_embd=32, n_head=2, n_head_kv=1,
                           head_dim=16, layer_types=["sliding", "sliding", "global"],
                           sliding_window=6, rope_base_local=10000.0, rope_base_global=1e6)
    q, _ = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(3)))
    basis = q[:, :rank].contiguous()
    w = model.lm_head.weight.detach()
    assert torch.equal(w, model.model.embed_tokens.weight)  # tied: the GGUF's rows rescore
    lowrank = {"basis": basis, "scores": (w @ basis).T.contiguous(), "candidates": 8}
    path = tmp_path / "lr.onnx"
    export_graph(model, spec, path, lowrank)
    folder, tspec = target_folder(tmp_path, model, path, {"kind": "lowrank", "rank": rank, "candidates": 8,
                                                         "rescore": "token_embd.weight"})
    eng = OrtTarget(folder, n_ctx=128, spec=tspec)
    assert eng.lowrank.key == f"lowrank-r{rank}-c8" and "rank-" in eng.describe_lm_head()
    ids = [int(x) for x in torch.randint(3, 64, (16,), generator=torch.Generator().manual_seed(4))]
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
    eng.close()


def test_ort_target_folder_with_incomplete_metadata(tiny_onnx, tmp_path):
    import json

    from edgespec.errors import EdgespecError
    from edgespec.runtime.formats import TARGET_META
    from edgespec.runtime.ort_target import OrtTarget

    model, path = tiny_onnx
    folder, spec = target_folder(tmp_path, model, path)
    meta = json.loads((folder / TARGET_META).read_text())
    del meta["n_layer"]
    (folder / TARGET_META).write_text(json.dumps(meta))
    with pytest.raises(EdgespecError, match="incomplete metadata .missing n_layer"):
        OrtTarget(folder, spec=spec)


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
