"""The MTP head on tiny random configs: training-time test equals step-by-step run time."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgespec.runtime.formats import HeadConfig  # noqa: E402
from edgespec.training.head import MTPHead  # noqa: E402
from edgespec.training.train import build_draft_vocab  # noqa: E402


def tiny_head(layer_types=("sliding", "global"), window=4, seed=0):
    torch.manual_seed(seed)
    c = HeadConfig(n_embd=16, n_draft_vocab=11, n_head=2, n_head_kv=1, head_dim=8, n_ff=24,
                   layer_types=list(layer_types), sliding_window=window, embed_scale=4.0)
    head = MTPHead(c)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # norms start at zero; make them matter
        head.lm_head.normal_()
    return head.eval()


def run_time_chain(head, emb, hid, t, n_steps):
    """What the runtime does: real pairs 0..t into the cache, then draft steps on own outputs."""
    c = head.c
    cache = [(torch.zeros(1, 0, c.n_head_kv, c.head_dim),) * 2 for _ in head.blocks]
    for s in range(t + 1):
        out, cache = head.step(emb[s + 1], hid[s], cache, s)
    outs = [out]
    for j in range(1, n_steps):
        out, cache = head.step(emb[t + 1 + j], out.view(-1), cache, t + j)
        outs.append(out)
    return [o.view(-1) for o in outs]


@pytest.mark.parametrize("layer_types,window", [(("sliding", "global"), 4), (("global",), 64),
                                                (("sliding", "sliding", "global"), 3)])
def test_training_chain_matches_run_time_steps(layer_types, window):
    head = tiny_head(layer_types, window)
    T, n = 9, 4
    emb = torch.randn(T + n, 16)
    hid = torch.randn(T, 16)
    with torch.no_grad():
        outs = head.forward_chain(emb[None, 1:], hid[None], n)
        for t in [0, 3, T - 1]:
            ref = run_time_chain(head, emb, hid, t, n)
            for j in range(n):
                torch.testing.assert_close(outs[j][0, t], ref[j], atol=1e-5, rtol=1e-4)


def test_padding_mask_keeps_real_rows_unchanged():
    head = tiny_head()
    emb, hid = torch.randn(1, 12, 16), torch.randn(1, 8, 16)
    with torch.no_grad():
        a = head.forward_chain(emb[:, 1:], hid, 3)
        pad_hid = torch.cat([hid, torch.randn(1, 4, 16)], 1)
        pad_emb = torch.cat([emb, torch.randn(1, 4, 16)], 1)
        valid = torch.tensor([[True] * 8 + [False] * 4])
        b = head.forward_chain(pad_emb[:, 1:], pad_hid, 3, valid=valid)
    for x, y in zip(a, b):
        torch.testing.assert_close(x[0], y[0, :8], atol=1e-5, rtol=1e-4)


def test_draft_vocab_most_frequent_and_forced():
    toks = [np.array([5, 5, 5, 7, 7, 9, 1]), np.array([5, 7, 3])]
    v = build_draft_vocab(toks, 3, 20, always=[2])
    assert list(v["ids"]) == [2, 5, 7]
    assert list(v["ids"]) == list(np.arange(3) + v["d2t"])
    assert v["coverage"] == pytest.approx(7 / 10)


@pytest.mark.parametrize("layer_types,window", [(("sliding", "global"), 4), (("global",), 64)])
def test_numpy_runtime_head_matches_torch(layer_types, window):
    """The runtime's numpy head (no torch) reproduces the torch head's chain outputs."""
    from edgespec.runtime.heads import NumpyHead

    head = tiny_head(layer_types, window)
    weights = {k: v.detach().numpy() for k, v in head.state_dict().items()}
    nh = NumpyHead(head.c, weights)
    T, n = 9, 3
    emb, hid = torch.randn(T + n, 16), torch.randn(T, 16)
    with torch.no_grad():
        outs = head.forward_chain(emb[None, 1:], hid[None], n)
    t = T - 1
    # real pairs in two batches (as after prefill, then after a verify pass), then a draft chain
    nh.forward(emb[1:5].numpy(), hid[:4].numpy(), 0, commit=True)
    out, cache = nh.forward(emb[5:t + 2].numpy(), hid[4:t + 1].numpy(), 4, commit=True)
    np.testing.assert_allclose(out, outs[0][0, 4:].numpy(), atol=1e-4, rtol=1e-3)
    cache = (nh.k, nh.v)
    last = out[-1:]
    for j in range(1, n):
        last, cache = nh.forward(emb[t + 1 + j][None].numpy(), last, t + j, commit=False, cache=cache)
        np.testing.assert_allclose(last[0], outs[j][0, t].numpy(), atol=1e-4, rtol=1e-3)
    assert nh.n == T
