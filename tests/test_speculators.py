"""`edgespec export speculators`: EAGLE-3 heads as vLLM's `speculators` checkpoint folders,
checked three ways: the `speculators` package itself (0.9.0, in the venv `make speculators`
builds) loads the folder and its forward equals the trained head's; llama.cpp's own
`convert_hf_to_gguf.py` (from the pinned llama-cpp-python's llama.cpp) turns the folder into the
GGUF `edgespec export llama-cpp` writes, tensor for tensor; and the folder's layout and
vocabulary maps are the library's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgespec.errors import EdgespecError  # noqa: E402
from edgespec.exporters.speculators import TENSORS, write_speculators  # noqa: E402
from edgespec.runtime.formats import Eagle3Config, eagle3_weight_shapes  # noqa: E402
from test_eagle3 import tiny3, train_tiny_mtp  # noqa: E402,F401  (tiny3: fixture)
from test_train import small_cfg, write_features  # noqa: E402

SPEC_PY = os.environ.get("EDGESPEC_SPECULATORS_PYTHON")
needs_library = pytest.mark.skipif(
    not SPEC_PY or not Path(SPEC_PY).is_file(),
    reason="the speculators package lives in its own venv: `make speculators` (make test does it)")


def _converter() -> Path | None:
    tools = os.environ.get("EDGESPEC_LLAMA_TOOLS")
    p = Path(tools).parent / "convert" / "convert_hf_to_gguf.py" if tools else None
    return p if p is not None and p.is_file() else None


@pytest.fixture()
def trained(tiny3):  # noqa: F811
    from edgespec.training.train import train

    path, spec, feats, tmp = tiny3
    train(str(path), feats, tmp / "e3", small_cfg(arch="eagle3", steps=30), log=lambda m: None)
    return tmp / "e3", spec, feats, tmp


def test_the_folder_is_the_librarys_layout(trained):
    from safetensors.numpy import load_file

    from edgespec.training.train import load_checkpoint

    ckpt, spec, _, tmp = trained
    r = write_speculators(ckpt, tmp / "spec", verifier="org/tiny")
    cfg = json.loads((tmp / "spec" / "config.json").read_text())
    head, meta = load_checkpoint(ckpt)
    c = head.c
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3DraftModel"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == c.target_layers
    assert cfg["draft_vocab_size"] == c.n_draft_vocab and cfg["norm_before_fc"] is True
    layer = cfg["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["hidden_size"],
            layer["num_attention_heads"], layer["num_key_value_heads"], layer["vocab_size"]) == \
        ("llama", 1, c.n_embd, c.n_head, c.n_head_kv, spec.n_vocab)
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["verifier"] == {
        "name_or_path": "org/tiny", "architectures": ["LlamaForCausalLM"]}
    w = load_file(str(tmp / "spec" / "model.safetensors"))
    assert "embed_tokens.weight" not in w  # engines take the verifier's
    sd = {k: v.numpy() for k, v in head.state_dict().items()}
    for ours, theirs in TENSORS.items():
        np.testing.assert_array_equal(w[theirs], sd[ours])  # float32, rotate-half as trained
    ids = np.asarray(meta["draft_vocab"]["ids"])
    assert w["d2t"].dtype == np.int64 and np.array_equal(np.arange(len(ids)) + w["d2t"], ids)
    assert w["t2d"].dtype == np.bool_ and w["t2d"].sum() == len(ids) and w["t2d"][ids].all()
    assert r["tensors"] == len(w)
    # written again over itself: replaced whole, nothing left beside it
    write_speculators(ckpt, tmp / "spec", verifier="org/other", dtype="float16")
    assert json.loads((tmp / "spec" / "config.json").read_text())["speculators_config"][
        "verifier"]["name_or_path"] == "org/other"
    assert load_file(str(tmp / "spec" / "model.safetensors"))["fc.weight"].dtype == np.float16
    assert sorted(p.name for p in tmp.iterdir() if p.name.startswith(".spec")) == []


def test_mtp_heads_and_bad_arguments_are_one_line_errors(tiny3, tmp_path):  # noqa: F811
    path, spec, _, tmp = tiny3
    train_tiny_mtp(path, write_features(tmp / "plain", spec), tmp / "mtp")
    with pytest.raises(EdgespecError, match="no model type for edgespec's MTP heads"):
        write_speculators(tmp / "mtp", tmp_path / "x")
    r = subprocess.run([sys.executable, "-m", "edgespec", "export", "speculators", str(tmp / "mtp"),
                        "--out", str(tmp_path / "y")], capture_output=True, text=True)
    assert r.returncode == 2 and "MTP heads" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "y").exists()


@needs_library
def test_the_speculators_package_loads_the_folder_and_runs_it_as_trained(trained):
    from edgespec.exporters.speculators import check_speculators_export

    ckpt, _, feats, tmp = trained
    write_speculators(ckpt, tmp / "spec")
    r = check_speculators_export(ckpt, tmp / "spec", feats, python=SPEC_PY)
    assert (r["config_class"], r["model_class"]) == ("Eagle3SpeculatorConfig", "Eagle3DraftModel")
    assert r["tensors_not_in_model"] == [] and len(r["tensors_equal"]) == len(TENSORS) + 2
    assert all(r["tensors_equal"].values()), r["tensors_equal"]
    assert r["compared"] > 0 and r["top1_agreement"] >= 0.99 and r["max_logit_error"] < 1e-3, r


def _random_eagle3_checkpoint(folder: Path, spec, n_draft: int = 256, seed: int = 0) -> Path:
    """An EAGLE-3 checkpoint for a real target, random weights (a format check needs no training)."""
    from safetensors.numpy import save_file

    from edgespec.runtime.formats import DRAFT_IDS

    rng = np.random.default_rng(seed)
    c = Eagle3Config(n_embd=spec.n_embd, n_draft_vocab=n_draft, target_layers=[2, 15, 27], n_head=9,
                     n_head_kv=3, head_dim=64, n_ff=1536, rope_base=100000.0)
    w = {k: (rng.normal(size=s) * (0.05 if len(s) == 2 else 1.0) + (0 if len(s) == 2 else 1.0)
             ).astype(np.float32) for k, s in eagle3_weight_shapes(c).items()}
    ids = np.sort(rng.choice(spec.n_vocab, n_draft, replace=False)).astype(np.int64)
    w[DRAFT_IDS] = ids
    folder.mkdir(parents=True)
    save_file(w, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "target": "smollm2-135m", "target_fingerprint": spec.tokenizer_fingerprint,
        "head": c.to_dict(), "draft_vocab": {"size": n_draft, "ids": ids.tolist()}}))
    return folder


@pytest.mark.integration
@pytest.mark.skipif(_converter() is None,
                    reason="llama.cpp's converter comes with the llama.cpp tools: make llama-tools")
def test_llama_cpp_converts_the_folder_into_the_gguf_edgespec_writes(tmp_path):
    import gguf

    from edgespec.exporters.eagle3_gguf import write_eagle3_gguf
    from edgespec.exporters.speculators import write_target_hf_dir
    from edgespec.targets import load_target_spec

    spec = load_target_spec("smollm2-135m")
    ckpt = _random_eagle3_checkpoint(tmp_path / "ckpt", spec)
    write_speculators(ckpt, tmp_path / "spec")
    write_eagle3_gguf(ckpt, tmp_path / "ours.gguf", quant="f16")
    target_dir = write_target_hf_dir(spec, tmp_path / "target-hf")
    r = subprocess.run([sys.executable, str(_converter()), str(tmp_path / "spec"),
                        "--target-model-dir", str(target_dir), "--outtype", "f16",
                        "--outfile", str(tmp_path / "conv.gguf")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = gguf.GGUFReader(str(tmp_path / "ours.gguf")), gguf.GGUFReader(str(tmp_path / "conv.gguf"))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert set(ta) == set(tb) and "d2t" in ta and "fc.weight" in ta
    for name, x in ta.items():
        y = tb[name]
        assert (x.tensor_type, list(x.shape)) == (y.tensor_type, list(y.shape)), name
        assert np.array_equal(np.asarray(x.data), np.asarray(y.data)), name
    fa, fb = ({k: v.contents() for k, v in r_.fields.items()} for r_ in (a, b))
    for key in ("eagle3.target_layers", "eagle3.target_hidden_size", "eagle3.norm_before_fc",
                "eagle3.block_count", "eagle3.attention.head_count", "eagle3.attention.head_count_kv",
                "eagle3.feed_forward_length", "eagle3.rope.freq_base", "eagle3.vocab_size"):
        assert fa[key] == fb[key], key
    assert fa["tokenizer.ggml.tokens"] == fb["tokenizer.ggml.tokens"]
