"""A tiny target whose numerics the tests control: an order-2 Markov chain over a small vocab.

It implements the runtime's Target protocol with a token list as its "KV cache", so decoding
logic (acceptance, rollback, stopping) can be checked exactly, without weights.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from edgespec.runtime.decoding import Draft, Drafter
from edgespec.runtime.engine import Engine


class MockTarget(Engine):
    engine, version = "mock", "0"
    n_threads = 1
    model_file = Path(__file__)

    def __init__(self, vocab: int = 12, seed: int = 0, n_ctx: int = 512, eog: int | None = None,
                 sharp: float = 3.0, n_embd: int = 8):
        self.spec = SimpleNamespace(name="mock", n_vocab=vocab, n_embd=n_embd, chat_template=None,
                                    tokenizer_fingerprint="mock", lm_head_type="F32")
        rng = np.random.default_rng(seed)
        self.table = rng.normal(size=(vocab, vocab, vocab)) * sharp  # [prev2, prev1] -> logits
        self.proj = rng.normal(size=(vocab, vocab, n_embd))
        self.vocab, self.n_ctx, self.eog = vocab, n_ctx, eog
        self.tokens: list[int] = []
        self.decode_calls = 0

    def logits_after(self, context: list[int]) -> np.ndarray:
        a = context[-2] if len(context) >= 2 else 0
        return self.table[a, context[-1]].copy()

    def prefill(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def hidden_states(self, tokens):
        return self.decode(tokens, hidden=True)[1]

    def decode(self, tokens, hidden=False, all_logits=True, copy=True, top_only=False):
        self.decode_calls += 1
        self.tokens.extend(tokens)
        n0 = len(self.tokens) - len(tokens)
        rows = range(len(tokens)) if (all_logits or hidden) else [len(tokens) - 1]
        logits = np.stack([self.logits_after(self.tokens[: n0 + i + 1]) for i in rows])
        hid = None
        if hidden:
            hid = np.stack([self.proj[self.tokens[n0 + i - 1] if n0 + i else 0, self.tokens[n0 + i]]
                            for i in range(len(tokens))])
        return logits, hid

    def truncate(self, n: int) -> None:
        del self.tokens[n:]

    def reset(self) -> None:
        self.tokens = []

    def is_eog(self, token: int) -> bool:
        return token == self.eog

    def token_bytes(self, token: int) -> bytes:
        return bytes([97 + token % 26])

    def tokenize(self, text: str, add_bos=None, special=True) -> list[int]:
        return [(ord(c) - 97) % self.vocab for c in text]

    def describe_lm_head(self, greedy: bool = True) -> str:
        return "F32"

    def close(self) -> None:
        pass


class NoisyOracle(Drafter):
    """A drafter that knows the target's greedy chain but errs with probability `err`."""

    needs_hidden = False

    def __init__(self, target: MockTarget, err: float = 0.3, seed: int = 1):
        self.t, self.err, self.rng = target, err, np.random.default_rng(seed)

    def reset(self):
        pass

    def propose(self, context, hidden, k, p_min=0.0, limit=None):
        if limit:
            k = min(k, limit(""))
        ctx, out = list(context), []
        for _ in range(k):
            tok = int(np.argmax(self.t.logits_after(ctx)))
            if self.rng.random() < self.err:
                tok = int(self.rng.integers(self.t.vocab))
            out.append(tok)
            ctx.append(tok)
        return Draft(out)


class SamplingDrafter(Drafter):
    """Draws drafts from a fixed, wrong distribution q and reports q (for lossless sampling)."""

    needs_hidden = False

    def __init__(self, vocab: int, seed: int = 2):
        self.rng = np.random.default_rng(seed)
        self.q = self.rng.dirichlet(np.ones(vocab))
        self.ids = np.arange(vocab)

    def reset(self):
        pass

    def propose(self, context, hidden, k, p_min=0.0, limit=None):
        if limit:
            k = min(k, limit(""))
        toks = [int(self.rng.choice(self.ids, p=self.q)) for _ in range(k)]
        return Draft(toks, [(self.ids, self.q)] * k)


def write_numpy_checkpoint(folder, config, fingerprint: str, draft_ids, target: str = "tiny",
                           seed: int = 0, scale: float = 0.3):
    """A head checkpoint folder written with numpy only (random weights in the layout `edgespec
    train` saves), for runtime tests that must not need torch."""
    import json

    from safetensors.numpy import save_file

    from edgespec.runtime.formats import CKPT_CONFIG, CKPT_WEIGHTS, DRAFT_IDS, head_weight_shapes

    rng = np.random.default_rng(seed)
    shapes = head_weight_shapes(config)
    w = {k: (rng.normal(size=s) * (scale if len(s) == 2 else 0.1)).astype(np.float32) for k, s in shapes.items()}
    w[DRAFT_IDS] = np.asarray(draft_ids, dtype=np.int64)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(w, str(folder / CKPT_WEIGHTS))
    meta = {"target": target, "target_fingerprint": fingerprint, "head": config.to_dict(),
            "draft_vocab": {"size": len(draft_ids), "coverage": 1.0}}
    (folder / CKPT_CONFIG).write_text(json.dumps(meta))
    return folder


def assert_joint_law(counts: dict, n: int, sp_kw: dict, grammar=None) -> None:
    """Chi-square check that `counts` of the first two tokens after [1, 2] (n runs on
    MockTarget(vocab=6, seed=11, sharp=1.0)) follow the target's sampling law; `grammar(last)`:
    the constraint after token `last`, if any."""
    from edgespec.runtime.sampling import SamplingParams, probs

    t = MockTarget(vocab=6, seed=11, sharp=1.0)
    sp = SamplingParams(**sp_kw)
    g = grammar or (lambda last: None)
    p1 = probs(t.logits_after([1, 2]), sp, [], g(2), [1, 2])
    expected = {(a, b): n * p1[a] * probs(t.logits_after([1, 2, a]), sp, [a], g(a), [1, 2, a])[b]
                for a in range(6) for b in range(6)}
    assert set(counts) <= {c for c, e in expected.items() if e > 0}
    cells = [(counts.get(c, 0), e) for c, e in expected.items() if e >= 5]
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    assert chi2 < dof + 4.5 * np.sqrt(2 * dof), (chi2, dof)


class MockMulti(MockTarget):
    """MockTarget holding several sequences in one "cache", decoded in combined batches the
    way runtime/batching.py drives LlamaTarget (decode_parts, seq_rollback, seq_clear); each
    batch is recorded as [(seq, rows), ...]."""

    n_batch = 512

    def __init__(self, n_seq: int = 4, **kw):
        super().__init__(**kw)
        self.n_seq = n_seq
        self.seqs: dict[int, list[int]] = {}
        self.batches: list[list[tuple[int, int]]] = []
        self.prefill_only = 0  # parts that only prefilled (a prompt decoded in a round of its own)

    def decode_parts(self, parts):
        out = []
        for p in parts:
            toks = self.seqs.setdefault(p.seq, [])
            assert len(toks) == p.start, (p.seq, len(toks), p.start)
            toks.extend(p.tokens)
            if p.outputs == "none":
                out.append((None, None, None))
                continue
            s0, n = p.start + p.lead, len(p.tokens) - p.lead  # rows past the prompt lead
            rows = range(n) if p.outputs == "all" else [n - 1]
            logits = np.stack([self.logits_after(toks[:s0 + i + 1]) for i in rows]) \
                if p.logits else None
            hid = np.stack([self.proj[toks[s0 + i - 1] if s0 + i else 0, toks[s0 + i]]
                            for i in range(n)]) if p.hidden else None
            out.append((logits, hid, None))
        self.batches.append([(p.seq, len(p.tokens)) for p in parts])
        self.prefill_only += sum(p.outputs == "none" for p in parts)
        return out

    def seq_rollback(self, seq: int, kept: list[int]) -> None:
        assert self.seqs.get(seq, [])[:len(kept)] == list(kept)
        self.seqs[seq] = list(kept)

    def seq_clear(self, seq: int) -> None:
        self.seqs[seq] = []


class MockExact(MockTarget):
    """A mock whose decodes keep one-token numbers up to `rows` tokens (what LlamaTarget's
    start-up check measures) and that prefills the way llama_cpp.Llama does."""

    def __init__(self, rows: int = 3, **kw):
        super().__init__(**kw)
        self.rows, self.batches, self.prefills = rows, [], []

    def invariant_batch(self) -> int:
        return self.rows

    def prefill(self, tokens, last_logits=False):
        self.prefills.append(list(tokens))
        self.tokens.extend(tokens)
        return self.logits_after(self.tokens) if last_logits and tokens else None

    def decode(self, tokens, **kw):
        self.batches.append(len(tokens))
        return super().decode(tokens, **kw)
