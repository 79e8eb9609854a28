"""Readers of untrusted bytes fail only with the project's own one-line error: GGUF headers and
target specs, head GGUF and ONNX files, checkpoint configs, feature manifests, low-rank basis
files.
A short hypothesis run here; named cases for the corruptions found by hand."""

import json
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgespec.errors import EdgespecError
from edgespec.gguf_meta import read_header
from edgespec.targets import spec_from_header
from test_targets import write_tiny_gguf

# A short run in `make test`; scripts/fuzz.sh runs thousands (EDGESPEC_FUZZ_EXAMPLES).
FUZZ = settings(max_examples=int(os.environ.get("EDGESPEC_FUZZ_EXAMPLES", "150")), deadline=2000,
                database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("fz") / "t.gguf", n_layer=6)
    return path.read_bytes()


def mutate(data: bytes, edits, cut) -> bytes:
    b = bytearray(data)
    for pos, kind, val in edits:
        pos %= len(b)
        if kind == 0:  # one byte
            b[pos] = val & 0xFF
        else:  # a u32 / u64 field overwritten (counts, lengths, types)
            fmt = "<I" if kind == 1 else "<Q"
            raw = struct.pack(fmt, val & (0xFFFFFFFF if kind == 1 else 0xFFFFFFFFFFFFFFFF))
            b[pos:pos + len(raw)] = raw
    return bytes(b[:cut]) if cut else bytes(b)


EDITS = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 2),
                           st.one_of(st.integers(0, 255), st.integers(0, 1 << 64),
                                     st.sampled_from([0, 1, 7, 1 << 31, 1 << 40, (1 << 64) - 1]))),
                 min_size=1, max_size=4)


def only_clean_errors(fn):
    try:
        fn()
    except EdgespecError as e:
        assert "\n" not in str(e) and str(e)


@FUZZ
@given(edits=EDITS, cut=st.one_of(st.none(), st.integers(1, 4096)))
def test_fuzz_gguf_header_and_target_spec(tiny_gguf, tmp_path, edits, cut):
    f = tmp_path / "f.gguf"
    f.write_bytes(mutate(tiny_gguf, edits, cut))
    only_clean_errors(lambda: spec_from_header(read_header(f)))


def _patch_after(data: bytes, marker: bytes, skip: int, fmt: str, value: int) -> bytes:
    """Overwrite the field `skip` bytes after the first occurrence of marker."""
    i = data.index(marker) + len(marker) + skip
    return data[:i] + struct.pack(fmt, value) + data[i + struct.calcsize(fmt):]


def test_named_corruptions_are_clear_errors(tiny_gguf, tmp_path):
    f = tmp_path / "c.gguf"
    # an array of 2^40 strings: refused at once, nothing allocated
    f.write_bytes(_patch_after(tiny_gguf, b"tokenizer.ggml.tokens", 8, "<Q", 1 << 40))
    with pytest.raises(EdgespecError, match="corrupt GGUF header .impossible count"):
        read_header(f)
    # a tensor with 2^31 dimensions
    f.write_bytes(_patch_after(tiny_gguf, b"token_embd.weight", 0, "<I", 1 << 31))
    with pytest.raises(EdgespecError, match="corrupt GGUF header .tensor token_embd.weight with"):
        read_header(f)
    # head_count = 0 (the key is followed by its value type, then the value)
    f.write_bytes(_patch_after(tiny_gguf, b"gemma3.attention.head_count\x04\x00\x00\x00", 0, "<I", 0))
    with pytest.raises(EdgespecError, match="corrupt GGUF metadata .gemma3.attention.head_count = 0"):
        spec_from_header(read_header(f))
    # a full-size file whose string length is corrupt says "corrupt", a cut one "truncated"
    f.write_bytes(_patch_after(tiny_gguf, b"general.architecture", 4, "<Q", (1 << 60)))
    with pytest.raises(EdgespecError, match="corrupt"):
        read_header(f)
    f.write_bytes(tiny_gguf[:len(tiny_gguf) // 3])
    with pytest.raises(EdgespecError, match="truncated"):
        read_header(f)


def test_crashes_found_by_fuzzing_stay_fixed(tiny_gguf, tmp_path):
    """The fuzzers' finds, kept: a vocabulary string of length 2^63 (an OverflowError), a
    manifest whose shards are null (a TypeError), a zip of an unsupported version in a basis file
    (NotImplementedError), a head config whose n_head is null (a TypeError)."""
    from edgespec.runtime.formats import HeadConfig
    from edgespec.runtime.lowrank import read_basis
    from edgespec.training.features import Features

    f = tmp_path / "c.gguf"
    f.write_bytes(_patch_after(tiny_gguf, b"\x05\x00\x00\x00\x00\x00\x00\x00<pad>", -13, "<Q", 1 << 63))
    with pytest.raises(EdgespecError, match="impossible string length"):
        read_header(f)
    (tmp_path / "feat").mkdir()
    (tmp_path / "feat" / "manifest.json").write_text(json.dumps(
        {"complete": True, "dtype": "int4", "group_size": 16, "n_embd": 32, "target_fingerprint": "a",
         "shards": None}))
    with pytest.raises(EdgespecError, match="no shards"):
        Features(tmp_path / "feat")
    import io

    buf = io.BytesIO()
    np.savez(buf, basis=np.ones((16, 4), np.float16), target_fingerprint="abc")
    data = bytearray(buf.getvalue())
    cd = data.index(b"PK\x01\x02")  # the central directory entry of the first array
    data[cd + 6] = 64  # "version needed to extract": 6.4, which zipfile does not implement
    (tmp_path / "b.npz").write_bytes(bytes(data))
    with pytest.raises(EdgespecError, match="not a low-rank basis file"):
        read_basis(tmp_path / "b.npz")
    with pytest.raises(EdgespecError, match="invalid n_head"):
        HeadConfig.from_dict({"n_embd": 8, "n_draft_vocab": 4, "n_head": None})


@pytest.fixture(scope="module")
def head_files(tmp_path_factory):
    """A head checkpoint (numpy only) and its GGUF export."""
    from edgespec.exporters.gguf_head import write_head_gguf
    from edgespec.runtime.formats import HeadConfig
    from mock import write_numpy_checkpoint

    tmp = tmp_path_factory.mktemp("heads")
    c = HeadConfig(n_embd=32, n_draft_vocab=8, n_head=2, n_head_kv=1, head_dim=8, n_ff=32,
                   layer_types=["sliding", "global"], sliding_window=8)
    ckpt = write_numpy_checkpoint(tmp / "ckpt", c, "abc", np.arange(8))
    write_head_gguf(ckpt, tmp / "h.gguf", "q8_0")
    return ckpt, (tmp / "h.gguf").read_bytes()


@FUZZ
@given(edits=EDITS, cut=st.one_of(st.none(), st.integers(1, 1 << 16)))
def test_fuzz_head_gguf(head_files, tmp_path, edits, cut):
    from edgespec.runtime.formats import read_head_gguf

    f = tmp_path / "h.gguf"
    f.write_bytes(mutate(head_files[1], edits, cut))
    only_clean_errors(lambda: read_head_gguf(f))


JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 1 << 40), st.floats(allow_nan=True),
                                 st.text(max_size=8)),
                       lambda kids: st.one_of(st.lists(kids, max_size=4),
                                              st.dictionaries(st.text(max_size=12), kids, max_size=4)),
                       max_leaves=12)


@FUZZ
@given(key=st.sampled_from(["head", "target", "target_fingerprint", "draft_vocab", "n_embd",
                            "layer_types", "n_head", "n_head_kv", "head_dim", "sliding_window"]),
       value=JSONISH, inner=st.booleans())
def test_fuzz_checkpoint_config(head_files, tmp_path, key, value, inner):
    """The config in config.json (older checkpoints) or inside the weights file's metadata."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from edgespec.runtime.formats import CKPT_META_CONFIG, read_checkpoint_head

    ckpt = tmp_path / "c"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    shutil.copytree(head_files[0], ckpt)
    meta = json.loads((head_files[0] / "config.json").read_text())
    if key in meta:
        meta[key] = value
    else:
        meta["head"][key] = value
    if inner:
        w = ckpt / "model.safetensors"
        save_file(load_file(str(w)), str(w), metadata={CKPT_META_CONFIG: json.dumps(meta)})
    else:
        (ckpt / "config.json").write_text(json.dumps(meta))
    only_clean_errors(lambda: read_checkpoint_head(ckpt))


@pytest.fixture(scope="module")
def head_onnx(tmp_path_factory):
    """A tiny head's ONNX export (fp32), as bytes."""
    pytest.importorskip("torch")
    pytest.importorskip("onnx")
    from edgespec.exporters.onnx_head import write_head_onnx
    from test_exporters import make_ckpt

    tmp = tmp_path_factory.mktemp("onnxhead")
    _, ckpt = make_ckpt(tmp)
    write_head_onnx(ckpt, tmp / "h.onnx", "fp32")
    return (tmp / "h.onnx").read_bytes()


@FUZZ
@given(edits=EDITS, cut=st.one_of(st.none(), st.integers(1, 1 << 17)))
def test_fuzz_head_onnx(head_onnx, tmp_path, edits, cut):
    """A damaged head ONNX file: refused at load or at its first run, with the one-line error."""
    from edgespec.runtime.heads import load_head

    f = tmp_path / "h.onnx"
    f.write_bytes(mutate(head_onnx, edits, cut))

    def load_and_run():
        head, info = load_head(f)
        rows = np.ones((3, info.config.n_embd), np.float32)
        out, _ = head.forward(rows, rows, 0, commit=True)
        head.forward(rows[:1], out[-1:], 3, commit=False)

    only_clean_errors(load_and_run)


@FUZZ
@given(data=st.binary(max_size=2048), edits=EDITS)
def test_fuzz_basis_file(tmp_path, data, edits):
    import io

    from edgespec.runtime.lowrank import read_basis

    buf = io.BytesIO()
    np.savez(buf, basis=np.ones((16, 4), np.float16), target_fingerprint="abc")
    f = tmp_path / "b.npz"
    f.write_bytes(mutate(buf.getvalue(), edits, None) if data[:1] != b"\0" else data)
    only_clean_errors(lambda: read_basis(f))


@FUZZ
@given(key=st.sampled_from(["complete", "dtype", "group_size", "shards", "target_fingerprint",
                            "n_embd", "transform"]), value=JSONISH)
def test_fuzz_feature_manifest(tmp_path, key, value):
    from edgespec.training.features import Features

    folder = tmp_path / "feat"
    folder.mkdir(exist_ok=True)
    man = {"complete": True, "dtype": "int4", "group_size": 16, "target_fingerprint": "abc",
           "n_embd": 32, "shards": [{"file": "features-00000.safetensors", "samples": 1, "tokens": 3,
                                     "sha256": "0" * 64}]}
    man[key] = value
    (folder / "manifest.json").write_text(json.dumps(man))
    only_clean_errors(lambda: Features(folder))
