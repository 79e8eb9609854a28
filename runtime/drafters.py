"""Drafters for the decode loop: the trained MTP head (numpy) and training-free prompt lookup.

A drafter gets, at each step, the whole context (its last token is the pending one, not yet in
the target's cache) and the target's hidden states for positions that became final since the
last call, and proposes up to k tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.gguf_meta import TensorRows, read_header
from edgespec.runtime.decoding import Draft
from edgespec.runtime.onnx_session import cache_names, open_session


HEADS_DIR = Path(__file__).resolve().parent / "heads"


def head_fingerprint(path: Path) -> str | None:
    """The target fingerprint stored in a head file (GGUF or ONNX), None if it has none."""
    if path.suffix == ".gguf":
        return read_header(path).metadata.get("edgespec-mtp.target_fingerprint")
    if path.suffix == ".onnx":
        try:
            return OnnxHead(path).info["target_fingerprint"]
        except EdgespecError:
            return None
    return None


def default_head(spec) -> Path:
    """The head shipped for this target: a file under runtime/heads/*/ whose fingerprint
    matches; the ONNX export first (its int8 draft step is the fastest measured), else GGUF."""
    if HEADS_DIR.is_dir():
        for d in sorted(HEADS_DIR.iterdir()):
            for f in sorted(d.glob("*.onnx")) + sorted(d.glob("*.gguf")):
                if head_fingerprint(f) == spec.tokenizer_fingerprint:
                    return f
    raise EdgespecError(f"no default head ships for target {spec.name}; train one with "
                        "`edgespec train` and pass its folder to --draft")


class PromptLookup:
    """N-gram lookup in the context (as llama.cpp's lookup decoding): find the latest earlier
    occurrence of the context's last n tokens (n from max_ngram down to min_ngram) and propose
    the tokens that followed it."""

    needs_hidden = False
    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.last_match = 0  # n-gram length behind the latest proposal (0: none)

    def reset(self) -> None:
        pass

    def propose(self, context: list[int], hidden, k: int, p_min: float = 0.0) -> Draft:
        n_ctx = len(context)
        arr = np.asarray(context)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail = arr[n_ctx - n:]
            # candidate starts s with arr[s:s+n] == tail, s + n < n_ctx (something follows)
            win = np.lib.stride_tricks.sliding_window_view(arr[:n_ctx - 1], n)
            hits = np.flatnonzero((win == tail).all(1))
            if len(hits):
                s = int(hits[-1]) + n
                self.last_match = n
                return Draft([int(x) for x in arr[s:s + k]], source="lookup")
        self.last_match = 0
        return Draft([], source="lookup")


def _rms(x, w, eps):
    x = x.astype(np.float32, copy=False)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def _rope(x, pos, base):
    """x [T, H, D], pos [T] -> rotate-half RoPE."""
    d = x.shape[-1]
    inv = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float32) / d)
    ang = pos[:, None].astype(np.float32) * inv
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + np.concatenate([-x2, x1], -1) * sin


def single_thread_blas() -> None:
    """The head's matrices are small; OpenBLAS threads would only spin-wait between calls and
    steal the cores llama.cpp's threads need (measured: target decodes 2.5-5x slower)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")


class NumpyHead:
    """The MTP head's forward pass in numpy, with its own KV cache of real (target) pairs."""

    def __init__(self, config: dict, weights: dict[str, np.ndarray]):
        c = self.c = config
        # norms as given; matrices pre-transposed (x @ W.T is the torch Linear), kept once
        self.w = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items() if v.ndim == 1}
        self.t = {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32).T)
                  for k, v in weights.items() if v.ndim == 2}
        self.n_layer = len(c["layer_types"])
        self.scale = c.get("attn_scale") or 1.0 / np.sqrt(c["head_dim"])
        self.reset()

    def reset(self) -> None:
        self.k = [np.zeros((0, self.c["n_head_kv"], self.c["head_dim"]), np.float32)
                  for _ in range(self.n_layer)]
        self.v = [x.copy() for x in self.k]
        self.n = 0  # real pairs in the cache (positions 0..n-1)

    def _block(self, i, x, pos, ck, cv):
        """x [T, E] at positions pos; attends cache ck/cv (positions before pos[0]) + itself."""
        c, w, t = self.c, self.w, self.t
        p = f"blocks.{i}."
        hd, nh, nkv = c["head_dim"], c["n_head"], c["n_head_kv"]
        sliding = c["layer_types"][i] == "sliding"
        base = c["rope_base_local"] if sliding else c["rope_base_global"]
        h = _rms(x, w[p + "input_norm.weight"], c["rms_eps"])
        q = _rms((h @ t[p + "q.weight"]).reshape(-1, nh, hd), w[p + "q_norm.weight"], c["rms_eps"])
        k = _rms((h @ t[p + "k.weight"]).reshape(-1, nkv, hd), w[p + "k_norm.weight"], c["rms_eps"])
        v = (h @ t[p + "v.weight"]).reshape(-1, nkv, hd)
        q, k = _rope(q, pos, base), _rope(k, pos, base)
        K, V = np.concatenate([ck, k]), np.concatenate([cv, v])
        kpos = np.arange(pos[-1] - len(K) + 1, pos[-1] + 1)
        mask = kpos[None, :] <= pos[:, None]
        if sliding:
            mask &= kpos[None, :] > pos[:, None] - c["sliding_window"]
        rep = nh // nkv
        qg = q.reshape(-1, nkv, rep, hd)  # group query heads by their KV head
        s = np.einsum("tgrd,sgd->grts", qg, K) * self.scale
        s = np.where(mask[None, None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = np.einsum("grts,sgd->tgrd", s, V).reshape(-1, nh * hd)
        x = x + _rms(a @ t[p + "o.weight"], w[p + "post_attn_norm.weight"], c["rms_eps"])
        h = _rms(x, w[p + "pre_ffn_norm.weight"], c["rms_eps"])
        f = (_gelu_tanh(h @ t[p + "gate.weight"]) * (h @ t[p + "up.weight"])) @ t[p + "down.weight"]
        return x + _rms(f, w[p + "post_ffn_norm.weight"], c["rms_eps"]), k, v

    def forward(self, tok_emb, hidden, pos0, commit: bool, cache=None):
        """Pairs [T, E] x 2 at positions pos0.. -> outputs [T, E]; commit appends K/V."""
        c, w = self.c, self.w
        a = _rms(tok_emb * c["embed_scale"], w["emb_norm.weight"], c["rms_eps"])
        x = np.concatenate([a, _rms(hidden, w["hid_norm.weight"], c["rms_eps"])], -1) @ self.t["fc.weight"]
        pos = np.arange(pos0, pos0 + len(x))
        ks = cache[0] if cache else self.k
        vs = cache[1] if cache else self.v
        new_k, new_v = [], []
        for i in range(self.n_layer):
            x, k, v = self._block(i, x, pos, ks[i], vs[i])
            new_k.append(np.concatenate([ks[i], k]))
            new_v.append(np.concatenate([vs[i], v]))
        if commit:
            keep = self.c["sliding_window"] + 64  # the window bounds every cache needed
            limit = [keep if t == "sliding" else None for t in c["layer_types"]]
            self.k = [k[-lim:] if lim else k for k, lim in zip(new_k, limit)]
            self.v = [v[-lim:] if lim else v for v, lim in zip(new_v, limit)]
            self.n = pos0 + len(x)
        out = _rms(x, w["out_norm.weight"], c["rms_eps"])
        self.last_logits = self.logits(out[-1])
        return out, (new_k, new_v)

    def logits(self, out):
        return out @ self.t["lm_head"]


class OnnxHead:
    """The same head from an ONNX export (`edgespec export onnx`), run by onnxruntime on one
    thread; same interface as NumpyHead. Cache arrays are [1, kv_heads, S, head_dim]."""

    def __init__(self, path: str | Path):
        self.sess = open_session(path, threads=1)  # llama.cpp's threads need the cores
        md = self.sess.get_modelmeta().custom_metadata_map
        if md.get("edgespec.format") != "edgespec-mtp-onnx":
            raise EdgespecError(f"{path}: not an edgespec head (no edgespec metadata)")
        self.c = c = json.loads(md["edgespec.head_config"])
        self.info = {"target": md.get("edgespec.target"),
                     "target_fingerprint": md["edgespec.target_fingerprint"],
                     "draft_ids": np.asarray(json.loads(md["edgespec.draft_vocab"]), dtype=np.int64)}
        self.n_layer = len(c["layer_types"])
        self.past_names, present = cache_names(self.n_layer)
        self.out_names = ["logits", "hidden_out", *present]
        self.reset()

    def reset(self) -> None:
        z = np.zeros((1, self.c["n_head_kv"], 0, self.c["head_dim"]), np.float32)
        self.k = [z] * self.n_layer
        self.v = [z] * self.n_layer
        self.n = 0

    def forward(self, tok_emb, hidden, pos0, commit: bool, cache=None):
        ks = cache[0] if cache else self.k
        vs = cache[1] if cache else self.v
        feed = {"tok_emb": np.ascontiguousarray(tok_emb, dtype=np.float32),
                "hidden": np.ascontiguousarray(hidden, dtype=np.float32),
                "position": np.array(pos0, dtype=np.int64)}
        for i in range(self.n_layer):
            feed[self.past_names[2 * i]] = ks[i]
            feed[self.past_names[2 * i + 1]] = vs[i]
        res = self.sess.run(self.out_names, feed)
        self.last_logits = res[0][0]
        new_k, new_v = res[2::2], res[3::2]
        if commit:
            keep = self.c["sliding_window"] + 64
            self.k = [k[:, :, -keep:] if t == "sliding" else k
                      for k, t in zip(new_k, self.c["layer_types"])]
            self.v = [v[:, :, -keep:] if t == "sliding" else v
                      for v, t in zip(new_v, self.c["layer_types"])]
            self.n = pos0 + len(tok_emb)
        return res[1], (new_k, new_v)


class HeadDrafter:
    """Drafts with a trained MTP head next to its target: greedy chain, confidence stop."""

    needs_hidden = True

    def __init__(self, path: str | Path, target_spec):
        """`path`: a head GGUF or ONNX file (`edgespec export gguf|onnx`) or a training
        checkpoint folder."""
        path = Path(path)
        if not path.exists():
            raise EdgespecError(f"{path}: no such head file or folder")
        onnx_head = None
        if path.suffix == ".onnx":
            onnx_head = OnnxHead(path)
            info = onnx_head.info
            fingerprint, trained_for, self.ids = info["target_fingerprint"], info["target"], info["draft_ids"]
        elif path.suffix == ".gguf":
            from edgespec.exporters.gguf_head import read_head_gguf

            config, w, info = read_head_gguf(path)
            fingerprint, trained_for, self.ids = info["target_fingerprint"], info["target"], info["draft_ids"]
        else:
            from edgespec.exporters.gguf_head import read_checkpoint

            meta, w = read_checkpoint(path)
            config, fingerprint, trained_for = meta["head"], meta.get("target_fingerprint"), meta.get("target")
            self.ids = w.pop("draft_ids").astype(np.int64)
        if fingerprint != target_spec.tokenizer_fingerprint:
            raise EdgespecError(f"head {path} was trained for target '{trained_for}' (fingerprint "
                                f"{fingerprint}), not for {target_spec.name} "
                                f"({target_spec.tokenizer_fingerprint})")
        self.head = onnx_head or NumpyHead(config, w)
        self.embed = TensorRows(read_header(target_spec.path), "token_embd.weight")
        self.name = str(path)
        single_thread_blas()

    def reset(self) -> None:
        self.head.reset()

    def propose(self, context: list[int], hidden: np.ndarray | None, k: int,
                p_min: float = 0.0) -> Draft:
        """`hidden`: target hidden states [n, E] for the n positions before the pending token
        that the head has not seen yet (pair: hidden at m, token at m + 1)."""
        h = self.head
        n_ctx = len(context)
        if hidden is None or not len(hidden):
            return Draft([])
        pos0 = n_ctx - 1 - len(hidden)
        if pos0 != h.n:  # a new prompt, or rows were skipped: restart the cache at these rows
            h.reset()
        out, _ = h.forward(self.embed[np.asarray(context[pos0 + 1:n_ctx])], hidden, pos0,
                           commit=True)
        drafts, conf, cache = [], [], (h.k, h.v)
        for j in range(k):
            lg = h.last_logits
            best = int(np.argmax(lg))
            top = float(1.0 / np.exp(lg - lg[best]).sum())
            if top < p_min and j > 0:
                break
            tok = int(self.ids[best])
            drafts.append(tok)
            conf.append(top)
            if j + 1 < k:
                out, cache = h.forward(self.embed[np.array([tok])], out[-1:], n_ctx - 1 + j,
                                       commit=False, cache=cache)
        return Draft(drafts, conf=conf, source="head")


class MixedDrafter:
    """Prompt lookup where the context repeats itself, the head everywhere else.

    When the context's last `min_match` or more tokens occurred before, the tokens that followed
    them are the draft (free to make, and often right: greedy text and code repeat). Otherwise
    the head drafts. The head only reads the target's hidden states when it drafts: rows that
    arrive meanwhile are kept and fed to it in one batch, so its cache stays complete."""

    needs_hidden = True

    def __init__(self, head: HeadDrafter, lookup: PromptLookup | None = None, min_match: int = 2):
        self.head, self.lookup, self.min_match = head, lookup or PromptLookup(), min_match
        self.name = f"{head.name}+lookup"
        self.pending: list[np.ndarray] = []

    def reset(self) -> None:
        self.head.reset()
        self.pending = []

    def propose(self, context: list[int], hidden, k: int, p_min: float = 0.0) -> Draft:
        if hidden is not None and len(hidden):
            self.pending.append(hidden)  # the decode loop hands over fresh arrays
        d = self.lookup.propose(context, None, k)
        if d.tokens and self.lookup.last_match >= self.min_match:
            return d
        rows = np.concatenate(self.pending) if self.pending else None
        self.pending = []
        return self.head.propose(context, rows, k, p_min)
