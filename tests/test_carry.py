"""`train --carry DIR`: a run's resumable state in files small enough to commit, continued on
another machine (training/carry.py)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgespec.errors import EdgespecError  # noqa: E402
from test_train import HEAD, small_cfg, tiny, write_features  # noqa: E402,F401


class MachineLost(Exception):
    pass


def _lose_machine_at(monkeypatch, step):
    """The run stops as a machine handed back would: mid-run, after its last checkpoint."""
    from edgespec.training import train as tr

    real = tr.Batcher.for_step

    def for_step(self, s):
        if s == step:
            raise MachineLost
        return real(self, s)

    monkeypatch.setattr(tr.Batcher, "for_step", for_step)


@pytest.mark.parametrize("arch,over", [("mtp", HEAD), ("shared-kv", {"n_ff": 32, "d_model": 24})])
def test_a_carried_run_continues_on_a_fresh_machine_as_it_would_have_gone_on(tiny, tmp_path, monkeypatch,
                                                                             arch, over):
    from edgespec.training.carry import CARRY_FILE, MAX_FILE
    from edgespec.training.train import load_checkpoint, train

    path, spec, feats, tmp = tiny
    if arch == "shared-kv":
        feats = write_features(tmp / "feat-kv", spec, dtype="fp16", kv_layers=(4, 5))
    cfg = lambda: small_cfg(arch=arch, steps=40, save_every=10, optimizer="adamw")  # noqa: E731
    whole = train(str(path), feats, tmp / "whole", cfg(), head_overrides=over, log=lambda m: None)
    with monkeypatch.context() as m:
        _lose_machine_at(m, 25)
        with pytest.raises(MachineLost):
            train(str(path), feats, tmp / "first", cfg(), head_overrides=over, log=lambda m: None,
                  carry=tmp / "carry")
    doc = json.loads((tmp / "carry" / CARRY_FILE).read_text())
    assert doc["state"]["step"] == 20 and doc["recipe"]["train"]["arch"] == arch
    files = [tmp / "carry" / f for f in doc["files"]]
    assert sorted(p.name for p in (tmp / "carry").iterdir()) == sorted([CARRY_FILE] + doc["files"])
    assert all(p.stat().st_size < MAX_FILE + 2 ** 16 for p in files)  # one step's files, small
    logs = []
    again = train(str(path), feats, tmp / "fresh", cfg(), resume=True, head_overrides=over,
                  log=logs.append, carry=tmp / "carry")  # another machine: only the carry is there
    assert any("carried" in m and "step 20" in m for m in logs)
    assert again["train"]["steps_done"] == 40
    a, b = whole["train"]["history"], again["train"]["history"]
    assert [h["step"] for h in a] == [h["step"] for h in b]
    for x, y in zip(a, b):  # the same batches; the state rounded to fp16 / bf16 once
        assert y["loss"] == pytest.approx(x["loss"], rel=0.05), (x, y)
    ha, _ = load_checkpoint(tmp / "whole")
    hb, _ = load_checkpoint(tmp / "fresh")
    for (n, p), (_, q) in zip(ha.state_dict().items(), hb.state_dict().items()):
        assert torch.allclose(p, q, rtol=0.05, atol=0.02), n
    from edgespec.runtime.formats import DRAFT_IDS, read_checkpoint

    assert (read_checkpoint(tmp / "whole")[1][DRAFT_IDS] == read_checkpoint(tmp / "fresh")[1][DRAFT_IDS]).all()
    assert (tmp / "carry" / CARRY_FILE).exists() and json.loads(
        (tmp / "carry" / CARRY_FILE).read_text())["state"]["step"] == 40


def test_a_carried_state_is_refused_for_another_recipe(tiny, monkeypatch):
    from edgespec.training.train import train

    path, spec, feats, tmp = tiny
    train(str(path), feats, tmp / "a", small_cfg(steps=20, save_every=10), head_overrides=HEAD,
          log=lambda m: None, carry=tmp / "carry")
    before = (tmp / "carry" / "carry.json").read_text()
    other = write_features(tmp / "other", spec, seed=1)
    with pytest.raises(EdgespecError, match="another recipe: features.tokens_sha256"):
        train(str(path), other, tmp / "b", small_cfg(steps=20, save_every=10), resume=True,
              head_overrides=HEAD, log=lambda m: None, carry=tmp / "carry")
    with pytest.raises(EdgespecError, match="another recipe: train.lr"):
        train(str(path), feats, tmp / "b", small_cfg(steps=20, save_every=10, lr=1e-3), resume=True,
              head_overrides=HEAD, log=lambda m: None, carry=tmp / "carry")
    with pytest.raises(EdgespecError, match="already carries a run"):
        train(str(path), feats, tmp / "c", small_cfg(steps=20, save_every=10), head_overrides=HEAD,
              log=lambda m: None, carry=tmp / "carry")
    assert (tmp / "carry" / "carry.json").read_text() == before  # nothing lost
    assert not (tmp / "b").exists() or not (tmp / "b" / "train_state.pt").exists()
    (tmp / "bad").mkdir()
    (tmp / "bad" / "carry.json").write_text("{not json")
    with pytest.raises(EdgespecError, match="unreadable carry state"):
        train(str(path), feats, tmp / "d", small_cfg(steps=20), resume=True, head_overrides=HEAD,
              log=lambda m: None, carry=tmp / "bad")


def test_carry_from_the_command_line(tiny, tmp_path):
    from test_cli import edgespec

    path, spec, feats, tmp = tiny
    args = ["train", "--target", str(path), "--features", str(feats), "--steps", "12", "--batch", "2",
            "--seq-len", "16", "--draft-vocab", "32", "--save-every", "6", "--carry", str(tmp / "carry")]
    r = edgespec(*args, "--out", str(tmp / "a"))
    assert r.returncode == 0, r.stderr
    r = edgespec(*args, "--out", str(tmp / "b"), "--lr", "0.01", "--resume")
    assert r.returncode == 2 and "another recipe" in r.stderr and "Traceback" not in r.stderr
    assert np.isfinite(json.loads((tmp / "carry" / "carry.json").read_text())["state"]["history"][-1]["loss"])


def test_carry_reads_damaged_files_cleanly_and_takes_fields_it_did_not_know(tiny):
    from edgespec.training.train import train

    path, spec, feats, tmp = tiny
    cfg = lambda: small_cfg(steps=20, save_every=10)  # noqa: E731
    train(str(path), feats, tmp / "a", cfg(), head_overrides=HEAD, log=lambda m: None, carry=tmp / "carry")
    doc = json.loads((tmp / "carry" / "carry.json").read_text())
    del doc["recipe"]["train"]["topk"]  # written by a version without this field (its default)
    (tmp / "carry" / "carry.json").write_text(json.dumps(doc))
    more = train(str(path), feats, tmp / "fresh", small_cfg(steps=20, save_every=10), resume=True,
                 head_overrides=HEAD, log=lambda m: None, carry=tmp / "carry")
    assert more["train"]["steps_done"] == 20
    part = tmp / "carry" / json.loads((tmp / "carry" / "carry.json").read_text())["files"][0]
    part.write_text("version https://git-lfs.github.com/spec/v1\n")  # a pointer, not the file
    with pytest.raises(EdgespecError, match="unreadable carry state"):
        train(str(path), feats, tmp / "other", cfg(), resume=True, head_overrides=HEAD,
              log=lambda m: None, carry=tmp / "carry")


def test_a_carried_state_starts_a_new_run_on_other_data(tiny):
    """`--init-from CARRY_DIR`: a later stage with another recipe (other flags, other features)
    starts from the weights a carried run reached, with no need to re-make that run's features
    first: its first loss is the carried head's, not a fresh one's, and it keeps the carried
    draft vocabulary; `eval-head` reads the carried state too. The carried state is left as it
    was; a carry of another arch or a damaged one is refused clearly."""
    from edgespec.training.train import eval_head, load_checkpoint, train

    path, spec, feats, tmp = tiny
    base = train(str(path), feats, tmp / "base", small_cfg(), head_overrides=HEAD,
                 log=lambda m: None, carry=tmp / "carry")
    before = (tmp / "carry" / "carry.json").read_text()
    cfg = lambda **kw: small_cfg(steps=6, warmup=2, save_every=6, lr=1e-3, **kw)  # noqa: E731
    fresh = train(str(path), feats, tmp / "fresh", cfg(), head_overrides=HEAD, log=lambda m: None)
    cont = train(str(path), feats, tmp / "cont", cfg(init_from=str(tmp / "carry")), log=lambda m: None)
    first = cont["train"]["history"][0]["loss"]
    assert first < 0.5 * fresh["train"]["history"][0]["loss"], (first, fresh["train"]["history"][0])
    assert first < 2 * base["train"]["history"][-1]["loss"] + 0.5
    other = write_features(tmp / "other", spec, seed=1)
    train(str(path), other, tmp / "cont2", cfg(init_from=str(tmp / "carry")), log=lambda m: None)
    _, mb = load_checkpoint(tmp / "base")
    for run in ("cont", "cont2"):
        _, mc = load_checkpoint(tmp / run)
        assert (mb["draft_vocab"]["ids"] == mc["draft_vocab"]["ids"]).all() and mb["head"] == mc["head"]
    assert (tmp / "carry" / "carry.json").read_text() == before
    # eval-head reads a carried state as the checkpoint of its step (weights rounded to fp16)
    at_carry = eval_head(tmp / "carry", feats, max_chain=3)["acceptance_by_position"]
    at_ckpt = eval_head(tmp / "base", feats, max_chain=3)["acceptance_by_position"]
    assert at_carry == pytest.approx(at_ckpt, abs=0.03) and at_ckpt[0] > 0.2
    with pytest.raises(EdgespecError, match="not eagle3"):
        train(str(path), other, tmp / "c2", cfg(init_from=str(tmp / "carry"), arch="eagle3"),
              log=lambda m: None)
    doc = json.loads(before)
    (tmp / "bad").mkdir()
    (tmp / "bad" / "carry.json").write_text(json.dumps({**doc, "files": []}))
    with pytest.raises(EdgespecError, match="unreadable carry state"):
        train(str(path), other, tmp / "c3", cfg(init_from=str(tmp / "bad")), log=lambda m: None)
