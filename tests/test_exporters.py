"""Exporters: head GGUF round trip (numpy runtime vs torch head), target rewrite structure."""

import numpy as np
import pytest

from edgespec.errors import EdgespecError
from edgespec.gguf_meta import TensorRows, read_header
from test_targets import write_tiny_gguf

torch = pytest.importorskip("torch")


def make_ckpt(tmp_path):
    from edgespec.runtime.formats import HeadConfig
    from edgespec.training.head import MTPHead
    from edgespec.training.train import save_checkpoint

    # widths are multiples of 32 so that the 2-D weights get quantized
    torch.manual_seed(0)
    c = HeadConfig(n_embd=64, n_draft_vocab=96, n_head=2, n_head_kv=1, head_dim=32, n_ff=64,
                   layer_types=["sliding", "global"], sliding_window=8, embed_scale=8.0)
    head = MTPHead(c)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        head.lm_head.normal_()
    meta = {"target": "tiny", "target_fingerprint": "abc", "draft_vocab": {"ids": np.arange(96) * 2,
            "size": 96, "coverage": 1.0}}
    save_checkpoint(tmp_path / "ckpt", head, meta)
    return head.eval(), tmp_path / "ckpt"


# Random weights have many near-ties, so q4_0 is held to a lower bar here (chance is 1/96); the
# trained head's figures come from `edgespec export gguf --check`.
@pytest.mark.parametrize("quant,min_agree", [("f16", 0.99), ("q8_0", 0.95), ("q4_0", 0.5)])
def test_head_gguf_roundtrip(tmp_path, quant, min_agree):
    from edgespec.exporters.gguf_head import write_head_gguf
    from edgespec.runtime.formats import read_head_gguf
    from edgespec.runtime.heads import NumpyHead

    head, ckpt = make_ckpt(tmp_path)
    out = tmp_path / f"h-{quant}.gguf"
    r = write_head_gguf(ckpt, out, quant)
    assert out.exists() and r["bytes"] == out.stat().st_size
    info = read_head_gguf(out)
    config, w = info.config, info.weights
    assert info.fingerprint == "abc" and list(info.draft_ids) == list(np.arange(96) * 2)
    assert config.layer_types == ["sliding", "global"] and config.sliding_window == 8
    if quant == "q4_0":  # the input projection and the LM head stay at q8_0, the rest is q4_0
        import gguf

        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
        assert types["fc.weight"] == types["lm_head"] == "Q8_0" and types["blocks.0.q.weight"] == "Q4_0"
    nh = NumpyHead(config, w)
    rng = np.random.default_rng(0)
    emb, hid = rng.normal(size=(40, 64)).astype(np.float32), rng.normal(size=(40, 64)).astype(np.float32)
    out_np, _ = nh.forward(emb, hid, 0, commit=True)
    with torch.no_grad():
        ref = head.logits(head.forward_chain(torch.from_numpy(emb)[None], torch.from_numpy(hid)[None], 1)[0][0]).numpy()
    agree = float((nh.logits(out_np).argmax(1) == ref.argmax(1)).mean())
    assert agree >= min_agree, agree


def assert_writer_refuses_bad_inputs(write, tmp_path, suffix: str, bad_quant: str, quant: str):
    """An unknown quant, a folder that is no checkpoint, an unwritable path: a clear error and
    no file left at the output path. Returns the good checkpoint for further checks."""
    _, ckpt = make_ckpt(tmp_path)
    out = tmp_path / f"x{suffix}"
    with pytest.raises(EdgespecError, match="unknown --quant"):
        write(ckpt, out, bad_quant)
    with pytest.raises(EdgespecError, match="not a head checkpoint"):
        write(tmp_path, out, quant)
    with pytest.raises(EdgespecError, match="cannot write|write failed|no such"):
        write(ckpt, tmp_path / "missing-dir" / out.name, quant)
    assert not out.exists()
    return ckpt


def test_head_gguf_bad_inputs(tmp_path):
    from edgespec.exporters.gguf_head import write_head_gguf
    from edgespec.runtime.formats import read_head_gguf

    assert_writer_refuses_bad_inputs(write_head_gguf, tmp_path, ".gguf", "q3_zz", "q8_0")
    target = write_tiny_gguf(tmp_path / "t.gguf")
    with pytest.raises(EdgespecError, match="not an edgespec head"):
        read_head_gguf(target)


def test_untied_head_keeps_every_tensor(tmp_path):
    from edgespec.exporters.target import add_untied_head
    from edgespec.targets import load_target_spec

    vocab = tuple(f"tok{i}" for i in range(64))
    src = write_tiny_gguf(tmp_path / "src.gguf", vocab=vocab, n_embd=32)
    out = tmp_path / "out.gguf"
    add_untied_head(src, out, "Q8_0")
    a, b = read_header(src), read_header(out)
    assert set(b.tensors) == set(a.tensors) | {"output.weight"}
    raw_a, raw_b = src.read_bytes(), out.read_bytes()
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert raw_a[t.offset:t.offset + t.nbytes] == raw_b[u.offset:u.offset + u.nbytes], name
    sa, sb = load_target_spec(src), load_target_spec(out)
    assert sa.tokenizer_fingerprint == sb.tokenizer_fingerprint and not sb.tied_embeddings
    assert sb.lm_head_type == "Q8_0" and sb.layer_types == sa.layer_types
    emb, head = TensorRows(a, "token_embd.weight")[0:64], TensorRows(b, "output.weight")[0:64]
    assert np.abs(emb - head).max() < 0.02 * np.abs(emb).max()
    with pytest.raises(EdgespecError, match="already has an untied"):
        add_untied_head(out, tmp_path / "again.gguf", "Q8_0")


def _chain_reference(head, emb, hid, n):
    with torch.no_grad():
        outs = head.forward_chain(torch.from_numpy(emb)[None, 1:], torch.from_numpy(hid)[None], n)
    return [o[0].numpy() for o in outs]


# Random weights: many near-ties and activations quantized too (int8 dynamic), so the bars sit
# well above chance (1/96) but low; the trained head's figures come from `export onnx --check`.
@pytest.mark.parametrize("quant,min_agree", [("fp32", 1.0), ("int8", 0.5), ("int4", 0.3)])
def test_head_onnx_step_graph_matches_torch(tmp_path, quant, min_agree):
    """The ONNX draft step, fed in chunks with its KV cache as the runtime does (past the
    sliding window of 8), reproduces the torch head's training-time chain."""
    onnx = pytest.importorskip("onnx")
    from edgespec.exporters.onnx_head import write_head_onnx
    from edgespec.runtime.heads import OnnxHead

    head, ckpt = make_ckpt(tmp_path)
    out = tmp_path / f"h-{quant}.onnx"
    r = write_head_onnx(ckpt, out, quant)
    assert r["bytes"] == out.stat().st_size
    m = onnx.load(str(out))
    onnx.checker.check_model(m)
    ins = [i.name for i in m.graph.input]
    assert ins[:3] == ["tok_emb", "hidden", "position"] and "past_key_values.1.value" in ins
    assert "present.0.key" in [o.name for o in m.graph.output]
    bits = {n.name: next(a.i for a in n.attribute if a.name == "bits")
            for n in m.graph.node if n.op_type == "MatMulNBits"}
    if quant != "fp32":  # the input projection and the LM head stay in 8 bits
        assert sorted(bits.values())[-2:] == [8, 8]
    if quant == "int4":
        assert sorted(bits.values())[:-2] == [4] * (len(bits) - 2) and len(bits) > 2
    if quant == "int8":
        assert len(bits) == 2 and any(n.op_type == "MatMulInteger" for n in m.graph.node)
    h = OnnxHead(out)
    assert h.file.fingerprint == "abc" and list(h.file.draft_ids) == list(np.arange(96) * 2)
    rng = np.random.default_rng(1)
    T, n = 30, 3
    emb = rng.normal(size=(T + n, 64)).astype(np.float32)
    hid = rng.normal(size=(T, 64)).astype(np.float32)
    ref = _chain_reference(head, emb, hid, n)
    ref_logits = [head.logits(torch.from_numpy(o)).numpy() for o in ref]
    t = T - 1
    got, agree = [], []
    h.forward(emb[1:12], hid[:11], 0, commit=True)
    o, _ = h.forward(emb[12:t + 2], hid[11:t + 1], 11, commit=True)
    got.append((o, ref[0][11:]))
    agree.append(h.last_logits.argmax() == ref_logits[0][t].argmax())
    last, cache = o[-1:], (h.k, h.v)
    for j in range(1, n):
        last, cache = h.forward(emb[t + 1 + j][None], last, t + j, commit=False, cache=cache)
        got.append((last[0], ref[j][t]))
        agree.append(h.last_logits.argmax() == ref_logits[j][t].argmax())
    assert h.n == T and h.k[0].shape == (1, 1, T, 32)
    if quant == "fp32":
        for a, b in got:
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-3)
        assert all(agree)
    # agreement of the draft LM head's argmax over every committed row
    lm = head.lm_head.numpy()
    rows = float(((got[0][0] @ lm.T).argmax(1) == (got[0][1] @ lm.T).argmax(1)).mean())
    assert rows >= min_agree, rows


def test_head_onnx_bad_inputs(tmp_path):
    pytest.importorskip("onnx")
    from types import SimpleNamespace

    from edgespec.exporters.onnx_head import write_head_onnx
    from edgespec.runtime.drafters import HeadDrafter
    from edgespec.runtime.heads import OnnxHead

    ckpt = assert_writer_refuses_bad_inputs(write_head_onnx, tmp_path, ".onnx", "int3", "int8")
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(EdgespecError, match="not a loadable ONNX model"):
        OnnxHead(tmp_path / "junk.onnx")
    good = tmp_path / "h.onnx"
    write_head_onnx(ckpt, good, "fp32")
    other = SimpleNamespace(tokenizer_fingerprint="zzz", name="other", path=None)
    with pytest.raises(EdgespecError, match="trained for target 'tiny'"):
        HeadDrafter(good, other)


@pytest.mark.integration
def test_target_requantized_for_cheap_batches(tmp_path):
    """`export target --quant Q4_0` on SmolLM2 (Q4_1 weights): every trunk matrix becomes Q4_0
    (llama.cpp's own quantizer), the embeddings keep their type, the report says how often the
    new file's greedy token agrees with the source's and what a verify decode costs in each;
    bad input is one line and exit 2 with nothing written."""
    import json
    import subprocess
    import sys

    from edgespec.targets import load_target_spec

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "edgespec", "export", "target", "smollm2-135m",
                               *args], capture_output=True, text=True)

    src = read_header(load_target_spec("smollm2-135m").path).tensors
    out = tmp_path / "s.gguf"
    res = cli("--quant", "q4_0", "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    got = read_header(out).tensors
    mats = [n for n in got if n.startswith("blk.") and n.endswith(".weight") and len(got[n].shape) == 2]
    assert mats and all(got[n].type_name == "Q4_0" for n in mats)
    assert any(src[n].type_name != "Q4_0" for n in mats)  # it did change something
    assert got["token_embd.weight"].type_name == src["token_embd.weight"].type_name
    # measured 0.71-0.72: re-quantizing Q4_1 values to Q4_0 moves the model, far from a break
    assert rep["mode"] == "quant Q4_0" and 0.5 < rep["top1_agreement"] < 1.0
    assert len(rep["verify_ms_source"]) == len(rep["verify_ms_out"]) == 8
    (tmp_path / "file").write_text("x")
    for bad, msg in ((["--quant", "Q9_9", "--out", str(tmp_path / "x.gguf")], "unknown --quant"),
                     (["--quant", "Q4_0", "--out", str(tmp_path / "file" / "x.gguf")], "no such folder")):
        res = cli(*bad)
        assert res.returncode == 2 and msg in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.gguf").exists()
