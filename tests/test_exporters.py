"""Exporters: head GGUF round trip (numpy runtime vs torch head), target rewrite structure."""

import numpy as np
import pytest

from edgespec.errors import EdgespecError
from edgespec.gguf_meta import TensorRows, read_header
from test_targets import write_tiny_gguf

torch = pytest.importorskip("torch")


def make_ckpt(tmp_path):
    from edgespec.train import save_checkpoint

    from edgespec.head import HeadConfig, MTPHead

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
    from edgespec.exporters.gguf_head import read_head_gguf, write_head_gguf
    from edgespec.runtime.drafters import NumpyHead

    head, ckpt = make_ckpt(tmp_path)
    out = tmp_path / f"h-{quant}.gguf"
    r = write_head_gguf(ckpt, out, quant)
    assert out.exists() and r["bytes"] == out.stat().st_size
    config, w, info = read_head_gguf(out)
    assert info["target_fingerprint"] == "abc" and list(info["draft_ids"]) == list(np.arange(96) * 2)
    assert config["layer_types"] == ["sliding", "global"] and config["sliding_window"] == 8
    nh = NumpyHead(config, w)
    rng = np.random.default_rng(0)
    emb, hid = rng.normal(size=(40, 64)).astype(np.float32), rng.normal(size=(40, 64)).astype(np.float32)
    out_np, _ = nh.forward(emb, hid, 0, commit=True)
    with torch.no_grad():
        ref = head.logits(head.forward_chain(torch.from_numpy(emb)[None], torch.from_numpy(hid)[None], 1)[0][0]).numpy()
    agree = float((nh.logits(out_np).argmax(1) == ref.argmax(1)).mean())
    assert agree >= min_agree, agree


def test_head_gguf_bad_inputs(tmp_path):
    from edgespec.exporters.gguf_head import read_head_gguf, write_head_gguf

    _, ckpt = make_ckpt(tmp_path)
    with pytest.raises(EdgespecError, match="unknown --quant"):
        write_head_gguf(ckpt, tmp_path / "x.gguf", "q3_zz")
    with pytest.raises(EdgespecError, match="not a head checkpoint"):
        write_head_gguf(tmp_path, tmp_path / "x.gguf", "q8_0")
    with pytest.raises(EdgespecError, match="cannot write|write failed|no such"):
        write_head_gguf(ckpt, tmp_path / "missing-dir" / "x.gguf", "q8_0")
    assert not (tmp_path / "x.gguf").exists()
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
