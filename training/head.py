"""The MTP draft head (torch): Gemma-style blocks over [target token embedding, hidden state].

At draft step j the head reads the pair (embedding of the newest token, a hidden state): the
target's final hidden state at step 1, its own output after that. Each pair sits at one sequence
position and attends over the head's own KV cache of earlier positions (sliding layers see only
the last `sliding_window` positions). Its output goes through a final norm and the frozen draft
LM head: the target's embedding rows for the draft vocabulary (tied, as in Gemma).

Training (`forward_chain`) mirrors run time exactly, EAGLE-style "training-time test": step 1 runs
over all real pairs with causal attention; step j > 1 feeds every position its own step j-1
output and attends to the real K/V up to its chain's start plus the chain's own earlier steps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from edgespec.runtime.formats import HeadConfig


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), computed in float32; with offset=0 llama's
    x / rms(x) * w (w starts at 1 then)."""

    def __init__(self, dim: int, eps: float, offset: float = 1.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (self.offset + self.weight.float())).type_as(x)


def rope_tables(pos, d: int, base: float):
    """cos, sin [..., T, 1, d] of rotate-half RoPE for positions pos [..., T]."""
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device=pos.device) / d))
    ang = pos.float()[..., None] * inv  # [..., T, D/2]
    ang = torch.cat([ang, ang], -1)[..., None, :]
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def rope(x, pos, base: float):
    """Rotate-half RoPE (as Gemma/llama in HF layout). x: [..., T, H, D], pos: [..., T]."""
    return apply_rope(x, *rope_tables(pos, x.shape[-1], base))


def attend(q, k, v, mask, scale: float):
    """q [B, Tq, H, D], k/v [B, Tk, Hkv, D], mask [B or 1, Tq, Tk] bool, None: every key ->
    [B, Tq, H*D]. Grouped-query attention as two matmuls per KV head: the query heads that share
    a KV head (query head h reads KV head h // rep) and the Tq queries stack into one
    [Tq * rep, D] block against that head's keys [D, Tk], so no key or value is copied per
    query head (what an ONNX export of a head runs each draft step)."""
    b, tq, nh, d = q.shape
    g = k.shape[2]
    rep = nh // g
    qg = q.reshape(b, tq, g, rep, d).permute(0, 2, 1, 3, 4).reshape(b, g, tq * rep, d)
    s = (qg @ k.permute(0, 2, 3, 1)) * scale  # [B, G, Tq * rep, Tk]
    if mask is not None:
        s = s.view(b, g, tq, rep, -1).masked_fill(~mask[:, None, :, None, :], float("-inf"))
        s = s.view(b, g, tq * rep, -1)
    p = torch.softmax(s.float(), -1).type_as(q)
    out = (p @ v.permute(0, 2, 1, 3)).view(b, g, tq, rep, d)  # [B, G, Tq, rep, D]
    return out.permute(0, 2, 1, 3, 4).reshape(b, tq, nh * d)


def attend_chain(q, rk, rv, mask, chain, scale: float):
    """Training-time test attention: step-j queries q [B, T, H, D] over the real keys rk/rv
    [B, Tk, Hkv, D] (mask [B, T, Tk]) and over their own chain's earlier steps (and this one):
    `chain` is a list of (k, v) [B, T, Hkv, D], one per step so far. -> [B, T, H*D]."""
    b, t, nh, d = q.shape
    rep = nh // rk.shape[2]
    rk, rv = rk.repeat_interleave(rep, 2), rv.repeat_interleave(rep, 2)
    s_real = torch.einsum("bqhd,bkhd->bhqk", q, rk) * scale
    s_real = s_real.masked_fill(~mask[:, None], float("-inf"))
    ck = torch.stack([k.repeat_interleave(rep, 2) for k, _ in chain], -2)  # [B, T, H, J, D]
    cv = torch.stack([v.repeat_interleave(rep, 2) for _, v in chain], -2)
    s_diag = torch.einsum("bqhd,bqhjd->bhqj", q, ck) * scale
    p = torch.softmax(torch.cat([s_real, s_diag], -1).float(), -1).type_as(q)
    n_real = s_real.shape[-1]
    o = torch.einsum("bhqk,bkhd->bqhd", p[..., :n_real], rv)
    o = o + torch.einsum("bhqj,bqhjd->bqhd", p[..., n_real:], cv)
    return o.reshape(b, t, nh * d)


class Block(nn.Module):
    def __init__(self, c: HeadConfig, layer_type: str):
        super().__init__()
        self.c, self.sliding = c, layer_type == "sliding"
        self.base = c.rope_base_local if self.sliding else c.rope_base_global
        e, hd = c.n_embd, c.head_dim
        self.input_norm = RMSNorm(e, c.rms_eps)
        self.q = nn.Linear(e, c.n_head * hd, bias=False)
        self.k = nn.Linear(e, c.n_head_kv * hd, bias=False)
        self.v = nn.Linear(e, c.n_head_kv * hd, bias=False)
        self.o = nn.Linear(c.n_head * hd, e, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_eps)
        self.k_norm = RMSNorm(hd, c.rms_eps)
        self.post_attn_norm = RMSNorm(e, c.rms_eps)
        self.pre_ffn_norm = RMSNorm(e, c.rms_eps)
        self.gate = nn.Linear(e, c.n_ff, bias=False)
        self.up = nn.Linear(e, c.n_ff, bias=False)
        self.down = nn.Linear(c.n_ff, e, bias=False)
        self.post_ffn_norm = RMSNorm(e, c.rms_eps)
        self.scale = c.attn_scale or 1.0 / math.sqrt(hd)

    def qkv(self, x, pos):
        """x: [B, T, E], pos: [B, T] -> q [B, T, H, D], k/v [B, T, Hkv, D] (normed, rotated)."""
        b, t, _ = x.shape
        c = self.c
        h = self.input_norm(x)
        q = self.q_norm(self.q(h).view(b, t, c.n_head, c.head_dim))
        k = self.k_norm(self.k(h).view(b, t, c.n_head_kv, c.head_dim))
        v = self.v(h).view(b, t, c.n_head_kv, c.head_dim)
        return rope(q, pos, self.base), rope(k, pos, self.base), v

    def finish(self, x, attn):
        """Residual around attention output [B, T, H*D], then the GeGLU FFN."""
        x = x + self.post_attn_norm(self.o(attn))
        h = self.pre_ffn_norm(x)
        h = self.down(F.gelu(self.gate(h), approximate="tanh") * self.up(h))
        return x + self.post_ffn_norm(h)

    def attend(self, q, k, v, mask):
        return attend(q, k, v, mask, self.scale)


class MTPHead(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.c = c
        e = c.n_embd
        self.emb_norm = RMSNorm(e, c.rms_eps)
        self.hid_norm = RMSNorm(e, c.rms_eps)
        self.fc = nn.Linear(2 * e, e, bias=False)
        self.blocks = nn.ModuleList(Block(c, t) for t in c.layer_types)
        self.out_norm = RMSNorm(e, c.rms_eps)
        # Frozen, from the target: the draft LM head (embedding rows of the draft vocabulary).
        self.register_buffer("lm_head", torch.zeros(c.n_draft_vocab, e), persistent=True)

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def inputs(self, tok_emb, hidden):
        """tok_emb: target embedding rows (unscaled) [B, T, E]; hidden [B, T, E] -> [B, T, E]."""
        a = self.emb_norm(tok_emb * self.c.embed_scale)
        return self.fc(torch.cat([a, self.hid_norm(hidden)], -1))

    def logits(self, out):
        return out @ self.lm_head.T

    def teacher_logits(self, hidden):
        """The target's logits over the draft vocabulary from its stored hidden states."""
        return hidden @ self.lm_head.T

    def _window_mask(self, block: Block, qpos, kpos):
        m = kpos[:, None, :] <= qpos[:, :, None]
        if block.sliding:
            m &= kpos[:, None, :] > qpos[:, :, None] - self.c.sliding_window
        return m

    def forward_chain(self, tok_emb, hidden, n_steps: int, valid=None):
        """Training-time test over whole sequences.

        tok_emb [B, T + n_steps - 1, E]: embeddings of x_{t+1}, x_{t+2}, ... (the token each
        step reads); hidden [B, T, E]: target hidden states h_t. Returns per step the head's
        output states [B, T, E] (step j at chain start t predicts token x_{t+j+1}).
        """
        b, t, _ = hidden.shape
        pos = torch.arange(t, device=hidden.device).expand(b, t)
        x = self.inputs(tok_emb[:, :t], hidden)
        real_kv, outs = [], []
        for blk in self.blocks:  # step 1: plain causal pass over the real pairs
            q, k, v = blk.qkv(x, pos)
            real_kv.append((k, v))
            mask = self._window_mask(blk, pos, pos)
            if valid is not None:  # padding keys are hidden; self stays visible (no empty row)
                mask = (mask & valid[:, None, :]) | torch.eye(t, dtype=torch.bool)
            x = blk.finish(x, blk.attend(q, k, v, mask))
        out = self.out_norm(x)
        outs.append(out)
        chain_kv = [[] for _ in self.blocks]  # per layer, per earlier step: (k, v) [B, T, Hkv, D]
        for j in range(1, n_steps):
            x = self.inputs(tok_emb[:, j:j + t], out)
            qpos = pos + j
            for li, blk in enumerate(self.blocks):
                q, k, v = blk.qkv(x, qpos)
                chain_kv[li].append((k, v))
                rk, rv = real_kv[li]
                # real keys: positions <= chain start t (and inside the window for sliding)
                mask = self._window_mask(blk, qpos, pos) & (pos[:, None, :] <= pos[:, :, None])
                if valid is not None:
                    mask = mask & valid[:, None, :]
                attn = attend_chain(q, rk, rv, mask, chain_kv[li], blk.scale)
                x = blk.finish(x, attn)
            out = self.out_norm(x)
            outs.append(out)
        return outs

    def step(self, tok_emb, hidden, cache: list, pos: int):
        """Run time: one new pair at position `pos` against `cache` (list of (k, v) per layer,
        [1, S, Hkv, D] with positions pos - S .. pos - 1). Returns (out [1, 1, E], new cache)."""
        x = self.inputs(tok_emb.view(1, 1, -1), hidden.view(1, 1, -1))
        p = torch.tensor([[pos]])
        new = []
        for blk, (ck, cv) in zip(self.blocks, cache):
            q, k, v = blk.qkv(x, p)
            k, v = torch.cat([ck, k], 1), torch.cat([cv, v], 1)
            kpos = torch.arange(pos - k.shape[1] + 1, pos + 1)[None]
            mask = self._window_mask(blk, p, kpos)
            x = blk.finish(x, blk.attend(q, k, v, mask))
            new.append((k, v))
        return self.out_norm(x), new
