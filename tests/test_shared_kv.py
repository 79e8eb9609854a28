"""The shared-KV head (training/shared_kv.py): query-only attention into the target's keys and
values, trained on features that store them (`extract --kv`)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgespec.errors import EdgespecError  # noqa: E402
from edgespec.runtime.formats import HeadConfig, SharedKVConfig, head_arch  # noqa: E402
from edgespec.targets import load_target_spec  # noqa: E402
from test_targets import write_tiny_gguf  # noqa: E402
from test_train import VOCAB, small_cfg, write_features  # noqa: E402


def _config(**kw):
    c = dict(n_embd=16, n_draft_vocab=12, kv_layers=[4, 5], layer_types=["sliding", "global"],
             n_head=2, n_head_kv=1, head_dim=8, d_model=24, n_ff=32, sliding_window=8)
    c.update(kw)
    return SharedKVConfig(**c)


def _head(seed=0, **kw):
    from edgespec.training.shared_kv import SharedKVHead

    torch.manual_seed(seed)
    h = SharedKVHead(_config(**kw))
    h.lm_head.normal_()
    for p in h.parameters():  # RMSNorm weights start at 0 (Gemma's 1 + w): perturb them too
        p.data.add_(0.1 * torch.randn_like(p))
    return h.eval()


def _inputs(T=20, n_steps=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(1, T + n_steps, 16, generator=g)
    hid = torch.randn(1, T, 16, generator=g)
    kv = torch.randn(1, T + 5, 2 * 8 * 2, generator=g)
    return emb, hid, kv


@torch.no_grad()
def test_training_chain_equals_run_time_steps_at_one_position():
    """Every step of the chain starting after position t sits at t + 1 and reads the target's
    keys at positions <= t; its input is its own last output: stepping one chain by hand gives
    what the training-time unroll gives at that start."""
    head = _head()
    emb, hid, kv = _inputs()
    T, n = hid.shape[1], 3
    outs = head.forward_chain(emb, hid, n, kv=kv, kv_valid=torch.ones(1, kv.shape[1], dtype=torch.bool))
    pairs = head.split_kv(kv)
    for t in (0, 7, 15):
        qpos = torch.tensor([[t + 1]])
        masks = head.masks(qpos, torch.ones(1, kv.shape[1], dtype=torch.bool))
        h = hid[:, t:t + 1]
        for j in range(n):
            h = head.forward_steps(head.step_input(emb[:, t + j:t + j + 1], h), qpos, pairs, masks)
            assert torch.allclose(h[0, 0], outs[j][0, t], atol=1e-5), (t, j)


@torch.no_grad()
def test_a_query_sees_the_keys_before_it_and_sliding_layers_only_their_window():
    head = _head()
    emb, hid, kv = _inputs()
    ones = torch.ones(1, kv.shape[1], dtype=torch.bool)
    base = head.forward_chain(emb, hid, 2, kv=kv, kv_valid=ones)
    t = 12  # chain start: query position 13, keys 0..12; the sliding window (8) keeps 6..12
    later = kv.clone()
    later[:, t + 1:] += 5.0  # keys and values the query must not see yet
    out = head.forward_chain(emb, hid, 2, kv=later, kv_valid=ones)
    assert torch.allclose(out[1][0, t], base[1][0, t], atol=1e-5)
    assert not torch.allclose(out[1][0, t + 1], base[1][0, t + 1], atol=1e-3)
    w = 8  # one KV layer's keys + values = 16 floats; the sliding layer's come first
    old = kv.clone()
    old[:, :t - 7 + 1, :2 * w] += 5.0  # outside the sliding layer's window (positions <= 5)
    out = head.forward_chain(emb, hid, 2, kv=old, kv_valid=ones)
    assert torch.allclose(out[0][0, t], base[0][0, t], atol=1e-5)
    old[:, :t - 7 + 1, 2 * w:] += 5.0  # the global layer sees them
    out = head.forward_chain(emb, hid, 2, kv=old, kv_valid=ones)
    assert not torch.allclose(out[0][0, t], base[0][0, t], atol=1e-3)
    inside = kv.clone()
    inside[:, t, :2 * w] += 5.0  # the newest key, inside the window
    out = head.forward_chain(emb, hid, 2, kv=inside, kv_valid=ones)
    assert not torch.allclose(out[0][0, t], base[0][0, t], atol=1e-3)



@torch.no_grad()
def test_grouped_attention_reads_each_query_heads_own_kv_head():
    """The block stacks the query heads that share a KV head into one matmul (no copy per query
    head): with two KV heads and a mask it equals attention done head by head, query head h over
    KV head h // (n_head / n_head_kv); with no mask, every key."""
    import torch.nn.functional as F

    from edgespec.training.head import rope
    from edgespec.training.shared_kv import SharedKVBlock

    torch.manual_seed(3)
    c = _config(n_head=4, n_head_kv=2)
    blk = SharedKVBlock(c, 1).eval()
    for p in blk.parameters():
        p.data.add_(0.1 * torch.randn_like(p))
    b, t, s, hd = 2, 3, 7, c.head_dim
    x, k, v = torch.randn(b, t, c.d_model), torch.randn(b, s, 2, hd), torch.randn(b, s, 2, hd)
    qpos = torch.tensor([[4, 5, 6], [2, 2, 2]])
    mask = torch.rand(b, t, s) > 0.4
    mask[..., 0] = True  # no row without a key

    def by_hand(mask):
        q = rope(blk.q_norm(blk.q(blk.input_norm(x)).view(b, t, 4, hd)), qpos, blk.base)
        heads = []
        for h in range(4):
            sc = torch.einsum("btd,bsd->bts", q[:, :, h], k[:, :, h // 2]) * c.scale
            if mask is not None:
                sc = sc.masked_fill(~mask, float("-inf"))
            heads.append(torch.softmax(sc, -1) @ v[:, :, h // 2])
        y = x + blk.post_attn_norm(blk.o(torch.cat(heads, -1)))
        f = blk.pre_ffn_norm(y)
        return y + blk.post_ffn_norm(blk.down(F.gelu(blk.gate(f), approximate="tanh") * blk.up(f)))

    assert torch.allclose(blk(x, qpos, k, v, mask), by_hand(mask), atol=1e-5)
    assert torch.allclose(blk(x, qpos, k, v), by_hand(None), atol=1e-5)
    swapped = k.flip(2)  # KV heads in the other order: the output must change
    assert not torch.allclose(blk(x, qpos, swapped, v, mask), by_hand(mask), atol=1e-3)

def test_config_round_trip_and_refusals():
    c = _config()
    assert SharedKVConfig.from_dict(c.to_dict()) == c and head_arch(c.to_dict()) == "shared-kv"
    with pytest.raises(EdgespecError, match="not an MTP head"):
        HeadConfig.from_dict(c.to_dict())  # a shared-KV checkpoint is never read as an MTP head
    with pytest.raises(EdgespecError, match="one layer id and type per head layer"):
        SharedKVConfig.from_dict(dict(c.to_dict(), layer_types=["sliding"]))
    with pytest.raises(EdgespecError, match="not a shared-KV head"):
        SharedKVConfig.from_dict(dict(c.to_dict(), arch="mtp"))


@torch.no_grad()
def test_input_norms_make_the_input_independent_of_its_scale():
    """input_norms: the embedding and the hidden state are RMS-normed before pre_proj (as the
    MTP head's), so scaling either changes nothing; without them it does."""
    emb, hid, kv = _inputs()
    normed, plain = _head(input_norms=True), _head()
    for head, same in ((normed, True), (plain, False)):
        a = head.step_input(emb[:, :4], hid[:, :4])
        b = head.step_input(3.0 * emb[:, :4], 0.5 * hid[:, :4])
        assert torch.allclose(a, b, atol=1e-4) == same


def write_kv_features(folder, spec, kv_layers=(4, 5)):
    """Synthetic features in `extract --kv`'s layout (test_train.write_features)."""
    return write_features(folder, spec, dtype="fp16", kv_layers=kv_layers)


@pytest.fixture()
def tiny_kv(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", n_layer=6, vocab=VOCAB)
    spec = load_target_spec(path)
    return path, spec, write_kv_features(tmp_path / "feat-kv", spec), tmp_path


def test_shared_kv_head_trains_resumes_and_evaluates(tiny_kv):
    from edgespec.training.features import Features, default_kv_layers
    from edgespec.training.train import eval_head, load_checkpoint, train

    path, spec, feats, tmp = tiny_kv
    assert default_kv_layers(spec) == (4, 5)  # the last sliding and the last global layer
    f = Features(feats)
    assert f.kv_layers == (4, 5) and f.width == spec.n_embd + 2 * 2 * f.kv_width
    cfg = small_cfg(arch="shared-kv")
    meta = train(str(path), feats, tmp / "skv", cfg, head_overrides={"n_ff": 32, "d_model": 24},
                 log=lambda m: None)
    hist = meta["train"]["history"]
    assert hist[-1]["loss"] < hist[0]["loss"] * 0.7
    head, m = load_checkpoint(tmp / "skv")
    assert head_arch(m["head"]) == "shared-kv" and head.c.kv_layers == [4, 5]
    assert head.c.layer_types == ["sliding", "global"] and head.c.d_model == 24
    r = eval_head(tmp / "skv", feats, max_chain=3)
    assert r["expected_accepted"]["1"] >= 0.4, r
    # every sample of a folder of held-out text (not only its held-out twentieth), and only the
    # chain starts past a prompt
    every = eval_head(tmp / "skv", feats, max_chain=3, all_samples=True)
    assert every["samples"] == len(f.sample_ids()) > r["samples"]
    later = eval_head(tmp / "skv", feats, max_chain=3, all_samples=True, start_from=8)
    assert 0 < later["positions"] < every["positions"]
    more = train(str(path), feats, tmp / "skv", small_cfg(arch="shared-kv", steps=70), resume=True,
                 log=lambda m: None)
    assert more["train"]["steps_done"] == 60
    # an MTP head trains on the same features (their final hidden states)
    mtp = train(str(path), feats, tmp / "mtp", small_cfg(steps=6, warmup=2, save_every=6),
                head_overrides={"n_head": 2, "n_head_kv": 1, "head_dim": 8, "n_ff": 32},
                log=lambda m: None)
    assert mtp["train"]["steps_done"] == 6


def test_shared_kv_refusals(tiny_kv, tmp_path):
    from edgespec.runtime.formats import read_checkpoint_head
    from edgespec.training.train import eval_head, train

    path, spec, feats, tmp = tiny_kv
    plain = write_features(tmp / "plain", spec)
    with pytest.raises(EdgespecError, match="extract with --kv"):
        train(str(path), plain, tmp / "a", small_cfg(arch="shared-kv"), log=lambda m: None)
    train(str(path), feats, tmp / "skv", small_cfg(arch="shared-kv", steps=4, warmup=2, save_every=4),
          log=lambda m: None)
    other = write_kv_features(tmp / "other-map", spec, kv_layers=(3, 5))
    with pytest.raises(EdgespecError, match="keys and values of layers"):
        train(str(path), other, tmp / "skv", small_cfg(arch="shared-kv", steps=8), resume=True,
              log=lambda m: None)
    with pytest.raises(EdgespecError, match="keys and values of layers"):
        eval_head(tmp / "skv", other, max_chain=2)
    with pytest.raises(EdgespecError, match="keys and values of layers"):
        eval_head(tmp / "skv", plain, max_chain=2)
    with pytest.raises(EdgespecError, match="shared-KV head"):
        read_checkpoint_head(tmp / "skv")  # where an MTP head file is read (drafting, export)


@pytest.mark.integration
def test_extract_kv_stores_the_keys_the_gemma_cache_holds(tmp_path):
    """`extract --kv` on the real Gemma 3 270M: the last sliding and the last global layer
    (16, 17), and each key row is the post-norm key turned by RoPE at its position, as the
    cache stores it (checked against the pre-RoPE tensor read from the same graph)."""
    from edgespec.runtime.llama_target import LlamaTarget
    from edgespec.training.data import DataConfig, make_data
    from edgespec.training.features import ExtractConfig, Features, default_kv_layers, extract

    spec = load_target_spec("gemma3-270m")
    kv = default_kv_layers(spec)
    assert kv == (16, 17) and [spec.layer_types[i] for i in kv] == ["sliding", "global"]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Rivers, cities and trains, part {i}:"}) + "\n"
                           for i in range(4)))
    make_data("gemma3-270m", [str(src)], tmp_path / "d",
              DataConfig(n_prompts=4, prompt_tokens=8, new_tokens=24, sample_share=0.0))
    m = extract("gemma3-270m", tmp_path / "d", tmp_path / "f",
                ExtractConfig(dtype="fp16", kv_layers=kv, shard_samples=2))
    w = spec.n_head_kv * spec.head_dim
    assert m["kv_layers"] == [16, 17] and m["kv_width"] == w == 256
    assert m["width"] == spec.n_embd + 4 * w and m["kv_layer_types"] == ["sliding", "global"]
    f = Features(tmp_path / "f")
    toks = [int(t) for t in f.tokens[1]]
    rows = f.hidden(1)
    assert rows.shape == (len(toks), spec.n_embd + 4 * w)
    eng = LlamaTarget("gemma3-270m", n_ctx=256, n_batch=64, lm_head="full", probe=True)
    try:  # the pre-RoPE keys of the same tokens, read from the graph by name
        eng._set_embeddings(False)
        names = [b"Kcur_normed-16", b"Kcur_normed-17"]
        eng._grabbed.clear()
        eng._grab_layers.clear()
        eng._grab_layers.update(names)
        eng._grab = True
        eng._run_batch([(0, 0, toks, [True] * len(toks))])
        eng._grab = False
        pre = {n: r.reshape(len(toks), w) for n, r in eng._grabbed if n in names}
    finally:
        eng.close()
    pos = np.arange(len(toks))[:, None]
    for i, (name, base) in enumerate(zip(names, (spec.rope_base_local, spec.rope_base_global))):
        ang = pos * (1.0 / base ** (np.arange(0, w, 2) / w))
        ang = np.concatenate([ang, ang], 1)
        k = pre[name]
        turned = k * np.cos(ang) + np.concatenate([-k[:, w // 2:], k[:, :w // 2]], 1) * np.sin(ang)
        stored = rows[:, spec.n_embd + 2 * i * w:spec.n_embd + (2 * i + 1) * w]
        assert np.abs(stored - turned).max() <= 2e-2 * np.abs(turned).max()  # fp16 storage
        assert np.abs(stored - k).max() > 0.1 * np.abs(k).max()  # not the unturned keys


# -- run time: the numpy head, the engine's keys and values, the drafter in the decode loop ----

@torch.no_grad()
def test_numpy_head_steps_equal_the_torch_head():
    """runtime/heads.SharedKVNumpyHead is the torch head step for step (RoPE of the query,
    the sliding window, the input norms, the frozen LM head)."""
    from edgespec.runtime.heads import SharedKVNumpyHead

    for norms in (False, True):
        head = _head(input_norms=norms)
        emb, hid, kv = _inputs(T=20)
        w = {k: v.numpy() for k, v in head.state_dict().items()}
        nh = SharedKVNumpyHead(head.c, w)
        pairs = head.split_kv(kv)
        keys = [k[0].numpy() for k, _ in pairs]
        values = [v[0].numpy() for _, v in pairs]
        for t in (0, 5, 14):  # chains before and after the sliding window (8) fills
            qpos = t + 1
            masks = head.masks(torch.tensor([[qpos]]), torch.ones(1, kv.shape[1], dtype=torch.bool))
            h, x = hid[:, t:t + 1], hid[0, t:t + 1].numpy()
            for j in range(3):
                h = head.forward_steps(head.step_input(emb[:, t + j:t + j + 1], h),
                                       torch.tensor([[qpos]]), pairs, masks)
                x, lg = nh.step(emb[0, t + j:t + j + 1].numpy(), x, qpos, keys, values)
                assert np.allclose(x, h[0].numpy(), atol=1e-4), (norms, t, j)
                assert np.allclose(lg[0], head.logits(h)[0, 0].numpy(), atol=1e-3)


def _gemma_kv_checkpoint(folder, spec, seed=0, input_norms=True):
    """A shared-KV head for the real Gemma 3 270M with random weights (small width): what the
    run-time tests need is the shape of the real thing, not its skill."""
    from edgespec.training.shared_kv import SharedKVHead
    from edgespec.training.train import save_checkpoint, shared_kv_config_for

    torch.manual_seed(seed)
    ids = np.arange(2, 514, dtype=np.int64)
    head = SharedKVHead(shared_kv_config_for(spec, len(ids), (16, 17), d_model=64, n_ff=64,
                                             input_norms=input_norms))
    from edgespec.targets import embedding_rows

    head.lm_head.copy_(torch.as_tensor(np.asarray(embedding_rows(spec)[ids], np.float32)))
    meta = {"format": "edgespec-head", "version": 1, "target": spec.name, "target_path": str(spec.path),
            "target_fingerprint": spec.tokenizer_fingerprint, "target_arch": spec.arch,
            "draft_vocab": {"ids": ids.tolist()}}
    save_checkpoint(folder, head, meta)
    return folder


@pytest.mark.integration
@pytest.mark.parametrize("lm_head,temperature", [("auto", 0.0), ("full", 0.8)])
def test_shared_kv_drafter_holds_the_keys_the_cache_holds(tmp_path, monkeypatch, lm_head, temperature):
    """On the real Gemma 3 270M, a shared-KV head (with prompt lookup) drafts in the decode loop:
    the keys, values and hidden states it was handed by the verify passes (through the probe
    that stops before the LM head, or one that lets llama.cpp's own head finish) are those of
    the final text's positions, rejected drafts rolled back, as a fresh decode of that text
    computes them; greedy text is target-only decoding's."""
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    from edgespec.runtime.decoding import Generation
    from edgespec.runtime.drafters import MixedDrafter, SharedKVDrafter, make_drafter, reads_kv
    from edgespec.runtime.llama_target import LlamaTarget
    from edgespec.runtime.policies import FixedK
    from edgespec.runtime.sampling import SamplingParams

    spec = load_target_spec("gemma3-270m")
    ckpt = _gemma_kv_checkpoint(tmp_path / "skv", spec)
    assert reads_kv(str(ckpt)) and reads_kv(f"head:{ckpt}") and not reads_kv("default")
    drafter = make_drafter(str(ckpt), spec)
    assert isinstance(drafter, MixedDrafter) and isinstance(drafter.head, SharedKVDrafter)
    eng = LlamaTarget("gemma3-270m", n_ctx=512, n_batch=64, lm_head=lm_head, probe=True)
    sp = SamplingParams(temperature=temperature, seed=3)
    # lookup drafts where the text repeats (accepted runs), the head everywhere else (rejected:
    # its weights are random), so passes keep some rows and roll others back
    prompt = eng.tokenize("Write a list of fruit, one per line: apple, pear, plum. A list of fruit:")
    try:
        # target-only first: the cache then holds the drafted run's text, which the next call
        # extends (sampled, the two texts may part where a draw moves with the batch)
        base = Generation(eng, prompt, sp, max_tokens=48, policy=FixedK(0))
        list(base)
        gen = Generation(eng, prompt, sp, max_tokens=48, drafter=drafter, policy=FixedK(3))
        list(gen)
        if sp.greedy:  # (sampled text keeps the target's law; its rows' rounding moves with
            assert gen.token_ids == base.token_ids  # the batch, and so do some draws)
        st = gen.stats
        assert st.by_source.get(drafter.head.source, [0, 0])[1] > 0, st.by_source  # the head drafted
        assert st.accepted > 0 and st.drafted > st.accepted  # some kept, some rolled back
        context = list(prompt) + gen.token_ids
        head = drafter.head
        assert head.kv_held(context) == len(context) - 1
        # a next call that extends this text (a chat's next turn) keeps the cache and the
        # head's rows for the common prefix, and decodes only the rest
        more = context + eng.tokenize(" And vegetables:", add_bos=False)
        gen = Generation(eng, more, sp, max_tokens=16, drafter=drafter, policy=FixedK(3))
        list(gen)
        assert gen.stats.prompt_reused == len(context) - 1
        context = more + gen.token_ids
        assert head.kv_held(context) == len(context) - 1
        eng.reset()
        eng.set_kv_layers(())
        fresh = eng.hidden_states(context[:-1], kv_layers=(16, 17))
    finally:
        eng.close()
    n, e, w = head.n, spec.n_embd, 256
    parts = [(head._h[:n], fresh[:, :e])] + [
        (a[:n].reshape(n, w), fresh[:, e + j * w:e + (j + 1) * w])
        for j, a in enumerate((head._k[0], head._v[0], head._k[1], head._v[1]))]

    def cos(x, y):
        return (x * y).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)

    for got, want in parts:
        # llama.cpp's numbers move a little with the batch a row is decoded in (a few per
        # thousand of cosine here); a row of another position (a rolled-back draft's, or one
        # off) is far further from the fresh one than its own
        assert got.shape == want.shape
        same = cos(got, want)
        assert same.min() > 0.99, same.min()
        assert (same[1:] > cos(got[1:], want[:-1])).all() and (same[:-1] > cos(got[:-1], want[1:])).all()


@pytest.mark.integration
def test_shared_kv_head_runs_from_the_command_line_and_refuses_clearly(tmp_path, monkeypatch):
    """`edgespec generate --draft FOLDER` (or the head's GGUF) opens the engine with the probe a
    shared-KV head needs; the batched server and the EAGLE-3 export refuse it in one line."""
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    from edgespec.runtime.generate import generate
    from edgespec.runtime.server import open_slots
    from edgespec.runtime.spec import SpecConfig

    spec = load_target_spec("gemma3-270m")
    ckpt = _gemma_kv_checkpoint(tmp_path / "skv", spec)
    r = generate("gemma3-270m", "The capital of France is", max_tokens=12, n_ctx=256,
                 spec=SpecConfig(draft=f"head:{ckpt}", lm_head="full", k=2, policy="fixed"), compare=True)
    assert r.stats.drafted > 0 and r.compare.same_output
    with pytest.raises(EdgespecError, match="--parallel 1"):
        open_slots("gemma3-270m", SpecConfig(draft=str(ckpt)), 2, 256, None)
    from edgespec.exporters.eagle3_gguf import write_eagle3_gguf
    from edgespec.exporters.gguf_head import write_head_gguf

    with pytest.raises(EdgespecError, match="not an EAGLE-3 head"):
        write_eagle3_gguf(ckpt, tmp_path / "e.gguf")
    assert not (tmp_path / "e.gguf").exists()
    write_head_gguf(ckpt, tmp_path / "h.gguf", quant="f16")  # the head GGUF drafts the same way
    g = generate("gemma3-270m", "The capital of France is", max_tokens=12, n_ctx=256,
                 spec=SpecConfig(draft=f"head:{tmp_path / 'h.gguf'}", lm_head="full", k=2, policy="fixed"))
    assert g.stats.drafted > 0 and g.token_ids == r.token_ids


@pytest.mark.integration
def test_the_default_drafter_on_gemma_is_the_shipped_shared_kv_head_where_it_can_be_fed(tmp_path, monkeypatch):
    """The drop-in's default drafter on Gemma 3 270M is the shipped shared-KV head (its own
    policy source) mixed with lookup, drafting from the rows the verify passes hand it; the
    batched server's slots, which cannot hand keys over, and llama.cpp's own full LM head, where
    greedy text can be bit-exact, get the shipped hidden-state head."""
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    from edgespec.runtime.api import SpeculativeLlama
    from edgespec.runtime.drafters import MixedDrafter, SharedKVDrafter
    from edgespec.runtime.server import open_slots
    from edgespec.runtime.spec import SpecConfig

    llm = SpeculativeLlama("gemma3-270m", n_ctx=512, k=3, policy="fixed")
    assert isinstance(llm.drafter, MixedDrafter) and isinstance(llm.drafter.head, SharedKVDrafter)
    head = llm.drafter.head
    assert head.source == "head-kv"
    prompt = "def area(width, height):\n    \"\"\"Return the area of a rectangle.\"\"\"\n"
    out = llm.create_completion(prompt, max_tokens=32, temperature=0)
    assert out["choices"][0]["text"] and llm.last_stats["by_source"].get("head-kv", [0, 0])[1] > 0
    slots, _ = open_slots("gemma3-270m", SpecConfig(draft="default"), 2, 256, None)
    assert all(type(s.drafter.head).__name__ == "HeadDrafter" for s in slots)
    # on llama.cpp's own full LM head, where greedy text can be bit-exact, it keeps the other head
    full = SpeculativeLlama("gemma3-270m", n_ctx=256, lm_head="full")
    assert type(full.drafter.head).__name__ == "HeadDrafter" and full.drafter.head.source == "head"


def test_shared_kv_head_exports_to_gguf_and_onnx_and_checks_against_the_trained_head(tiny_kv):
    """`export gguf` and `export onnx` of a shared-KV checkpoint: the GGUF under its own
    architecture name, both read back by the runtime as shared-KV heads (and named so by
    `reads_kv`), their steps checked against the torch head on held-out features with keys and
    values; q4_0 keeps pre_proj and the LM head at q8_0."""
    from edgespec.exporters.check import check_head_export
    from edgespec.exporters.gguf_head import write_head_gguf
    from edgespec.runtime.drafters import reads_kv
    from edgespec.runtime.formats import GGUF_SHARED_KV_ARCH, gguf_architecture, read_head_gguf
    from edgespec.exporters.onnx_head import write_head_onnx
    from edgespec.runtime.heads import OnnxSharedKVHead, SharedKVNumpyHead, load_head
    from edgespec.training.train import train

    path, spec, feats, tmp = tiny_kv
    train(str(path), feats, tmp / "skv", small_cfg(arch="shared-kv", steps=20, save_every=20),
          head_overrides={"n_ff": 32, "d_model": 32}, log=lambda m: None)
    for quant, tol in (("f16", 0.05), ("q8_0", 0.2), ("onnx-fp32", 1e-3), ("onnx-int8", 0.3)):
        if quant.startswith("onnx"):
            out = tmp / f"skv-{quant}.onnx"
            r = write_head_onnx(tmp / "skv", out, quant=quant.split("-")[1])
            kind = OnnxSharedKVHead
        else:
            out = tmp / f"skv-{quant}.gguf"
            r = write_head_gguf(tmp / "skv", out, quant=quant)
            assert gguf_architecture(out) == GGUF_SHARED_KV_ARCH
            kind = SharedKVNumpyHead
        assert r["bytes"] == out.stat().st_size > 0 and reads_kv(str(out))
        nh, info = load_head(out)
        assert isinstance(nh, kind) and info.config.kv_layers == [4, 5]
        chk = check_head_export(tmp / "skv", out, feats, max_samples=4, every=4)
        assert chk["compared"] > 0 and chk["max_logit_error"] < tol, chk
        assert chk["top1_agreement"] >= 0.9, chk
    from edgespec.gguf_meta import read_header

    write_head_gguf(tmp / "skv", tmp / "q4.gguf", quant="q4_0")
    kinds = {n: t.type_name for n, t in read_header(tmp / "q4.gguf").tensors.items()}
    assert read_head_gguf(tmp / "q4.gguf").config.arch == "shared-kv"
    assert kinds["pre_proj.weight"] == "Q8_0" and kinds["blocks.0.up.weight"] == "Q4_0"
    assert kinds["lm_head"] != "Q4_0"  # (rows of 16 here: too short for blocks of 32, F32)
    plain = write_features(tmp / "plain-check", spec)
    with pytest.raises(EdgespecError, match="extract with --kv"):
        check_head_export(tmp / "skv", tmp / "skv-f16.gguf", plain)


def test_shared_kv_drafter_refuses_another_targets_head_and_ties_rows_to_tokens(tiny_kv):
    """A head trained for one target is refused on a target with the same vocabulary but another
    shape (one line, no traceback at the first draft); the rows it holds count for a new call
    only as far as their tokens are the cache's (another generation may have rewritten it)."""
    from edgespec.runtime.drafters import SharedKVDrafter
    from edgespec.training.train import train

    path, spec, feats, tmp = tiny_kv
    train(str(path), feats, tmp / "skv", small_cfg(arch="shared-kv", steps=4, warmup=2, save_every=4),
          head_overrides={"n_ff": 32, "d_model": 24}, log=lambda m: None)
    wide = load_target_spec(write_tiny_gguf(tmp / "wide.gguf", n_layer=6, vocab=VOCAB, n_embd=32))
    assert wide.tokenizer_fingerprint == spec.tokenizer_fingerprint
    with pytest.raises(EdgespecError, match="a head for another target"):
        SharedKVDrafter(tmp / "skv", wide)
    d = SharedKVDrafter(tmp / "skv", spec)
    rows = np.random.default_rng(0).normal(size=(6, spec.n_embd + 2 * 2 * 8)).astype(np.float32)
    d.keep(rows)
    d.note([5, 6, 7, 8, 9, 10])
    assert d.kv_held([5, 6, 7, 8, 9, 10, 11]) == 6
    assert d.kv_held([5, 6, 7, 1, 9, 10]) == 3  # position 3 holds another token now
    d.resume(3)
    assert d.kv_held([5, 6, 7, 8]) == 3 and d.n == 3
    with pytest.raises(RuntimeError, match="reads no keys"):
        d.keep(rows[:, :spec.n_embd])


def test_train_cli_sets_the_shared_kv_heads_width(tiny_kv):
    from test_cli import assert_usage_error, edgespec

    path, spec, feats, tmp = tiny_kv
    args = ["train", "--target", str(path), "--features", str(feats), "--steps", "4", "--batch", "2",
            "--seq-len", "16", "--draft-vocab", "32", "--save-every", "4"]
    r = edgespec(*args, "--out", str(tmp / "w"), "--arch", "shared-kv", "--d-model", "24")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp / "w" / "config.json").read_text())["head"]["d_model"] == 24
    assert_usage_error(edgespec(*args, "--out", str(tmp / "m"), "--d-model", "24"), "shared-kv head option")


def test_shared_kv_head_exports_to_llama_cpps_gemma4_assistant_layout(tiny_kv):
    """`export llama-cpp` of a shared-KV head: llama.cpp's gemma4-assistant GGUF. Its tensors, run
    as that graph computes (plain RMS norms, attention scale 1, logits from token_embd over the
    full vocabulary, the next h from post_projection), give the trained head's step: the same
    logits at the draft ids (0 elsewhere) and the same next input. Heads the layout cannot hold
    are refused in one line, nothing written."""
    from edgespec.exporters.gemma4_assistant import (assistant_step, read_assistant_gguf,
                                                     write_assistant_gguf)
    from edgespec.gguf_meta import read_header
    from edgespec.runtime.heads import load_head
    from edgespec.training.train import train

    path, spec, feats, tmp = tiny_kv
    over = {"n_ff": 32, "d_model": 24}
    train(str(path), feats, tmp / "skv", small_cfg(arch="shared-kv", steps=8, warmup=2, save_every=8),
          head_overrides=over, log=lambda m: None)
    r = write_assistant_gguf(tmp / "skv", tmp / "a.gguf", quant="f16")
    md = read_header(tmp / "a.gguf").metadata
    assert md["general.architecture"] == "gemma4-assistant" and r["kv_layers"] == [4, 5]
    assert md["gemma4-assistant.embedding_length"] == 24 and md["gemma4-assistant.embedding_length_out"] == 16
    assert md["gemma4-assistant.nextn_predict_layers"] == md["gemma4-assistant.block_count"] == 2
    assert list(md["gemma4-assistant.attention.sliding_window_pattern"]) == [True, False]
    assert "tokenizer.ggml.tokens" in md
    t, meta = read_assistant_gguf(tmp / "a.gguf")
    assert t["token_embd.weight"].shape == (spec.n_vocab, 24)
    nh, info = load_head(tmp / "skv")
    ids = info.draft_ids
    rng = np.random.default_rng(0)
    for qpos in (3, 12):  # before and after the sliding window (8) fills
        keys = [rng.normal(size=(qpos, 1, 8)).astype(np.float32) for _ in range(2)]
        values = [rng.normal(size=(qpos, 1, 8)).astype(np.float32) for _ in range(2)]
        emb, h = rng.normal(size=(1, 16)).astype(np.float32), rng.normal(size=(1, 16)).astype(np.float32)
        want_h, want = nh.step(emb, h, qpos, keys, values)
        from edgespec.runtime.heads import attended

        ks, vs = attended(nh.c, qpos, keys, values)
        got, got_h = assistant_step(t, meta, emb, h, qpos, ks, vs)
        tol = 2e-2 * np.abs(want).max()  # f16 weights
        assert np.abs(got[0, ids] - want[0]).max() <= tol
        assert np.abs(got_h - want_h).max() <= 2e-2 * np.abs(want_h).max()
        others = np.setdiff1d(np.arange(spec.n_vocab), ids)
        assert np.all(got[0, others] == 0)
    for name, kw, msg in (("norms", {"input_norms": True}, "input-norms"), ("wide", {"d_model": 16}, "--d-model")):
        train(str(path), feats, tmp / name, small_cfg(arch="shared-kv", steps=2, warmup=1, save_every=2),
              head_overrides={"n_ff": 32, "d_model": 24, **kw}, log=lambda m: None)
        with pytest.raises(EdgespecError, match=msg):
            write_assistant_gguf(tmp / name, tmp / f"{name}.gguf")
        assert not (tmp / f"{name}.gguf").exists()


def test_export_llama_cpp_of_a_shared_kv_head_from_the_command_line(tiny_kv):
    from test_cli import edgespec

    from edgespec.training.train import train

    path, spec, feats, tmp = tiny_kv
    train(str(path), feats, tmp / "skv", small_cfg(arch="shared-kv", steps=8, warmup=2, save_every=8),
          head_overrides={"n_ff": 32, "d_model": 24}, log=lambda m: None)
    r = edgespec("export", "llama-cpp", str(tmp / "skv"), "--out", str(tmp / "a.gguf"), "--quant", "f16",
                 "--check", "--features", str(feats), "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["arch"] == "gemma4-assistant" and rep["check"]["compared"] > 0
    assert rep["check"]["top1_agreement"] >= 0.95 and rep["check"]["max_logit_error"] < 0.1, rep["check"]


@pytest.mark.integration
def test_gemma4_assistant_export_runs_in_llama_cpps_own_mtp_drafter(tmp_path, monkeypatch):
    """The `export llama-cpp` file of a shared-KV head loads in llama-server-nextn (the pinned
    llama.cpp, its gemma3 graph patched to hand out the hidden state) and drafts there with
    `--spec-type draft-mtp`; llama.cpp's acceptance equals edgespec's replay of its loop on the
    same text (a random head here: the mechanics, not the skill; the trained head's figures are
    in results/assistant-check-*)."""
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    from edgespec.exporters.gemma4_assistant import write_assistant_gguf
    from edgespec.measure.assistant_check import assistant_in_llama_server

    spec = load_target_spec("gemma3-270m")
    ckpt = _gemma_kv_checkpoint(tmp_path / "skv", spec, input_norms=False)
    write_assistant_gguf(ckpt, tmp_path / "a.gguf", quant="q8_0")
    r = assistant_in_llama_server("gemma3-270m", tmp_path / "a.gguf",
                                  ["The capital of France is", "def add(a, b):\n"], n_predict=24, n_ctx=512)
    assert all(p["llama_drafted"] > 0 for p in r["per_prompt"])  # llama.cpp's MTP drafter ran it
    assert r["agrees"], r
