"""The EAGLE-3 head: training-time test equals the run-time recurrence llama.cpp runs, the RoPE
layout the exporter writes is llama.cpp's, the GGUF carries what llama.cpp's loader reads, and
training learns on features of three layer inputs."""

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgespec.errors import EdgespecError  # noqa: E402
from edgespec.runtime.formats import Eagle3Config  # noqa: E402
from edgespec.targets import load_target_spec  # noqa: E402
from edgespec.training.eagle3 import Eagle3Head, parse_layers  # noqa: E402
from edgespec.training.features import Features, quantize  # noqa: E402
from test_targets import write_tiny_gguf  # noqa: E402
from test_train import VOCAB, small_cfg, write_features  # noqa: E402


def small_head(seed=0, e=16, vocab=12):
    torch.manual_seed(seed)
    c = Eagle3Config(n_embd=e, n_draft_vocab=vocab, target_layers=[1, 2, 3], n_head=4, n_head_kv=2,
                     head_dim=8, n_ff=24, rope_base=10000.0)
    h = Eagle3Head(c)
    with torch.no_grad():
        for p in h.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
        h.lm_head.normal_()
    return h.eval()


@torch.no_grad()
def test_training_time_test_is_the_run_time_recurrence():
    """Every step of `forward_chain` at every chain start equals running the head one position
    at a time as llama.cpp does: real pairs (token t+1, fc(features t)) into the KV cache up to
    the chain start, then each draft step's pre-norm state fed back as g one position later."""
    h = small_head()
    e, t, n = 16, 9, 3
    hid = torch.randn(1, t, 4 * e) * 3
    emb = torch.randn(1, t + n - 1, e)
    outs = h.forward_chain(emb, hid, n)
    g_real = h.fuse(hid[0])
    for start in range(t):
        cache = None
        for p in range(start + 1):  # the real pairs at positions 0 .. start
            state, cache = h.step(emb[0, p], g_real[p], cache, p)
        torch.testing.assert_close(outs[0][0, start], state, rtol=1e-4, atol=1e-5)
        for j in range(1, n):
            state, cache = h.step(emb[0, start + j], state, cache, start + j)
            torch.testing.assert_close(outs[j][0, start], state, rtol=1e-4, atol=1e-5)


def _rope_interleaved(x, pos, base):
    """llama.cpp's LLAMA_ROPE_TYPE_NORM: rotates adjacent pairs (2i, 2i + 1). x [T, H, D]."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos[:, None, None].double() * inv  # [T, 1, D/2]
    a, b = x[..., 0::2].double(), x[..., 1::2].double()
    out = torch.empty_like(x, dtype=torch.float64)
    out[..., 0::2] = a * ang.cos() - b * ang.sin()
    out[..., 1::2] = a * ang.sin() + b * ang.cos()
    return out


def test_permuted_rows_under_llama_cpp_rope_give_the_trained_attention_scores():
    from edgespec.exporters.eagle3_gguf import permute_rope
    from edgespec.runtime.formats import unpermute_rope
    from edgespec.training.head import rope

    rng = np.random.default_rng(0)
    n_head, d, d_in, t = 3, 8, 10, 5
    wq = rng.normal(size=(n_head * d, d_in)).astype(np.float32)
    wk = rng.normal(size=(n_head * d, d_in)).astype(np.float32)
    assert np.array_equal(unpermute_rope(permute_rope(wq, n_head), n_head), wq)
    x = torch.from_numpy(rng.normal(size=(t, d_in)).astype(np.float32))
    pos = torch.arange(t) + 7
    # trained: rotate-half RoPE on the checkpoint's rows
    q = rope((x @ torch.from_numpy(wq).T).view(1, t, n_head, d), pos[None], 1e4)[0]
    k = rope((x @ torch.from_numpy(wk).T).view(1, t, n_head, d), pos[None], 1e4)[0]
    # exported: llama.cpp's interleaved RoPE on the permuted rows
    qe = _rope_interleaved((x @ torch.from_numpy(permute_rope(wq, n_head)).T).view(t, n_head, d), pos, 1e4)
    ke = _rope_interleaved((x @ torch.from_numpy(permute_rope(wk, n_head)).T).view(t, n_head, d), pos, 1e4)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double())
    se = torch.einsum("qhd,khd->hqk", qe, ke)
    torch.testing.assert_close(s, se, rtol=1e-4, atol=1e-4)
    # and without the permutation the scores differ: the check can fail
    qn = _rope_interleaved((x @ torch.from_numpy(wq).T).view(t, n_head, d), pos, 1e4)
    kn = _rope_interleaved((x @ torch.from_numpy(wk).T).view(t, n_head, d), pos, 1e4)
    assert not torch.allclose(torch.einsum("qhd,khd->hqk", qn, kn), s, rtol=1e-3, atol=1e-3)


def test_layers_option():
    assert parse_layers("eagle3", 30) == (2, 15, 27)
    assert parse_layers("1,5,9", 12) == (1, 5, 9)
    for bad in ("0,5,9", "1,5,12", "1,1,2", "a,b"):
        with pytest.raises(EdgespecError, match="--layers"):
            parse_layers(bad, 12)


def write_layer_features(folder, spec, n_samples=24, length=30, seed=0):
    """Synthetic EAGLE-3 features: [final hidden state, three layer inputs], where the layer
    inputs (scaled differently, with noise) carry the next token as the final state does."""
    from safetensors.numpy import save_file

    from edgespec.cache import sha256_file

    write_features(folder, spec, n_samples, length, dtype="fp16", seed=seed)
    f = Features(folder)
    rng = np.random.default_rng(seed + 1)
    final = np.concatenate([f.hidden(i) for i in range(len(f))])
    toks = np.concatenate(f.tokens)
    seq = np.concatenate([[i] * len(t) for i, t in enumerate(f.tokens)])
    layers = [final * s + rng.normal(scale=0.1 * s, size=final.shape) for s in (0.5, 4.0, 30.0)]
    arrays = quantize(np.concatenate([final, *layers], axis=1).astype(np.float32), "fp16", 16)
    arrays.update(tokens=toks.astype(np.int32), seq=seq.astype(np.int32))
    name = "features-00000.safetensors"
    save_file(arrays, str(folder / name))
    m = json.loads((folder / "manifest.json").read_text())
    m.update(layers=[1, 2, 4], width=4 * spec.n_embd)
    m["shards"][0]["sha256"] = sha256_file(folder / name)
    (folder / "manifest.json").write_text(json.dumps(m))
    return folder


def train_tiny_mtp(path, features, out):
    """A two-step MTP head on the tiny target: what EAGLE-3 exporters must refuse."""
    from edgespec.training.train import train

    train(str(path), features, out, small_cfg(steps=2, warmup=1, save_every=2),
          head_overrides={"n_head": 2, "n_head_kv": 1, "head_dim": 8, "n_ff": 32}, log=lambda m: None)
    return out


@pytest.fixture()
def tiny3(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch="llama", n_layer=6, vocab=VOCAB, window=None)
    spec = load_target_spec(path)
    return path, spec, write_layer_features(tmp_path / "feat3", spec), tmp_path


def test_eagle3_head_trains_evaluates_and_exports(tiny3):
    import gguf

    from edgespec.exporters.eagle3_gguf import write_eagle3_gguf
    from edgespec.runtime.formats import unpermute_rope
    from edgespec.training.train import eval_head, load_checkpoint, train

    path, spec, feats, tmp = tiny3
    meta = train(str(path), feats, tmp / "e3", small_cfg(arch="eagle3", steps=80), log=lambda m: None)
    hist = meta["train"]["history"]
    assert hist[-1]["loss"] < hist[0]["loss"] * 0.7
    r = eval_head(tmp / "e3", feats, max_chain=3)
    assert r["expected_accepted"]["1"] >= 0.4, r
    head, saved = load_checkpoint(tmp / "e3")
    assert isinstance(head, Eagle3Head)
    assert saved["head"]["arch"] == "eagle3" and saved["head"]["target_layers"] == [1, 2, 4]

    out = write_eagle3_gguf(tmp / "e3", tmp / "e3.gguf", quant="f16")
    rd = gguf.GGUFReader(str(tmp / "e3.gguf"))
    fields = {k: v.contents() for k, v in rd.fields.items()}
    assert fields["general.architecture"] == "eagle3"
    assert fields["eagle3.target_layers"] == [1, 2, 4] and fields["eagle3.block_count"] == 1
    assert fields["eagle3.target_hidden_size"] == spec.n_embd and fields["eagle3.norm_before_fc"]
    assert fields["tokenizer.ggml.tokens"] == list(VOCAB)  # the target's vocabulary, copied
    t = {x.name: x for x in rd.tensors}
    assert "token_embd.weight" not in t  # llama.cpp takes the target's
    d2t = np.asarray(t["d2t"].data)
    assert d2t.dtype == np.int64 and np.array_equal(d2t, np.asarray(meta["draft_vocab"]["ids"]))
    sd = {k: v.numpy() for k, v in head.state_dict().items()}
    q = np.asarray(t["blk.0.attn_q.weight"].data, dtype=np.float32).reshape(sd["q.weight"].shape)
    np.testing.assert_allclose(unpermute_rope(q, head.c.n_head), sd["q.weight"], rtol=2e-3, atol=2e-3)
    fc = np.asarray(t["fc.weight"].data, dtype=np.float32).reshape(sd["fc.weight"].shape)
    np.testing.assert_allclose(fc, sd["fc.weight"], rtol=2e-3, atol=2e-3)
    assert out["bytes"] == (tmp / "e3.gguf").stat().st_size


def test_wrong_head_or_features_are_clear_errors(tiny3, tmp_path):
    from edgespec.exporters.eagle3_gguf import write_eagle3_gguf
    from edgespec.training.train import train

    path, spec, feats3, tmp = tiny3
    plain = write_features(tmp / "plain", spec)
    with pytest.raises(EdgespecError, match="--layers"):
        train(str(path), plain, tmp / "x", small_cfg(arch="eagle3", steps=2), log=lambda m: None)
    train_tiny_mtp(path, plain, tmp / "mtp")
    with pytest.raises(EdgespecError, match="not an EAGLE-3 head"):
        write_eagle3_gguf(tmp / "mtp", tmp / "m.gguf")
    r = subprocess.run([sys.executable, "-m", "edgespec", "export", "llama-cpp", str(tmp / "mtp"),
                        "--out", str(tmp / "m.gguf")], capture_output=True, text=True)
    assert r.returncode == 2 and "not an EAGLE-3 head" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp / "m.gguf").exists()
    # and the other way: edgespec's own formats refuse an EAGLE-3 head, naming its exports
    train(str(path), feats3, tmp / "e3", small_cfg(arch="eagle3", steps=2), log=lambda m: None)
    for kind in ("gguf", "onnx"):
        out = tmp / f"e3.{kind}"
        r = subprocess.run([sys.executable, "-m", "edgespec", "export", kind, str(tmp / "e3"),
                            "--out", str(out)], capture_output=True, text=True)
        assert r.returncode == 2 and "is an EAGLE-3 head" in r.stderr and "export llama-cpp" in r.stderr
        assert "Traceback" not in r.stderr and not out.exists()


def test_an_mtp_head_on_layer_features_reads_the_final_state_alone(tiny3):
    """One extraction with --layers feeds both heads: an MTP head trained, scored and its export
    checked on it is the head trained, scored and checked on the final hidden states alone."""
    from edgespec.training.train import eval_head, load_checkpoint

    path, spec, feats3, tmp = tiny3
    final = write_features(tmp / "final", spec, dtype="fp16")  # the same final states, no layers
    for feats, out in ((feats3, tmp / "m3"), (final, tmp / "m1")):
        train_tiny_mtp(path, feats, out)
    a, b = load_checkpoint(tmp / "m3")[0].state_dict(), load_checkpoint(tmp / "m1")[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = eval_head(tmp / "m3", feats3), eval_head(tmp / "m1", final)
    assert ra["acceptance_by_position"] == rb["acceptance_by_position"] and ra["chains_by_position"][0] > 0
    # the export check reads such a folder the same way
    from edgespec.exporters.check import check_head_export
    from edgespec.exporters.onnx_head import write_head_onnx

    write_head_onnx(tmp / "m3", tmp / "m3.onnx", quant="fp32")
    ca, cb = (check_head_export(tmp / "m3", tmp / "m3.onnx", f) for f in (feats3, final))
    assert ca["compared"] == cb["compared"] > 0
    assert (ca["top1_agreement"], ca["max_logit_error"]) == (cb["top1_agreement"], cb["max_logit_error"])


def test_the_exported_file_reads_back_as_the_trained_head(tiny3):
    from edgespec.exporters.eagle3_gguf import check_eagle3_export, read_eagle3_gguf, write_eagle3_gguf
    from edgespec.training.train import load_checkpoint, train

    path, spec, feats, tmp = tiny3
    train(str(path), feats, tmp / "e3", small_cfg(arch="eagle3", steps=40), log=lambda m: None)
    head, meta = load_checkpoint(tmp / "e3")
    for quant in ("f16", "q8_0"):
        write_eagle3_gguf(tmp / "e3", tmp / f"e3-{quant}.gguf", quant=quant)
        back, ids, fields = read_eagle3_gguf(tmp / f"e3-{quant}.gguf")
        assert np.array_equal(ids, np.asarray(meta["draft_vocab"]["ids"]))
        for k, v in head.state_dict().items():
            np.testing.assert_allclose(back.state_dict()[k].numpy(), v.numpy(), rtol=0.02, atol=0.02)
        r = check_eagle3_export(tmp / "e3", tmp / f"e3-{quant}.gguf", feats)
        assert r["compared"] > 0 and min(r["top1_agreement_by_step"]) >= 0.95, r
    with pytest.raises(EdgespecError, match="not an EAGLE-3 head"):
        read_eagle3_gguf(path)  # the target itself


def test_the_runtime_runs_the_exported_file_as_the_torch_head_does(tiny3):
    """`load_head` on an EAGLE-3 GGUF gives the numpy head the runtime drafts with: real rows
    in one batch, then draft steps on its own states, equal to the torch head's training-time
    test on the file's weights."""
    from edgespec.exporters.eagle3_gguf import read_eagle3_gguf, write_eagle3_gguf
    from edgespec.runtime.heads import Eagle3NumpyHead, load_head
    from edgespec.training.train import train

    path, spec, feats, tmp = tiny3
    train(str(path), feats, tmp / "e3", small_cfg(arch="eagle3", steps=10, warmup=2, save_every=10),
          log=lambda m: None)
    write_eagle3_gguf(tmp / "e3", tmp / "e3.gguf", quant="f16")
    nh, info = load_head(tmp / "e3.gguf")
    assert isinstance(nh, Eagle3NumpyHead) and info.fingerprint == spec.tokenizer_fingerprint
    th, _, _ = read_eagle3_gguf(tmp / "e3.gguf")
    f = Features(feats)
    hid = f.hidden(0)[:20]
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(22, spec.n_embd)).astype(np.float32)
    with torch.no_grad():
        ref = [o[0].numpy() for o in th.forward_chain(torch.from_numpy(emb)[None], torch.from_numpy(hid)[None], 3)]
        ref_logits = [th.logits(torch.from_numpy(r)).numpy() for r in ref]
    start = 12
    out, _ = nh.forward(emb[:start + 1], hid[:start + 1], 0, commit=True)
    np.testing.assert_allclose(out, ref[0][:start + 1], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(nh.last_logits, ref_logits[0][start], rtol=1e-3, atol=1e-3)
    cache = (nh.k, nh.v)
    for j in range(1, 3):
        out, cache = nh.forward(emb[start + j][None], out[-1:], start + j, commit=False, cache=cache)
        np.testing.assert_allclose(out[0], ref[j][start], rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(nh.last_logits, ref_logits[j][start], rtol=1e-3, atol=1e-3)


@pytest.mark.integration
def test_llama_cpp_hands_out_the_layer_inputs_the_probe_reads():
    """On SmolLM2 (llama graph) the engine's native layer-input extraction, read with every
    hidden-state decode, equals the inputs the eval-callback probe copies out of the graph
    (what `extract --layers` stores), and leaves the final hidden state and logits as they were."""
    from edgespec.runtime.llama_target import LlamaTarget

    eng = LlamaTarget("smollm2-135m", n_ctx=256, n_batch=64, lm_head="full", probe=True)
    plain = LlamaTarget("smollm2-135m", n_ctx=256, n_batch=64, lm_head="full")
    toks = eng.tokenize("def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n")
    layers = (2, 15, 27)
    eng.reset()
    probed = eng.hidden_states(toks, layers=layers)
    plain.reset()
    lg0, h0 = plain.decode(toks, hidden=True)
    plain.set_feature_layers(layers)
    plain.reset()
    lg1, h1 = plain.decode(toks, hidden=True)
    assert h1.shape == (len(toks), 4 * plain.n_embd)
    np.testing.assert_array_equal(h1[:, :plain.n_embd], h0)
    np.testing.assert_array_equal(lg1, lg0)
    np.testing.assert_allclose(h1[:, plain.n_embd:], probed[:, plain.n_embd:], rtol=1e-4, atol=1e-3)
    plain.set_feature_layers(())
    plain.reset()
    assert plain.decode(toks, hidden=True)[1].shape == (len(toks), plain.n_embd)
    eng.close()
    plain.close()


def test_features_of_other_layers_are_refused_by_resume_and_eval(tiny3):
    from edgespec.training.train import eval_head, train

    path, spec, feats3, tmp = tiny3
    train(str(path), feats3, tmp / "e3", small_cfg(arch="eagle3", steps=4, warmup=1, save_every=2),
          log=lambda m: None)
    plain = write_features(tmp / "plain", spec)
    with pytest.raises(EdgespecError, match="this head reads"):
        eval_head(tmp / "e3", plain, max_chain=2)
    with pytest.raises(EdgespecError, match="holds features of layers"):
        train(str(path), plain, tmp / "e3", small_cfg(arch="eagle3", steps=8), resume=True,
              log=lambda m: None)
