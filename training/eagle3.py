"""The EAGLE-3 draft head (torch): exactly the graph stock llama.cpp runs for the `eagle3`
architecture (`edgespec export llama-cpp` writes it), so a head trained here drafts inside
`llama-server --spec-type draft-eagle3` without conversion.

Features: the inputs of three target layers (low, middle, high), concatenated [3E]. At a
position P the head reads the pair (embedding of token P+1, g[P]):

    g      = fc(rmsnorm(features))            (step 1; the norm is llama.cpp's norm_before_fc)
    x      = [rmsnorm(embedding) * a, rmsnorm(g) * b]                      (2E)
    h      = g + o(attention(q(x), k(x), v(x)))   RoPE at P, causal over the head's KV cache
    state  = h + down(silu(gate(n(h))) * up(n(h)))                   n: RMSNorm * ffn_norm
    logits = lm_head(rmsnorm(state) * output_norm)                   over the draft vocabulary

and the next draft step feeds `state` back as g (at position P + 1). Norms are llama-style
(x / rms * w, w starts at 1). RoPE is trained in rotate-half layout; the exporter permutes q/k
rows to llama.cpp's interleaved layout. Training is the same training-time test as the MTP head:
step 1 over all real pairs, step j attends to the real keys up to its chain start and its own
earlier steps. The LM head is the target's embedding rows of the draft vocabulary, frozen, and
the teacher distribution comes from the target's final hidden state, stored first in every
feature vector ([final, layer a, layer b, layer c], see `extract --layers`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from edgespec.runtime.formats import Eagle3Config
from edgespec.training.head import RMSNorm, attend, attend_chain, rope


def LlamaRMSNorm(dim: int, eps: float) -> RMSNorm:
    """x / rms(x) * w, in float32 (llama.cpp's LLM_NORM_RMS with a weight)."""
    return RMSNorm(dim, eps, offset=0.0)


def default_target_layers(n_layer: int) -> list[int]:
    """EAGLE-3's usual choice: a low, a middle and a high layer's input."""
    return [2, n_layer // 2, n_layer - 3]


class Eagle3Head(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.c = c
        e, hd = c.n_embd, c.head_dim
        self.enc_norm = LlamaRMSNorm(3 * e, c.rms_eps) if c.norm_before_fc else None
        self.fc = nn.Linear(3 * e, e, bias=False)
        self.attn_norm = LlamaRMSNorm(e, c.rms_eps)  # on the token embedding
        self.hidden_norm = LlamaRMSNorm(e, c.rms_eps)  # on g (llama.cpp: attn_norm_2)
        self.q = nn.Linear(2 * e, c.n_head * hd, bias=False)
        self.k = nn.Linear(2 * e, c.n_head_kv * hd, bias=False)
        self.v = nn.Linear(2 * e, c.n_head_kv * hd, bias=False)
        self.o = nn.Linear(c.n_head * hd, e, bias=False)
        self.ffn_norm = LlamaRMSNorm(e, c.rms_eps)
        self.gate = nn.Linear(e, c.n_ff, bias=False)
        self.up = nn.Linear(e, c.n_ff, bias=False)
        self.down = nn.Linear(c.n_ff, e, bias=False)
        self.out_norm = LlamaRMSNorm(e, c.rms_eps)
        self.scale = 1.0 / math.sqrt(hd)
        # Frozen, from the target: the draft LM head (its embedding rows of the draft vocabulary).
        self.register_buffer("lm_head", torch.zeros(c.n_draft_vocab, e), persistent=True)

    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    # -- the pieces -------------------------------------------------------------------------
    def fuse(self, hidden):
        """Stored feature vectors [..., 4E] (final hidden state first) -> g [..., E]."""
        f = hidden[..., self.c.n_embd:]
        return self.fc(self.enc_norm(f) if self.enc_norm is not None else f)

    def qkv(self, tok_emb, g, pos):
        b, t, _ = g.shape
        c = self.c
        x = torch.cat([self.attn_norm(tok_emb), self.hidden_norm(g)], -1)
        q = self.q(x).view(b, t, c.n_head, c.head_dim)
        k = self.k(x).view(b, t, c.n_head_kv, c.head_dim)
        v = self.v(x).view(b, t, c.n_head_kv, c.head_dim)
        return rope(q, pos, c.rope_base), rope(k, pos, c.rope_base), v

    def finish(self, g, attn):
        """Residual from g around attention [B, T, H*D], then the SwiGLU FFN: the pre-norm state."""
        h = g + self.o(attn)
        n = self.ffn_norm(h)
        return h + self.down(F.silu(self.gate(n)) * self.up(n))

    def logits(self, state):
        return self.out_norm(state) @ self.lm_head.T

    def teacher_logits(self, hidden):
        """The target's logits over the draft vocabulary from its stored final hidden states."""
        return hidden[..., :self.c.n_embd] @ self.lm_head.T

    # -- training and reference forward ---------------------------------------------------------
    def forward_chain(self, tok_emb, hidden, n_steps: int, valid=None):
        """Training-time test over whole sequences (the MTP head's contract).

        tok_emb [B, T + n_steps - 1, E]: the target's embedding rows of x_{t+1}, x_{t+2}, ...;
        hidden [B, T, 4E]: stored features at t. Returns per step the pre-norm states [B, T, E]
        (step j at chain start t predicts x_{t+j+1}; `logits` maps a state to the draft vocab).
        """
        b, t, _ = hidden.shape
        pos = torch.arange(t, device=hidden.device).expand(b, t)
        g = self.fuse(hidden)
        q, rk, rv = self.qkv(tok_emb[:, :t], g, pos)
        mask = pos[:, None, :] <= pos[:, :, None]
        if valid is not None:  # padding keys are hidden; self stays visible (no empty row)
            mask = (mask & valid[:, None, :]) | torch.eye(t, dtype=torch.bool, device=hidden.device)
        state = self.finish(g, attend(q, rk, rv, mask, self.scale))
        outs, chain = [state], []
        real_mask = pos[:, None, :] <= pos[:, :, None]
        if valid is not None:
            real_mask = real_mask & valid[:, None, :]
        for j in range(1, n_steps):
            g = state
            q, k, v = self.qkv(tok_emb[:, j:j + t], g, pos + j)
            chain.append((k, v))
            state = self.finish(g, attend_chain(q, rk, rv, real_mask, chain, self.scale))
            outs.append(state)
        return outs

    def step(self, tok_emb, g, cache, pos: int):
        """Run time, one position: tok_emb [E], g [E] (fused features or the last state),
        cache (k, v) [1, S, Hkv, D] of positions pos - S .. pos - 1 (or None).
        Returns (state [E], new cache)."""
        q, k, v = self.qkv(tok_emb.view(1, 1, -1), g.view(1, 1, -1), torch.tensor([[pos]]))
        if cache is not None:
            k, v = torch.cat([cache[0], k], 1), torch.cat([cache[1], v], 1)
        mask = torch.ones(1, 1, k.shape[1], dtype=torch.bool)
        state = self.finish(g.view(1, 1, -1), attend(q, k, v, mask, self.scale))
        return state.view(-1), (k, v)


def parse_layers(text: str | None, n_layer: int) -> tuple[int, ...]:
    """`--layers`: "A,B,C" (layer ids, 1 .. n_layer - 1) or "eagle3" (the usual three)."""
    from edgespec.errors import EdgespecError

    if not text:
        return ()
    if text == "eagle3":
        return tuple(default_target_layers(n_layer))
    try:
        ids = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise EdgespecError(f"--layers {text}: give layer ids like 2,15,27 or 'eagle3'") from None
    bad = [i for i in ids if not 1 <= i < n_layer]
    if bad or len(set(ids)) != len(ids):
        raise EdgespecError(f"--layers {text}: each id must be distinct, from 1 to {n_layer - 1}")
    return ids


@torch.no_grad()
def greedy_draft_walk(head: Eagle3Head, draft_ids, tokens, hidden, embed, start: int,
                      n_max: int = 3) -> dict:
    """What llama.cpp's `draft-eagle3` does on a greedy text, offline: from chain start `start`
    (the last prompt position) draft `n_max` tokens greedily, keep the prefix that equals the
    text, move on by that many + 1; tokens [T] (prompt + the target's greedy continuation),
    hidden [T, 4E] (stored features), embed: the target's embedding rows. Returns the drafted
    and accepted counts and their ratio (llama.cpp's "accept" figure)."""
    import numpy as np

    toks = np.asarray(tokens, dtype=np.int64)
    T = len(toks)
    n = T - 1  # chain starts 0 .. T-2 read the token after them
    emb = np.zeros((n + n_max - 1, head.c.n_embd), dtype=np.float32)
    emb[:n] = embed[toks[1:]]
    outs = head.forward_chain(torch.from_numpy(emb)[None], torch.as_tensor(hidden[:n])[None], n_max)
    ids = torch.as_tensor(np.asarray(draft_ids, dtype=np.int64))
    drafts = torch.stack([ids[head.logits(o[0]).argmax(-1)] for o in outs], 1).numpy()  # [n, n_max]
    t, drafted, accepted, steps = start, 0, 0, 0
    while t < n - 1:
        a = 0
        while a < n_max and t + a + 2 < T and drafts[t, a] == toks[t + a + 2]:
            a += 1
        drafted, accepted, steps = drafted + n_max, accepted + a, steps + 1
        t += a + 1
    return {"drafted": drafted, "accepted": accepted, "verify_steps": steps,
            "acceptance": round(accepted / max(drafted, 1), 4)}
