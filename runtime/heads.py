"""The MTP draft head at run time, without torch: numpy (from a head GGUF or a checkpoint) or
onnxruntime (from a head ONNX). Both keep the head's own KV cache of real (target) pairs and
share one interface:

    out, (k, v) = head.forward(tok_emb [T, E], hidden [T, E], pos0, commit, cache=None)
    head.last_logits   # draft-vocabulary logits of the last pair
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError, one_line
from edgespec.runtime.formats import (EAGLE3_ARCH, ONNX_FORMAT, ONNX_HEAD_CONFIG, ONNX_HEAD_FORMAT,
                                      HeadConfig, HeadFile, SharedKVConfig, cache_names, head_arch,
                                      gguf_architecture, kept_positions, read_checkpoint_head,
                                      read_eagle3_file, read_head_gguf, read_onnx_head_meta)
from edgespec.runtime.onnx_session import open_session


def _rms(x, w, eps):
    x = x.astype(np.float32, copy=False)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def rope_turn(x, pos, base):
    """x [T, H, D], pos [T] -> rotate-half RoPE."""
    d = x.shape[-1]
    inv = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float32) / d)
    ang = pos[:, None].astype(np.float32) * inv
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + np.concatenate([-x2, x1], -1) * sin


def _attend(q, K, V, scale: float, mask=None):
    """q [T, H, D] over keys and values [S, Hkv, D] (query heads grouped by their KV head);
    mask [T, S] bool, None: every key -> [T, H * D]."""
    nh, hd, nkv = q.shape[1], q.shape[2], K.shape[1]
    qg = q.reshape(-1, nkv, nh // nkv, hd)
    s = np.einsum("tgrd,sgd->grts", qg, K) * np.float32(scale)
    if mask is not None:
        s = np.where(mask[None, None], s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    return np.einsum("grts,sgd->tgrd", s, V).reshape(-1, nh * hd)


def _block_out(x, a, w, t, p: str, eps: float):
    """The rest of a Gemma block after attention `a`: output projection, post-attention norm,
    residual, then the GeGLU FFN with its pre and post norms and residual."""
    x = x + _rms(a @ t[p + "o.weight"], w[p + "post_attn_norm.weight"], eps)
    h = _rms(x, w[p + "pre_ffn_norm.weight"], eps)
    f = (gelu_tanh(h @ t[p + "gate.weight"]) * (h @ t[p + "up.weight"])) @ t[p + "down.weight"]
    return x + _rms(f, w[p + "post_ffn_norm.weight"], eps)


def _commit(c: HeadConfig, caches: list, axis: int) -> list:
    """Sliding layers keep only what their window can still see (plus a rollback margin)."""
    tail = (slice(None),) * axis + (slice(-kept_positions(c.sliding_window), None),)
    return [a[tail] if t == "sliding" else a for a, t in zip(caches, c.layer_types)]


class NumpyHead:
    """The MTP head's forward pass in numpy; caches are [S, kv_heads, head_dim] per layer."""

    def __init__(self, config: HeadConfig, weights: dict[str, np.ndarray]):
        self.c = config
        # norms as given; matrices pre-transposed (x @ W.T is the torch Linear), kept once
        self.w = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items() if v.ndim == 1}
        self.t = {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32).T)
                  for k, v in weights.items() if v.ndim == 2}
        self.reset()

    def reset(self) -> None:
        c = self.c
        self.k = [np.zeros((0, c.n_head_kv, c.head_dim), np.float32) for _ in range(c.n_layer)]
        self.v = [x.copy() for x in self.k]
        self.n = 0  # real pairs in the cache (positions 0..n-1)

    def _block(self, i, x, pos, ck, cv):
        """x [T, E] at positions pos; attends cache ck/cv (positions before pos[0]) + itself."""
        c, w, t = self.c, self.w, self.t
        p = f"blocks.{i}."
        hd, nh, nkv = c.head_dim, c.n_head, c.n_head_kv
        sliding = c.layer_types[i] == "sliding"
        base = c.rope_base_local if sliding else c.rope_base_global
        h = _rms(x, w[p + "input_norm.weight"], c.rms_eps)
        q = _rms((h @ t[p + "q.weight"]).reshape(-1, nh, hd), w[p + "q_norm.weight"], c.rms_eps)
        k = _rms((h @ t[p + "k.weight"]).reshape(-1, nkv, hd), w[p + "k_norm.weight"], c.rms_eps)
        v = (h @ t[p + "v.weight"]).reshape(-1, nkv, hd)
        q, k = rope_turn(q, pos, base), rope_turn(k, pos, base)
        K, V = np.concatenate([ck, k]), np.concatenate([cv, v])
        kpos = np.arange(pos[-1] - len(K) + 1, pos[-1] + 1)
        mask = kpos[None, :] <= pos[:, None]
        if sliding:
            mask &= kpos[None, :] > pos[:, None] - c.sliding_window
        return _block_out(x, _attend(q, K, V, c.scale, mask), w, t, p, c.rms_eps), k, v

    def forward(self, tok_emb, hidden, pos0, commit: bool, cache=None):
        """Pairs [T, E] x 2 at positions pos0.. -> outputs [T, E]; commit appends K/V."""
        c, w = self.c, self.w
        a = _rms(tok_emb * c.embed_scale, w["emb_norm.weight"], c.rms_eps)
        x = np.concatenate([a, _rms(hidden, w["hid_norm.weight"], c.rms_eps)], -1) @ self.t["fc.weight"]
        pos = np.arange(pos0, pos0 + len(x))
        ks, vs = cache if cache else (self.k, self.v)
        new_k, new_v = [], []
        for i in range(c.n_layer):
            x, k, v = self._block(i, x, pos, ks[i], vs[i])
            new_k.append(np.concatenate([ks[i], k]))
            new_v.append(np.concatenate([vs[i], v]))
        if commit:
            self.k, self.v = _commit(c, new_k, 0), _commit(c, new_v, 0)
            self.n = pos0 + len(x)
        out = _rms(x, w["out_norm.weight"], c.rms_eps)
        self.last_logits = self.logits(out[-1])
        return out, (new_k, new_v)

    def logits(self, out):
        return out @ self.t["lm_head"]


def onnx_head_arch(path: str | Path) -> str | None:
    """The head architecture a head ONNX file's metadata names (None: not an edgespec head)."""
    import onnx

    try:
        md = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
        return head_arch(json.loads(md[ONNX_HEAD_CONFIG])) if md.get(ONNX_FORMAT) == ONNX_HEAD_FORMAT else None
    except Exception:  # not an ONNX file, or no edgespec metadata: loading it says why
        return None


def onnx_head_file(path: str | Path, sess=None) -> HeadFile:
    """The metadata of a head ONNX file (opens a session unless one is given)."""
    sess = sess or open_session(path, threads=1)
    return read_onnx_head_meta(path, sess.get_modelmeta().custom_metadata_map)


class OnnxHead:
    """The same head from an ONNX export (`edgespec export onnx`), run by onnxruntime on one
    thread; caches are [1, kv_heads, S, head_dim]."""

    def __init__(self, path: str | Path, sess=None, file: HeadFile | None = None):
        self.sess = sess or open_session(path, threads=1)  # llama.cpp's threads need the cores
        self.file = file or onnx_head_file(path, self.sess)
        self.c = self.file.config
        self.past_names, present = cache_names(self.c.n_layer)
        self.out_names = ["logits", "hidden_out", *present]
        self.path = Path(path)
        self._check_graph()
        self.reset()

    def _check_graph(self) -> None:
        """The graph's inputs and outputs are the ones its metadata implies (a file may say one
        thing and hold another)."""
        ins = {i.name: i.shape for i in self.sess.get_inputs()}
        outs = {o.name for o in self.sess.get_outputs()}
        want_in = ["tok_emb", "hidden", "position", *self.past_names]
        bad = sorted(set(want_in) ^ set(ins)) + sorted(set(self.out_names) - outs)
        widths = [ins[n][-1] for n in ("tok_emb", "hidden") if n in ins and ins[n]]
        if bad or any(isinstance(w, int) and w != self.c.n_embd for w in widths):
            raise EdgespecError(f"{self.path}: the graph's inputs and outputs do not match its "
                                "edgespec metadata; export the head again")

    def reset(self) -> None:
        z = np.zeros((1, self.c.n_head_kv, 0, self.c.head_dim), np.float32)
        self.k = [z] * self.c.n_layer
        self.v = [z] * self.c.n_layer
        self.n = 0

    def forward(self, tok_emb, hidden, pos0, commit: bool, cache=None):
        ks, vs = cache if cache else (self.k, self.v)
        feed = {"tok_emb": np.ascontiguousarray(tok_emb, dtype=np.float32),
                "hidden": np.ascontiguousarray(hidden, dtype=np.float32),
                "position": np.array(pos0, dtype=np.int64)}
        for i in range(self.c.n_layer):
            feed[self.past_names[2 * i]] = ks[i]
            feed[self.past_names[2 * i + 1]] = vs[i]
        try:
            res = self.sess.run(self.out_names, feed)
        except Exception as e:  # a graph that loads but cannot run (a damaged or foreign file)
            raise EdgespecError(f"{self.path}: onnxruntime could not run the head "
                                f"({one_line(e)})") from None
        if res[0].shape != (1, self.c.n_draft_vocab) or res[1].shape != (len(tok_emb), self.c.n_embd):
            raise EdgespecError(f"{self.path}: the head returned outputs of shapes {res[0].shape} "
                                f"and {res[1].shape}, not what its metadata says")
        self.last_logits = res[0][0]
        new_k, new_v = res[2::2], res[3::2]
        if commit:
            self.k, self.v = _commit(self.c, new_k, 2), _commit(self.c, new_v, 2)
            self.n = pos0 + len(tok_emb)
        return res[1], (new_k, new_v)


class Eagle3NumpyHead:
    """An EAGLE-3 head (`edgespec export llama-cpp`) in numpy, the same interface as NumpyHead:
    `forward(tok_emb, hidden, pos0, commit, cache)`. `hidden` rows are either the target's
    stored vectors [T, E * 4] (final hidden state, then the three layer inputs: fused by fc) or
    the head's own previous states [T, E] (draft steps after the first). Returns the pre-norm
    states, which the next draft step reads; `last_logits` over the draft vocabulary."""

    def __init__(self, config, weights: dict[str, np.ndarray]):
        self.c = c = config
        self.w = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items() if v.ndim == 1}
        self.t = {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32).T)
                  for k, v in weights.items() if v.ndim == 2}
        self.scale = 1.0 / float(np.sqrt(c.head_dim))
        self.reset()

    def reset(self) -> None:
        self.k = np.zeros((0, self.c.n_head_kv, self.c.head_dim), np.float32)
        self.v = self.k.copy()
        self.n = 0

    def _norm(self, x, name):
        x = x.astype(np.float32, copy=False)
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.c.rms_eps) * self.w[name]

    def forward(self, tok_emb, hidden, pos0, commit: bool, cache=None):
        c, t = self.c, self.t
        hidden = np.asarray(hidden, dtype=np.float32)
        if hidden.shape[-1] == 4 * c.n_embd:  # target features: fuse the three layer inputs
            f = hidden[:, c.n_embd:]
            g = (self._norm(f, "enc_norm.weight") if c.norm_before_fc else f) @ t["fc.weight"]
        else:
            g = hidden
        x = np.concatenate([self._norm(tok_emb, "attn_norm.weight"),
                            self._norm(g, "hidden_norm.weight")], -1)
        nh, nkv, hd = c.n_head, c.n_head_kv, c.head_dim
        pos = np.arange(pos0, pos0 + len(x))
        q = rope_turn((x @ t["q.weight"]).reshape(-1, nh, hd), pos, c.rope_base)
        k = rope_turn((x @ t["k.weight"]).reshape(-1, nkv, hd), pos, c.rope_base)
        v = (x @ t["v.weight"]).reshape(-1, nkv, hd)
        ck, cv = cache if cache else (self.k, self.v)
        K, V = np.concatenate([ck, k]), np.concatenate([cv, v])
        kpos = np.arange(pos[-1] - len(K) + 1, pos[-1] + 1)
        mask = kpos[None, :] <= pos[:, None]
        qg = q.reshape(-1, nkv, nh // nkv, hd)
        s = np.einsum("tgrd,sgd->grts", qg, K) * self.scale
        s = np.where(mask[None, None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = np.einsum("grts,sgd->tgrd", s, V).reshape(-1, nh * hd)
        h = g + a @ t["o.weight"]
        n = self._norm(h, "ffn_norm.weight")
        gate = n @ t["gate.weight"]
        state = h + ((gate / (1.0 + np.exp(-gate))) * (n @ t["up.weight"])) @ t["down.weight"]
        if commit:
            self.k, self.v, self.n = K, V, pos0 + len(x)
        self.last_logits = self.logits(state[-1])
        return state, (K, V)

    def logits(self, state):
        return self._norm(state, "out_norm.weight") @ self.t["lm_head"]


class SharedKVNumpyHead:
    """The shared-KV head's draft steps in numpy (training/shared_kv.py, step for step): no
    cache of its own; each layer's queries attend the target's keys and values of one target
    layer, which the drafter holds for the whole context (`runtime/drafters.SharedKVDrafter`).
    Every step of a chain sits at the position after the target's last cached one."""

    def __init__(self, config: SharedKVConfig, weights: dict[str, np.ndarray]):
        self.c = config
        self.w = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items() if v.ndim == 1}
        self.t = {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32).T)
                  for k, v in weights.items() if v.ndim == 2}

    def step_input(self, tok_emb: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        """tok_emb: the newest token's target embedding row(s) (unscaled) [T, E]; hidden: the
        target's final hidden state (first step) or the head's last output [T, E] -> [T, d]."""
        c, w = self.c, self.w
        e = tok_emb * np.float32(c.embed_scale)
        if c.input_norms:
            e, hidden = _rms(e, w["emb_norm.weight"], c.rms_eps), _rms(hidden, w["hid_norm.weight"], c.rms_eps)
        return np.concatenate([e, hidden], -1).astype(np.float32) @ self.t["pre_proj.weight"]

    def step(self, tok_emb, hidden, qpos: int, keys: list[np.ndarray], values: list[np.ndarray]):
        """One draft step of T rows at position qpos over the target's keys and values of
        positions 0..qpos-1 per head layer [qpos, Hkv, D] -> (outputs [T, E], logits [T, Vd])."""
        out = self.forward(self.step_input(tok_emb, hidden), qpos, *attended(self.c, qpos, keys, values))
        return out, out @ self.t["lm_head"]

    def forward(self, x: np.ndarray, qpos: int, keys: list[np.ndarray], values: list[np.ndarray]):
        """x [T, d] at position qpos over the keys and values each layer attends (`attended`)
        -> outputs [T, E]."""
        c, w, t = self.c, self.w, self.t
        nh, hd = c.n_head, c.head_dim
        pos = np.full(len(x), qpos)
        for i in range(c.n_layer):
            p = f"blocks.{i}."
            sliding = c.layer_types[i] == "sliding"
            K, V = keys[i], values[i]
            h = _rms(x, w[p + "input_norm.weight"], c.rms_eps)
            q = _rms((h @ t[p + "q.weight"]).reshape(-1, nh, hd), w[p + "q_norm.weight"], c.rms_eps)
            q = rope_turn(q, pos, c.rope_base_local if sliding else c.rope_base_global)
            x = _block_out(x, _attend(q, K, V, c.scale), w, t, p, c.rms_eps)
        return _rms(x, w["out_norm.weight"], c.rms_eps) @ t["post_proj.weight"]



def attended(c: SharedKVConfig, qpos: int, keys: list, values: list) -> tuple[list, list]:
    """The target's keys and values each shared-KV head layer attends from position qpos: all of
    positions 0..qpos-1, a sliding layer only those > qpos - window."""
    lo = [max(0, qpos - c.sliding_window + 1) if t == "sliding" else 0 for t in c.layer_types]
    return [k[a:qpos] for k, a in zip(keys, lo)], [v[a:qpos] for v, a in zip(values, lo)]


class OnnxSharedKVHead:
    """The shared-KV head from its ONNX export (`edgespec export onnx`), run by onnxruntime on
    one thread: the same `step` as SharedKVNumpyHead."""

    def __init__(self, path: str | Path, sess, file: HeadFile):
        self.sess, self.file, self.c, self.path = sess, file, file.config, Path(path)
        self.in_names = ["tok_emb", "hidden", "position",
                         *[f"kv.{i}.{kind}" for i in range(self.c.n_layer) for kind in ("key", "value")]]
        ins = {i.name for i in sess.get_inputs()}
        outs = {o.name for o in sess.get_outputs()}
        if ins != set(self.in_names) or not {"logits", "hidden_out"} <= outs:
            raise EdgespecError(f"{self.path}: the graph's inputs and outputs do not match its "
                                "edgespec metadata; export the head again")

    def step(self, tok_emb, hidden, qpos: int, keys: list[np.ndarray], values: list[np.ndarray]):
        ks, vs = attended(self.c, qpos, keys, values)
        feed = {"tok_emb": np.ascontiguousarray(tok_emb, dtype=np.float32),
                "hidden": np.ascontiguousarray(hidden, dtype=np.float32),
                "position": np.array(qpos, dtype=np.int64)}
        for i in range(self.c.n_layer):
            feed[self.in_names[3 + 2 * i]] = np.ascontiguousarray(ks[i], dtype=np.float32)
            feed[self.in_names[4 + 2 * i]] = np.ascontiguousarray(vs[i], dtype=np.float32)
        try:
            logits, out = self.sess.run(["logits", "hidden_out"], feed)
        except Exception as e:  # a graph that loads but cannot run (a damaged or foreign file)
            raise EdgespecError(f"{self.path}: onnxruntime could not run the head ({one_line(e)})") from None
        if logits.shape != (len(tok_emb), self.c.n_draft_vocab) or out.shape != (len(tok_emb), self.c.n_embd):
            raise EdgespecError(f"{self.path}: the head returned outputs of shapes {logits.shape} "
                                f"and {out.shape}, not what its metadata says")
        return out, logits


def load_head(path: str | Path) -> tuple[NumpyHead | OnnxHead | SharedKVNumpyHead, HeadFile]:
    """A runnable head from a head ONNX or GGUF file or a training checkpoint folder (a
    shared-KV head runs from its checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise EdgespecError(f"{path}: no such head file or folder")
    if path.suffix == ".onnx":
        sess = open_session(path, threads=1)  # llama.cpp's threads need the cores
        info = onnx_head_file(path, sess)
        if isinstance(info.config, SharedKVConfig):
            return OnnxSharedKVHead(path, sess, info), info
        head = OnnxHead(path, sess, info)
        return head, head.file
    if path.suffix == ".gguf" and gguf_architecture(path) == EAGLE3_ARCH:
        info = read_eagle3_file(path)
        return Eagle3NumpyHead(info.config, info.weights), info
    info = read_head_gguf(path) if path.suffix == ".gguf" else read_checkpoint_head(path, shared_kv=True)
    if isinstance(info.config, SharedKVConfig):
        return SharedKVNumpyHead(info.config, info.weights), info
    return NumpyHead(info.config, info.weights), info
