"""The target on onnxruntime: the ONNX target export (`edgespec export onnx-target`).

Same interface as LlamaTarget (prefill / decode / truncate / reset, tokenize ...), so the decode
loop, the drafters and the bench run on either engine. The KV cache is kept as numpy arrays
[1, kv_heads, n, head_dim] per layer between calls; rolling back is slicing them, which is exact.
Sliding-window layers keep only `kept_positions(window)` positions (the graph derives positions
from the cache length, so trimming from the front is safe); a rollback deeper than that margin
re-decodes the kept tokens. Token embedding rows are read from the target's GGUF file (the
tokenizer comes from there too), scaled as the target scales them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgespec.errors import EdgespecError
from edgespec.gguf_meta import TensorRows, read_header
from edgespec.runtime.engine import Engine
from edgespec.runtime.formats import cache_names, kept_positions, read_target_meta
from edgespec.runtime.llama_target import LlamaVocab, default_threads, lc, load_vocab_only
from edgespec.runtime.lowrank import LowRankInfo, TopRows
from edgespec.runtime.onnx_session import open_session
from edgespec.targets import embedding_rows, load_target_spec


class OrtTarget(LlamaVocab, Engine):
    engine = "onnxruntime"
    version = ort.__version__
    # Default for the most tokens drafted per step: checking more tokens costs little more here
    # than on llama.cpp, with the full LM head too (onnxruntime's int8 graph batches better).
    draft_k = 6
    draft_k_sampled = 6

    def __init__(self, folder: str | Path, n_ctx: int = 4096, n_threads: int | None = None,
                 n_batch: int = 512, spec=None):
        folder = Path(folder)
        self.meta = meta = read_target_meta(folder)
        if spec is None:
            name = meta["target"]
            spec = load_target_spec(meta.get("target_path", name) if Path(name).suffix else name)
        self.spec = spec
        if self.spec.tokenizer_fingerprint != meta["target_fingerprint"]:
            raise EdgespecError(f"{folder} was exported from another target than {self.spec.name}")
        self._model, self._vocab = load_vocab_only(self.spec)
        self.n_vocab, self.n_embd = meta["n_vocab"], meta["n_embd"]
        self.n_threads = n_threads or default_threads()
        self.n_ctx, self.n_batch = n_ctx, n_batch
        self.sess = open_session(folder / "model.onnx", self.n_threads)
        self.model_file = folder / "model.onnx.data" if (folder / "model.onnx.data").exists() \
            else folder / "model.onnx"
        self.embed = embedding_rows(self.spec)
        self.n_layer = meta["n_layer"]
        self.sliding = [t == "sliding" for t in meta["layer_types"]]
        self.window = meta.get("sliding_window") or 0
        self.past_names, present = cache_names(self.n_layer)
        self.out_names = ["logits", "hidden", *present]
        lm = meta.get("lm_head", {"kind": "full"})
        self.lowrank = LowRankInfo(lm["rank"], lm["candidates"], lm["rescore"]) \
            if lm.get("kind") == "lowrank" else None
        if self.lowrank:  # candidates from the low-rank scores, rescored exactly from the GGUF rows
            self.out_names.insert(2, "candidates")
            self.top = TopRows(TensorRows(read_header(self.spec.path), lm["rescore"]), self.n_vocab)
        self.n_redecodes = 0
        self.reset()

    def reset(self) -> None:
        z = np.zeros((1, self.meta["n_head_kv"], 0, self.meta["head_dim"]), np.float32)
        self.kv = [z] * (2 * self.n_layer)
        self.tokens: list[int] = []

    def _run(self, tokens: list[int], n_logits: int, n_cand: int = 0):
        start = len(self.tokens)
        if start + len(tokens) > self.n_ctx:
            raise EdgespecError(f"context is full ({self.n_ctx} tokens); use a larger n_ctx "
                                "or a shorter prompt")
        emb = self.embed[np.asarray(tokens)] * np.float32(self.meta["embed_scale"])
        feed = {"inputs_embeds": np.ascontiguousarray(emb, dtype=np.float32),
                "position": np.array(start, dtype=np.int64),
                "n_logits": np.array(n_logits, dtype=np.int64)}
        if self.lowrank:
            feed["n_candidates"] = np.array(n_cand, dtype=np.int64)
        feed.update(zip(self.past_names, self.kv))
        res = self.sess.run(self.out_names, feed)
        cand = res.pop(2) if self.lowrank else None
        kv = res[2:]
        if self.window:
            keep = kept_positions(self.window)
            kv = [a[:, :, -keep:] if self.sliding[i // 2] and a.shape[2] > keep else a
                  for i, a in enumerate(kv)]
        self.kv = kv
        self.tokens.extend(tokens)
        if cand is not None and len(cand):
            return self.top(cand, res[1][len(tokens) - len(cand):]), res[1]
        return res[0], res[1]

    def prefill(self, tokens: list[int]) -> None:
        for s in range(0, len(tokens), self.n_batch):
            self._run(tokens[s:s + self.n_batch], 0)  # no logits: nothing reads them

    def hidden_states(self, tokens: list[int]) -> np.ndarray:
        """Decode tokens into the cache; their final hidden states [n, n_embd], no logits."""
        out = [self._run(tokens[s:s + self.n_batch], 0)[1] for s in range(0, len(tokens), self.n_batch)]
        return np.concatenate(out) if out else np.empty((0, self.n_embd), np.float32)

    def decode(self, tokens: list[int], hidden: bool = False, all_logits: bool = True,
               copy: bool = True, top_only: bool = False):
        """top_only: the caller reads only each row's argmax (greedy decoding); an export with
        the low-rank LM head then returns -inf rows with exact logits at its candidates instead
        of computing all 262k. The returned logits are valid until the next decode."""
        if not tokens:
            raise ValueError("decode needs at least one token")
        if len(tokens) > self.n_batch:
            raise ValueError(f"decode takes at most n_batch={self.n_batch} tokens")
        n = len(tokens)
        rows = n if (all_logits or hidden) else 1
        if self.lowrank and top_only:
            logits, hid = self._run(tokens, 0, rows)
        else:
            logits, hid = self._run(tokens, rows)
        return logits, (hid if hidden else None)

    def hidden_free(self, top_only: bool) -> bool:
        """The exported graph returns the final hidden states with every decode."""
        return True

    def describe_lm_head(self, greedy: bool = True) -> str:
        """The LM head verification uses (greedy passes may use the low-rank one), for reports."""
        quant = self.meta.get("quant", "?")
        if greedy and self.lowrank:
            return f"ONNX {quant}; {self.lowrank.describe('from ' + self.lowrank.rescore)}"
        return f"ONNX {quant}"

    def truncate(self, n: int) -> None:
        if n >= len(self.tokens):
            return
        kept = self.tokens[:n]
        drop = len(self.tokens) - n
        need = min(n, self.window)  # keys the next token sees on a sliding layer
        if any(self.sliding[i // 2] and a.shape[2] - drop < need for i, a in enumerate(self.kv)):
            # the trimmed sliding cache no longer covers the window: re-decode
            self.n_redecodes += 1
            self.reset()
            self.prefill(kept)
            return
        self.kv = [a[:, :, :a.shape[2] - drop] for a in self.kv]
        self.tokens = kept

    def close(self) -> None:
        if getattr(self, "_model", None):
            lc.llama_model_free(self._model)
            self._model = None
        self.sess = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
