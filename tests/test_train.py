"""Features storage and the training loop on a tiny GGUF target and synthetic hidden states."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgespec.errors import EdgespecError  # noqa: E402
from edgespec.training.features import Features, bytes_per_token, dequantize, quantize  # noqa: E402
from edgespec.targets import load_target_spec  # noqa: E402
from test_targets import write_tiny_gguf  # noqa: E402

VOCAB = tuple(f"t{i}" for i in range(40))


@pytest.mark.parametrize("dtype,group,tol", [("fp16", 32, 2e-3), ("int8", 16, 0.03), ("int4", 16, 0.3)])
def test_quantize_roundtrip(dtype, group, tol):
    h = np.random.default_rng(0).normal(size=(7, 64)).astype(np.float32)
    r = dequantize(quantize(h, dtype, group), dtype, group)
    assert r.shape == h.shape
    assert np.abs(r - h).max() <= tol * np.abs(h).max()


def test_int4_is_3_5x_smaller_than_fp16():
    assert bytes_per_token("fp16", 640, 32) / bytes_per_token("int4", 640, 32) >= 3.5


def _next(t: int) -> int:
    """The synthetic text's rule: one cycle through the whole vocabulary (21 = 1 mod 20 and 3
    coprime to 40), so held-out samples use the tokens training samples use."""
    return (21 * t + 3) % len(VOCAB)


def write_features(folder, spec, n_samples=24, length=30, dtype="int4", seed=0, kv_layers=()):
    """Synthetic features: a deterministic token chain and hidden states that encode it, so a
    head can learn to predict; written in the same layout `extract` writes. `kv_layers`: also
    (random) keys and values of those layers after each hidden state, as `extract --kv` does."""
    from safetensors.numpy import save_file

    from edgespec.cache import sha256_file

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    emb = rng.normal(size=(len(VOCAB), spec.n_embd)).astype(np.float32)
    w = spec.n_head_kv * spec.head_dim
    toks, seqs, hid = [], [], []
    for i in range(n_samples):
        t = [int(rng.integers(len(VOCAB)))]
        for _ in range(length - 1):
            t.append(_next(t[-1]))
        toks += t
        seqs += [i] * length
        rows = emb[[_next(x) for x in t]]
        if kv_layers:
            kv = rng.normal(size=(length, 2 * w * len(kv_layers))).astype(np.float32)
            rows = np.concatenate([rows, kv], axis=1)
        hid.append(rows)
    arrays = quantize(np.concatenate(hid), dtype, 16)
    arrays["tokens"] = np.asarray(toks, dtype=np.int32)
    arrays["seq"] = np.asarray(seqs, dtype=np.int32)
    save_file(arrays, str(folder / "features-00000.safetensors"))
    manifest = {"target": spec.name, "target_fingerprint": spec.tokenizer_fingerprint,
                "n_embd": spec.n_embd, "n_vocab": spec.n_vocab, "dtype": dtype, "group_size": 16,
                "shard_samples": n_samples, "complete": True, "tokens": len(toks),
                "shards": [{"file": "features-00000.safetensors", "samples": n_samples,
                            "tokens": len(toks), "sha256": sha256_file(folder / "features-00000.safetensors")}]}
    if kv_layers:
        manifest.update(layers=[], kv_layers=list(kv_layers), kv_width=w,
                        width=spec.n_embd + 2 * w * len(kv_layers))
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


@pytest.fixture()
def tiny(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", n_layer=6, vocab=VOCAB)
    spec = load_target_spec(path)
    feats = write_features(tmp_path / "feat", spec)
    return path, spec, feats, tmp_path


def small_cfg(**kw):
    from edgespec.training.train import TrainConfig

    base = dict(steps=60, batch=4, seq_len=16, n_steps=3, draft_vocab=32, lr=3e-3, warmup=5,
                save_every=30)
    base.update(kw)
    return TrainConfig(**base)


HEAD = {"n_head": 2, "n_head_kv": 1, "head_dim": 8, "n_ff": 32}


def test_train_learns_resumes_and_evaluates(tiny):
    from edgespec.training.train import eval_head, load_checkpoint, train

    path, spec, feats, tmp = tiny
    meta = train(str(path), feats, tmp / "head", small_cfg(), head_overrides=HEAD, log=lambda m: None)
    hist = meta["train"]["history"]
    assert hist[-1]["loss"] < hist[0]["loss"] * 0.7
    assert meta["draft_vocab"]["size"] == 32 and meta["train"]["trainable_parameters"] > 0
    head, m2 = load_checkpoint(tmp / "head")
    assert m2["target_fingerprint"] == spec.tokenizer_fingerprint
    # resume past the end continues from the saved step, not from zero
    more = train(str(path), feats, tmp / "head", small_cfg(steps=70), resume=True,
                 head_overrides=HEAD, log=lambda m: None)
    assert more["train"]["steps_done"] == 60  # the saved config (60 steps) governs a resume
    r = eval_head(tmp / "head", feats, max_chain=3)
    assert r["samples"] >= 1 and len(r["acceptance_by_position"]) == 3
    # the synthetic chain is learnable (the hidden state encodes the next token): 60 steps
    # accept half the first drafts and chain on from there; a barely trained head accepts none
    assert r["expected_accepted"]["1"] >= 0.4 and r["expected_accepted"]["3"] >= 1.0
    train(str(path), feats, tmp / "raw", small_cfg(steps=6, warmup=2, save_every=6),
          head_overrides=HEAD, log=lambda m: None)
    raw = eval_head(tmp / "raw", feats, max_chain=3)["expected_accepted"]
    assert raw["1"] < 0.5 * r["expected_accepted"]["1"] and raw["3"] < 0.5 * r["expected_accepted"]["3"], (raw, r)
    late = eval_head(tmp / "head", feats, max_chain=3, start_from=10)  # samples are 30 long
    assert late["positions"] == r["positions"] - 10 * r["samples"]
    with pytest.raises(EdgespecError, match="longer than --start-from"):
        eval_head(tmp / "head", feats, max_chain=3, start_from=30)
    with pytest.raises(EdgespecError, match="already holds a checkpoint"):
        train(str(path), feats, tmp / "head", small_cfg(), head_overrides=HEAD, log=lambda m: None)


def test_init_from_continues_a_trained_head_with_a_new_schedule(tiny):
    """--init-from: a new run starts from another checkpoint's weights and draft vocabulary (its
    first loss is the trained head's, not a fresh one's), keeps its own schedule and step count,
    and says where it started; a head of another shape or a missing folder is refused."""
    from edgespec.training.train import eval_head, load_checkpoint, train

    path, spec, feats, tmp = tiny
    base = train(str(path), feats, tmp / "base", small_cfg(), head_overrides=HEAD, log=lambda m: None)
    fresh = train(str(path), feats, tmp / "fresh", small_cfg(steps=6, warmup=2, save_every=6),
                  head_overrides=HEAD, log=lambda m: None)
    cont = train(str(path), feats, tmp / "cont",
                 small_cfg(steps=6, warmup=2, save_every=6, init_from=str(tmp / "base")),
                 log=lambda m: None)
    assert cont["train"]["steps_done"] == 6 and cont["train"]["init_from"] == str(tmp / "base")
    first = cont["train"]["history"][0]["loss"]
    assert first < 0.5 * fresh["train"]["history"][0]["loss"], (first, fresh["train"]["history"][0])
    assert first < 2 * base["train"]["history"][-1]["loss"] + 0.5
    _, mb = load_checkpoint(tmp / "base")
    _, mc = load_checkpoint(tmp / "cont")
    assert (mb["draft_vocab"]["ids"] == mc["draft_vocab"]["ids"]).all()
    assert mb["head"] == mc["head"] and mc["train"]["draft_vocab"] == len(mb["draft_vocab"]["ids"])
    got = eval_head(tmp / "cont", feats, max_chain=3)["expected_accepted"]
    raw = eval_head(tmp / "fresh", feats, max_chain=3)["expected_accepted"]
    assert got["1"] > 2 * raw["1"] and got["3"] > 2 * raw["3"], (got, raw)
    with pytest.raises(EdgespecError, match="drop the head options"):
        train(str(path), feats, tmp / "c2", small_cfg(init_from=str(tmp / "base")),
              head_overrides=HEAD, log=lambda m: None)
    with pytest.raises(EdgespecError, match="no checkpoint there"):
        train(str(path), feats, tmp / "c3", small_cfg(init_from=str(tmp / "nothing")), log=lambda m: None)
    with pytest.raises(EdgespecError, match="not eagle3"):
        train(str(path), feats, tmp / "c4", small_cfg(init_from=str(tmp / "base"), arch="eagle3"),
              log=lambda m: None)


def test_topk_loss_adds_the_targets_top_tokens_cross_entropy_and_still_learns(tiny):
    """--topk-weight w: the loss is the forward KL plus w times the cross-entropy on the target's
    top-K draft tokens (checked against a hand computation on one batch), and a head trained
    with it still learns the synthetic chain."""
    from edgespec.training.features import open_features
    from edgespec.training.train import (Batcher, chain_loss, eval_head, load_checkpoint, loss_counts,
                                         split_samples, train)
    from edgespec.targets import embedding_rows

    path, spec, feats, tmp = tiny
    meta = train(str(path), feats, tmp / "topk", small_cfg(topk=3, topk_weight=1.0),
                 head_overrides=HEAD, log=lambda m: None)
    assert meta["train"]["topk_weight"] == 1.0 and meta["train"]["topk"] == 3
    r = eval_head(tmp / "topk", feats, max_chain=3)["expected_accepted"]
    assert r["1"] >= 0.4 and r["3"] >= 1.0, r
    head, m = load_checkpoint(tmp / "topk")
    f = open_features(feats)
    cfg0 = small_cfg(n_steps=1)
    idx, _ = split_samples(f, 0, 0)
    toks, hid, valid, emb = Batcher(f, idx, cfg0, embedding_rows(spec), seed=0).for_step(0)
    t2d = torch.full((spec.n_vocab,), -1, dtype=torch.long)
    t2d[torch.as_tensor(m["draft_vocab"]["ids"])] = torch.arange(len(m["draft_vocab"]["ids"]))
    counts = loss_counts(toks, valid, cfg0, t2d)
    with torch.no_grad():
        base, _ = chain_loss(head, toks, hid, valid, emb, cfg0, t2d, counts)
        w, _ = chain_loss(head, toks, hid, valid, emb, small_cfg(n_steps=1, topk=3, topk_weight=0.5),
                          t2d, counts)
        T = hid.shape[1] - 1
        out = head.forward_chain(emb[:, 1:], hid[:, :T], 1, valid=valid[:, :T])[0]
        q = torch.log_softmax(head.logits(out).float(), -1)
        p = torch.softmax(head.teacher_logits(hid[:, 1:])[:, :T], -1)
        tp, ti = p.topk(3, dim=-1)
        ce = -(tp * q.gather(-1, ti)).sum(-1)
        mask = (valid[:, 1:1 + T] & valid[:, :T]).float()
        want = 0.5 * float((ce * mask).sum()) / float(counts[0])
    assert want > 0 and abs((float(w) - float(base)) - want) < 1e-4 * max(1.0, want), (w, base, want)


def test_several_feature_folders_train_once_per_sample_and_never_on_held_out(tiny):
    from edgespec.training.features import FeatureSet, open_features
    from edgespec.training.train import eval_head, split_samples, train

    path, spec, feats, tmp = tiny
    # the same synthetic samples again (seed 0), then new ones (seed 1): a folder made from an
    # overlapping source; its held-out samples are the ones whose index is every 20th
    again = write_features(tmp / "again", spec, n_samples=24, seed=0)
    other = write_features(tmp / "other", spec, n_samples=40, seed=1)
    one = open_features(feats)
    both = open_features([feats, again, other])
    assert isinstance(both, FeatureSet) and len(both) == 24 + 24 + 40
    tr1, held1 = split_samples(one)
    tr, held = split_samples(both)
    key = lambda f, i: f.tokens[i].tobytes()  # noqa: E731
    held_keys = {key(both, i) for i in held}
    # the repeated folder adds nothing, the new one adds its own samples; a sample held out in
    # any folder is trained on in none
    assert {key(both, i) for i in tr} >= {key(one, i) for i in tr1} - held_keys
    assert len({key(both, i) for i in tr}) > len(tr1)
    assert len({key(both, i) for i in tr}) == len(tr) and not held_keys & {key(both, i) for i in tr}
    assert len(held) == len(held1) + 2  # indices 0 and 20 of `other`
    assert np.array_equal(both.hidden(24 + 24 + 5), open_features(other).hidden(5))
    # a fixed random subset by token budget, the same on every call
    sub, _ = split_samples(both, max_train_tokens=300, seed=0)
    assert sub == split_samples(both, max_train_tokens=300, seed=0)[0] and set(sub) <= set(tr)
    assert 300 <= sum(len(both.tokens[i]) for i in sub) < 300 + 30
    meta = train(str(path), [feats, other], tmp / "h2", small_cfg(steps=4, warmup=2, save_every=4,
                                                                   max_train_tokens=600),
                 head_overrides=HEAD, log=lambda m: None)
    assert meta["train"]["train_tokens"] == sum(len(both.tokens[i]) for i in
                                                split_samples(both, 600, 0)[0] if i < 24) + sum(
        len(both.tokens[i]) for i in split_samples(both, 600, 0)[0] if i >= 48)
    assert meta["train"]["features"] == [str(feats), str(other)]
    r = eval_head(tmp / "h2", [feats, other], max_chain=2)
    assert r["samples"] == len(held) and r["head_train"]["train_tokens"] == meta["train"]["train_tokens"]
    with pytest.raises(EdgespecError, match="another target"):
        tiny2 = write_tiny_gguf(tmp / "t2.gguf", n_layer=6, vocab=VOCAB + ("extra",))
        open_features([feats, write_features(tmp / "t2feat", load_target_spec(tiny2))])


def test_muon_optimizer_runs(tiny):
    from edgespec.training.train import train

    path, _, feats, tmp = tiny
    meta = train(str(path), feats, tmp / "muon", small_cfg(optimizer="muon", steps=30),
                 head_overrides=HEAD, log=lambda m: None)
    assert meta["train"]["history"][-1]["loss"] < meta["train"]["history"][0]["loss"]


def test_bad_features_are_refused(tiny):
    from edgespec.training.train import train

    path, spec, feats, tmp = tiny
    other = write_tiny_gguf(tmp / "other.gguf", vocab=("x", "y", "z"))
    with pytest.raises(EdgespecError, match="another target"):
        train(str(other), feats, tmp / "h2", small_cfg(), log=lambda m: None)
    shard = feats / "features-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(EdgespecError, match="checksum"):
        Features(feats)
    (feats / "manifest.json").write_text(json.dumps({"complete": False}))
    with pytest.raises(EdgespecError, match="incomplete"):
        Features(feats)


def test_requantize_fp16_to_int8_and_int4(tiny):
    from edgespec.training.features import requantize

    _, spec, _, tmp = tiny
    src = write_features(tmp / "f16", spec, dtype="fp16")
    ref = Features(src)
    for dtype, tol in (("int8", 0.03), ("int4", 0.3)):
        m = requantize(src, tmp / dtype, dtype, 16)
        got = Features(tmp / dtype)
        assert got.dtype == dtype and m["bytes_per_token"] < ref.manifest.get("bytes_per_token", 1e9)
        for i in range(len(ref)):
            assert (got.tokens[i] == ref.tokens[i]).all()
            a, b = ref.hidden(i), got.hidden(i)
            assert np.abs(a - b).max() <= tol * np.abs(a).max()


def test_muon_orthogonalization_matches_torch():
    """Our float32 Newton-Schulz gives torch.optim.Muon's (bfloat16) update up to bf16 error,
    and leaves singular values near 1."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from edgespec.training.train import Muon

    g = torch.randn(48, 160, generator=torch.Generator().manual_seed(0))
    ours = Muon.orthogonalize(g, 5, 1e-7)
    ref = _zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
    assert (ours - ref).abs().max() < 0.05 * ours.abs().max()
    s = torch.linalg.svdvals(ours)
    assert 0.5 < s.min() and s.max() < 1.5


def test_unwritable_output_fails_before_training(tiny):
    from edgespec.training.train import train

    path, _, feats, tmp = tiny
    blocker = tmp / "a-file"
    blocker.write_text("x")
    with pytest.raises(EdgespecError, match="cannot write a checkpoint here"):
        train(str(path), feats, blocker / "head", small_cfg(), head_overrides=HEAD,
              log=lambda m: pytest.fail("training started"))


def test_writes_that_fail_leave_nothing_and_say_why(tmp_path):
    import errno

    from edgespec.io import atomic_write

    def disk_full(tmp):
        with open(tmp, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    def library_error(tmp):
        raise RuntimeError("writer gave up\nsecond line")

    for fn, msg in ((disk_full, r"write failed \(No space left on device\)"),
                    (library_error, r"write failed \(RuntimeError: writer gave up second line\)")):
        with pytest.raises(EdgespecError, match=msg):
            atomic_write(tmp_path / "out.bin", fn)
        assert list(tmp_path.iterdir()) == []  # no half file, no temp file


def test_kill_soak_training_resumes_to_the_same_weights(tiny):
    """`edgespec train --resume`, killed with SIGKILL at random moments and started again, ends
    with the weights of an uninterrupted run, bit for bit (the state file carries the weights,
    the optimizers and the batch stream of its step)."""
    from safetensors.numpy import load_file

    from soak import kill_soak

    path, _, feats, tmp = tiny
    args = ["train", "--target", str(path), "--features", str(feats), "--steps", "80", "--batch", "4",
            "--seq-len", "16", "--unroll", "3", "--draft-vocab", "32", "--threads", "1",
            "--layer-types", "sliding,global", "--resume"]
    args += ["--save-every", "5"]
    kill_soak([*args, "--out", str(tmp / "whole")], kills=0, window=(0, 0))

    def saved_step():
        state = tmp / "soaked" / "train_state.pt"
        return torch.load(state, weights_only=False)["step"] if state.exists() else 0

    steps = kill_soak([*args, "--out", str(tmp / "soaked")], kills=5, window=(2.5, 6.0), progress=saved_step,
                      first_when=lambda: saved_step() >= 20)
    assert any(0 < s < 80 for s in steps), steps  # at least one resume from the middle
    a, b = load_file(str(tmp / "whole" / "model.safetensors")), load_file(str(tmp / "soaked" / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_a_checkpoint_is_whole_after_its_weights_are_saved(tmp_path):
    """The weights file carries the config: a save killed before config.json was rewritten
    (here: a stale config.json from another save) still loads as the weights describe."""
    from edgespec.runtime.formats import read_checkpoint_head
    from edgespec.training.train import load_checkpoint
    from test_exporters import make_ckpt

    head, ckpt = make_ckpt(tmp_path)
    stale = json.loads((ckpt / "config.json").read_text())
    stale["head"]["n_layer"] = 7
    stale["target_fingerprint"] = "from-an-older-save"
    (ckpt / "config.json").write_text(json.dumps(stale))
    loaded, meta = load_checkpoint(ckpt)
    assert meta["target_fingerprint"] == "abc" and loaded.c == head.c
    assert read_checkpoint_head(ckpt).fingerprint == "abc"
    (ckpt / "config.json").unlink()  # killed before the first config.json was written
    assert read_checkpoint_head(ckpt).config == head.c


TRAIN_ARGS = ["--steps", "16", "--batch", "4", "--seq-len", "16", "--unroll", "3", "--draft-vocab", "32",
              "--threads", "1", "--layer-types", "sliding,global", "--save-every", "4"]


def _torchrun(n: int, args: list[str], **kw):
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", EDGESPEC_NO_PROGRESS="1")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={n}", "-m", "edgespec", "train", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.integration
def test_two_gloo_ranks_train_what_one_process_trains(tiny):
    """torchrun with 2 CPU ranks (gloo) splits each global batch; the loss curve and the final
    weights equal a one-process run with the same global batch and seed (float tolerance), and
    the checkpoint records the world size. A batch that does not split is refused."""
    import subprocess
    import sys

    from safetensors.numpy import load_file

    path, _, feats, tmp = tiny
    base = ["--target", str(path), "--features", str(feats), *TRAIN_ARGS]
    one = subprocess.run([sys.executable, "-m", "edgespec", "train", *base, "--out", str(tmp / "one")],
                         capture_output=True, text=True, env=dict(os.environ, EDGESPEC_NO_PROGRESS="1"))
    assert one.returncode == 0, one.stderr
    p = _torchrun(2, [*base, "--out", str(tmp / "two")])
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
    assert len([ln for ln in out.splitlines() if ln.startswith("{")]) == 1  # rank 0 reports
    c1 = json.loads((tmp / "one" / "config.json").read_text())["train"]
    c2 = json.loads((tmp / "two" / "config.json").read_text())["train"]
    assert c1["world_size"] == 1 and c2["world_size"] == 2 and c2["backend"] == "gloo"
    l1 = [h["loss"] for h in c1["history"]]
    l2 = [h["loss"] for h in c2["history"]]
    assert len(l1) == len(l2) >= 2 and np.allclose(l1, l2, rtol=1e-3, atol=1e-4), (l1, l2)
    a, b = load_file(str(tmp / "one" / "model.safetensors")), load_file(str(tmp / "two" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert np.allclose(a[k], b[k], rtol=1e-3, atol=1e-4), k
    odd = _torchrun(2, ["--target", str(path), "--features", str(feats), *TRAIN_ARGS, "--batch", "3",
                        "--out", str(tmp / "odd")])
    _, err = odd.communicate(timeout=300)
    assert odd.returncode != 0 and "does not split over 2 ranks" in err


@pytest.mark.integration
def test_a_killed_rank_fails_the_job_and_resume_continues(tiny):
    """SIGKILL one of two ranks mid-run: the job fails (torchrun names the dead rank), nothing
    is left half-written, and the same command with --resume finishes from the last checkpoint."""
    import signal
    import subprocess
    import time

    path, _, feats, tmp = tiny
    args = ["--target", str(path), "--features", str(feats), *TRAIN_ARGS, "--steps", "200",
            "--out", str(tmp / "run")]
    state = tmp / "run" / "train_state.pt"
    p = _torchrun(2, args)
    deadline = time.time() + 240
    while not state.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert p.poll() is None, "the run ended before its first checkpoint"
    kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    assert len(kids) == 2, kids
    os.kill(int(kids[-1]), signal.SIGKILL)
    _, err = p.communicate(timeout=300)
    assert p.returncode != 0
    assert "SIGKILL" in err or "lost contact with another rank" in err, err[-2000:]
    saved = torch.load(state, weights_only=False)["step"]
    assert 0 < saved < 200
    again = _torchrun(2, [*args, "--resume"])
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 200


def test_chain_acceptance_follows_a_chain_only_where_the_text_is_the_targets_choice():
    import torch

    from edgespec.training.train import chain_counts

    # the target's greedy token after each position, and a text that leaves that path after
    # positions 2 and 5 (the text's token 3 is not the target's choice after 2, nor 6 after 5)
    target_next = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    toks = torch.tensor([0, 1, 2, 99, 4, 5, 99, 7, 8, 9, 10])
    T = 6
    # a head that always drafts the target's choice: every draft it makes is accepted, and a
    # chain stops being followed (not rejected) where its context leaves the text
    perfect = [target_next[j + 1:j + 1 + T] for j in range(3)]
    tried, hits = chain_counts(perfect, target_next, toks)
    assert list(hits) == list(tried) and tried[0] == T
    # draft 2 at start t reads the text's token t + 2: on the path unless t + 2 is 3 or 6
    assert tried[1] == sum(1 for t in range(T) if t + 2 not in (3, 6))
    assert tried[2] == sum(1 for t in range(T) if not {t + 2, t + 3} & {3, 6})
    # a miss at position 1 ends the chain there; the text's detour no longer matters for it
    miss = [d.clone() for d in perfect]
    miss[0][0] = -1
    tried2, hits2 = chain_counts(miss, target_next, toks)
    assert tried2[0] == T and hits2[0] == T - 1 and tried2[1] == tried[1] - 1
    # start_from counts only later chain starts
    late, _ = chain_counts(perfect, target_next, toks, start_from=4)
    assert late[0] == 2
