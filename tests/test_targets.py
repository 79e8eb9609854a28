"""GGUF header reading and TargetSpec on small GGUF files written here."""

import gguf
import numpy as np
import pytest

from edgespec.errors import EdgespecError
from edgespec.gguf_meta import read_header
from edgespec.targets import load_target_spec, resolve_target, spec_from_header


def write_tiny_gguf(path, arch="gemma3", n_layer=6, vocab=("<pad>", "<eos>", "<bos>", "a", "b"),
                    window=8, pattern=None, n_embd=16, token_embd=None, q8_0=False, quant=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(8)
    w.add_context_length(128)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    if window:
        w.add_sliding_window(window)
    if pattern is not None:
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", pattern)
    w.add_tokenizer_model("llama")
    w.add_token_list(list(vocab))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    if token_embd is None:
        token_embd = np.random.default_rng(0).normal(size=(len(vocab), n_embd))
    token_embd = np.asarray(token_embd, dtype=np.float32)
    if q8_0 or quant:  # Q8_0: the tensor type Gemma's shipped file stores its (tied) LM head in
        from gguf.quants import quantize

        qtype = gguf.GGMLQuantizationType[quant or "Q8_0"]
        w.add_tensor("token_embd.weight", quantize(token_embd, qtype), raw_dtype=qtype)
    else:
        w.add_tensor("token_embd.weight", token_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_spec_reads_gemma_layout(tmp_path):
    spec = spec_from_header(read_header(write_tiny_gguf(tmp_path / "t.gguf", n_layer=12)))
    assert spec.arch == "gemma3" and spec.n_layer == 12 and spec.n_embd == 16
    assert spec.n_vocab == 5 and spec.sliding_window == 8
    assert [i for i, t in enumerate(spec.layer_types) if t == "global"] == [5, 11]
    assert spec.rope_base_global == 1e6 and spec.rope_base_local == 10000.0
    assert spec.tied_embeddings and spec.lm_head_type == "F32"
    assert spec.bos_id == 2 and spec.eos_id == 1
    assert spec.embed_scale == pytest.approx(4.0)


def test_spec_pattern_key_and_no_window(tmp_path):
    spec = spec_from_header(read_header(write_tiny_gguf(tmp_path / "p.gguf", n_layer=6, pattern=3)))
    assert spec.layer_types == ["sliding", "sliding", "global"] * 2
    spec = spec_from_header(read_header(write_tiny_gguf(tmp_path / "g.gguf", arch="llama", window=0)))
    assert spec.sliding_window is None and set(spec.layer_types) == {"global"}
    assert spec.rope_base_local is None


def test_fingerprint_follows_vocabulary(tmp_path):
    a = spec_from_header(read_header(write_tiny_gguf(tmp_path / "a.gguf")))
    b = spec_from_header(read_header(write_tiny_gguf(tmp_path / "b.gguf", n_layer=12)))
    c = spec_from_header(read_header(write_tiny_gguf(tmp_path / "c.gguf", vocab=("x", "y", "z"))))
    assert a.tokenizer_fingerprint == b.tokenizer_fingerprint != c.tokenizer_fingerprint


def test_bad_files_give_clear_errors(tmp_path):
    good = write_tiny_gguf(tmp_path / "t.gguf")
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 40])
    with pytest.raises(EdgespecError, match="truncated"):
        read_header(cut)
    header_cut = tmp_path / "hcut.gguf"
    header_cut.write_bytes(data[:60])
    with pytest.raises(EdgespecError, match="truncated"):
        read_header(header_cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"hello world, not a model at all" * 4)
    with pytest.raises(EdgespecError, match="not a GGUF"):
        read_header(junk)
    with pytest.raises(EdgespecError, match="no such file"):
        load_target_spec(tmp_path / "missing.gguf")
    other = write_tiny_gguf(tmp_path / "o.gguf", arch="mamba")
    with pytest.raises(EdgespecError, match="not supported"):
        load_target_spec(other)


def test_resolve_names():
    with pytest.raises(EdgespecError, match="unknown target"):
        resolve_target("gemma-9000")
    with pytest.raises(EdgespecError, match="empty target"):
        resolve_target(" ")


@pytest.mark.integration
def test_a_known_name_resolves_to_its_shipped_file():
    assert resolve_target("gemma3-270m").name.endswith(".gguf")
