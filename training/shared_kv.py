"""The shared-KV MTP head (torch): queries into the target's own KV cache, no K/V of its own.

The shape of llama.cpp's Gemma 4 assistant drafts (`runtime/formats.SharedKVConfig`): each head
layer is query-only attention over the keys and values the target's cache holds for one target
layer (post-norm, post-RoPE keys, as `extract --kv` stores them and the cache holds them), then
the Gemma block's norms and GeGLU FFN. Every draft step of a chain that starts after target
position t sits at position t + 1 and attends the target's keys at positions <= t (a sliding
layer: within the target's window of its query), so the chain's steps differ only in their
input: pre_proj(concat(embedding of the newest token x embed_scale, h)), with h the target's
final hidden state at t for the first step and the head's own post_proj output after
(`input_norms`: both RMS-normed first, as the MTP head's inputs are).

Training (`forward_chain`) is exactly run time: with no K/V of its own, step j at every chain
start reads the same target keys as step 1 does, so the unrolled steps are n plain passes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgespec.runtime.formats import SharedKVConfig
from edgespec.training.head import RMSNorm, attend, rope


class SharedKVBlock(nn.Module):
    def __init__(self, c: SharedKVConfig, layer: int):
        super().__init__()
        self.c, self.sliding = c, c.layer_types[layer] == "sliding"
        self.base = c.rope_base_local if self.sliding else c.rope_base_global
        d, hd = c.d_model, c.head_dim
        self.input_norm = RMSNorm(d, c.rms_eps)
        self.q = nn.Linear(d, c.n_head * hd, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_eps)
        self.o = nn.Linear(c.n_head * hd, d, bias=False)
        self.post_attn_norm = RMSNorm(d, c.rms_eps)
        self.pre_ffn_norm = RMSNorm(d, c.rms_eps)
        self.gate = nn.Linear(d, c.n_ff, bias=False)
        self.up = nn.Linear(d, c.n_ff, bias=False)
        self.down = nn.Linear(c.n_ff, d, bias=False)
        self.post_ffn_norm = RMSNorm(d, c.rms_eps)

    def forward(self, x, qpos, k, v, mask=None):
        """x [B, T, d], qpos [B, T] (query positions); k/v [B, S, Hkv, D] the target's keys
        and values; mask [B, T, S] bool (which keys each query sees), None: every key (what the
        ONNX export runs each draft step) -> [B, T, d]."""
        b, t, _ = x.shape
        c = self.c
        q = self.q_norm(self.q(self.input_norm(x)).view(b, t, c.n_head, c.head_dim))
        attn = attend(rope(q, qpos, self.base), k, v, mask, c.scale)
        x = x + self.post_attn_norm(self.o(attn))
        h = self.pre_ffn_norm(x)
        h = self.down(F.gelu(self.gate(h), approximate="tanh") * self.up(h))
        return x + self.post_ffn_norm(h)


class SharedKVHead(nn.Module):
    def __init__(self, c: SharedKVConfig):
        super().__init__()
        self.c = c
        if c.input_norms:
            self.emb_norm = RMSNorm(c.n_embd, c.rms_eps)
            self.hid_norm = RMSNorm(c.n_embd, c.rms_eps)
        self.pre_proj = nn.Linear(2 * c.n_embd, c.d_model, bias=False)
        self.blocks = nn.ModuleList(SharedKVBlock(c, i) for i in range(c.n_layer))
        self.out_norm = RMSNorm(c.d_model, c.rms_eps)
        self.post_proj = nn.Linear(c.d_model, c.n_embd, bias=False)
        # Frozen, from the target: the draft LM head (embedding rows of the draft vocabulary),
        # applied to post_proj's output, which lives in the target's hidden space
        self.register_buffer("lm_head", torch.zeros(c.n_draft_vocab, c.n_embd), persistent=True)

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def step_input(self, tok_emb, hidden):
        """tok_emb: target embedding rows (unscaled) [B, T, E]; hidden [B, T, E] -> [B, T, d]."""
        e = tok_emb * self.c.embed_scale
        if self.c.input_norms:
            e, hidden = self.emb_norm(e), self.hid_norm(hidden)
        return self.pre_proj(torch.cat([e, hidden], -1))

    def logits(self, out):
        """Draft-vocabulary logits of a step's output (post_proj's, in the target's space)."""
        return out @ self.lm_head.T

    def teacher_logits(self, hidden):
        return hidden @ self.lm_head.T

    def split_kv(self, kv):
        """Stored K/V rows [B, S, 2 * kv_width * n_layer] (per kv layer: keys, then values) ->
        per head layer (k, v) [B, S, Hkv, D]."""
        c, w = self.c, self.c.kv_width
        b, s, _ = kv.shape
        out = []
        for i in range(c.n_layer):
            k = kv[..., 2 * i * w:(2 * i + 1) * w].reshape(b, s, c.n_head_kv, c.head_dim)
            v = kv[..., (2 * i + 1) * w:(2 * i + 2) * w].reshape(b, s, c.n_head_kv, c.head_dim)
            out.append((k, v))
        return out

    def masks(self, qpos, kv_valid):
        """Per head layer, which target keys each query sees: positions before the query's
        (the newest token is not in the cache yet), within the window on sliding layers."""
        kpos = torch.arange(kv_valid.shape[1], device=qpos.device)[None, None, :]
        seen = (kpos < qpos[:, :, None]) & kv_valid[:, None, :]
        local = seen & (kpos > qpos[:, :, None] - self.c.sliding_window)
        return [local if blk.sliding else seen for blk in self.blocks]

    def forward_steps(self, x, qpos, kv_pairs, masks):
        for blk, (k, v), m in zip(self.blocks, kv_pairs, masks):
            x = blk(x, qpos, k, v, m)
        return self.post_proj(self.out_norm(x))

    def forward_chain(self, tok_emb, hidden, n_steps: int, valid=None, kv=None, kv_valid=None,
                      offset=None):
        """Training-time test over windows of whole samples.

        tok_emb [B, T + n_steps - 1, E]: embeddings of x_{t+1}, x_{t+2}, ...; hidden [B, T, E]:
        the target's final hidden states h_t; kv [B, S, 2 * kv_width * n_layer]: the target's
        keys and values from each sample's position 0 (S >= offset + T), kv_valid [B, S];
        offset [B]: the sample position of window index 0. Returns per step the head's outputs
        [B, T, E] (step j at chain start t predicts token x_{t+j+1})."""
        b, t, _ = hidden.shape
        off = torch.zeros(b, dtype=torch.long) if offset is None else offset
        qpos = off[:, None] + 1 + torch.arange(t, device=hidden.device)[None]  # after h_t's position
        kv_pairs = self.split_kv(kv)
        masks = self.masks(qpos, kv_valid)
        if valid is not None:  # padded chain starts see one key, so no row is empty (unused)
            masks = [m | (~valid[:, :, None] & (torch.arange(m.shape[-1])[None, None] == 0))
                     for m in masks]
        outs, h = [], hidden
        for j in range(n_steps):
            h = self.forward_steps(self.step_input(tok_emb[:, j:j + t], h), qpos, kv_pairs, masks)
            outs.append(h)
        return outs
