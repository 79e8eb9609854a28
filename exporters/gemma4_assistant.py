"""Shared-KV heads to the GGUF of llama.cpp's Gemma 4 MTP drafter (architecture `gemma4-assistant`).

    edgespec export llama-cpp runs/gemma/skv --out assistant.gguf [--quant f16|q8_0]
    llama-server -m TARGET.gguf -md assistant.gguf --spec-type draft-mtp   # a target whose graph
                                                                            # hands out t_h_nextn

What llama.cpp's loader and graph read (its src/models/gemma4-assistant.cpp): under
`gemma4-assistant.*` the head's width (`embedding_length`), the target's (`embedding_length_out`,
which must differ: that is how the loader tells them apart), `block_count` and
`nextn_predict_layers` (equal), heads, KV heads, head widths (`key_length[_swa]`,
`value_length[_swa]`), FFN width, the window and a per-layer sliding pattern, RMS epsilon, both
RoPE bases, and the target's tokenizer (its vocabulary size). Tensors: `nextn.pre_projection`
[2E -> d] over concat(target embedding x sqrt(E), h), per layer a query-only attention block
(`attn_norm`, `attn_q`, `attn_q_norm`, `attn_output`, `post_attention_norm`, `ffn_norm`, GeGLU
`ffn_gate`/`ffn_up`/`ffn_down`, `post_ffw_norm`, `layer_output_scale`; one `rope_freqs` for
the global layers), `output_norm`, then logits from `token_embd` [d -> full vocabulary] and the
next h from `nextn.post_projection` [d -> E]. Its layers read the target's KV cache: sliding
ones the target's layer n_layer - 2, global ones n_layer - 1.

From edgespec's shared-KV head (training/shared_kv.py), exactly:
- norms: Gemma's x/rms * (1 + w) -> llama.cpp's plain x/rms * w, so weights 1 + w;
- attention scale: llama.cpp's graph uses 1; the head's 1/sqrt(head_dim) goes into attn_q_norm
  (the query is linear in it, RoPE too);
- logits: the head's are lm_head . post_proj(out_norm(x)) over the draft vocabulary, so the rows
  of `token_embd` at the draft ids are lm_head @ post_proj; every other row is 0 (those tokens get
  logit 0: llama.cpp's drafter samples its top 10 and stops below a probability, which those
  zero logits take mass from where the head's top logit is small; checked against llama.cpp
  itself before relying on it);
- next h: post_proj(out_norm(x)), the head's own next input.
What it cannot take: a head with `--input-norms` (the assistant graph has none), one as wide as
the target (`train --d-model`), one whose layers are not the target's last sliding and last
global layer. Not a file to ship: `token_embd` covers the full vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.exporters.eagle3_gguf import copy_tokenizer, finish_gguf
from edgespec.io import atomic_write
from edgespec.runtime.formats import DRAFT_IDS, SharedKVConfig, head_arch, read_checkpoint

ARCH = "gemma4-assistant"
QUANTS = ("f16", "q8_0")


def assistant_layers(spec) -> tuple[int, int]:
    """The target layers llama.cpp's assistant reads: n_layer - 2 (sliding), n_layer - 1 (global)."""
    return spec.n_layer - 2, spec.n_layer - 1


def assistant_tensors(c: SharedKVConfig, w: dict[str, np.ndarray], ids: np.ndarray,
                      n_vocab: int) -> dict[str, np.ndarray]:
    """Checkpoint weights (torch layout [out, in]) -> llama.cpp's tensors, float32, numpy layout
    [rows, columns] (ggml's ne0 is the last axis)."""
    f = {k: np.asarray(v, dtype=np.float32) for k, v in w.items()}
    one = lambda name: 1.0 + f[name]  # noqa: E731  Gemma's (1 + w) norms, written as plain ones
    embd = np.zeros((n_vocab, c.d_model), np.float32)
    embd[ids] = f["lm_head"] @ f["post_proj.weight"]
    t = {"token_embd.weight": embd, "output_norm.weight": one("out_norm.weight"),
         "nextn.pre_projection.weight": f["pre_proj.weight"],
         "nextn.post_projection.weight": f["post_proj.weight"]}
    for i in range(c.n_layer):
        p, b = f"blocks.{i}.", f"blk.{i}."
        t.update({b + "attn_norm.weight": one(p + "input_norm.weight"),
                  b + "attn_q.weight": f[p + "q.weight"],
                  b + "attn_q_norm.weight": one(p + "q_norm.weight") * np.float32(c.scale),
                  b + "attn_output.weight": f[p + "o.weight"],
                  b + "post_attention_norm.weight": one(p + "post_attn_norm.weight"),
                  b + "ffn_norm.weight": one(p + "pre_ffn_norm.weight"),
                  b + "ffn_gate.weight": f[p + "gate.weight"], b + "ffn_up.weight": f[p + "up.weight"],
                  b + "ffn_down.weight": f[p + "down.weight"],
                  b + "post_ffw_norm.weight": one(p + "post_ffn_norm.weight"),
                  b + "layer_output_scale.weight": np.ones(1, np.float32)})
    if "global" in c.layer_types:  # one tensor, shared by the global layers (RoPE as the target's)
        t["rope_freqs.weight"] = np.ones(c.head_dim // 2, np.float32)
    return t


def read_assistant_checkpoint(ckpt: str | Path):
    """(meta, config, target spec, weights, draft ids) of a shared-KV checkpoint the assistant
    layout can hold; one line naming what it cannot."""
    from edgespec.targets import KNOWN_TARGETS, load_target_spec

    meta, weights = read_checkpoint(ckpt)
    if head_arch(meta["head"]) != "shared-kv":
        raise EdgespecError(f"{ckpt} is not a shared-KV head: `export llama-cpp` writes EAGLE-3 "
                            "heads (--arch eagle3) and shared-KV heads (--arch shared-kv)")
    c = SharedKVConfig.from_dict(meta["head"])
    spec = load_target_spec(meta["target"] if meta["target"] in KNOWN_TARGETS else meta["target_path"])
    if spec.tokenizer_fingerprint != meta["target_fingerprint"]:
        raise EdgespecError(f"target {meta['target']} does not match the head's fingerprint")
    if c.input_norms:
        raise EdgespecError(f"{ckpt} RMS-norms its inputs (--input-norms), which llama.cpp's "
                            "gemma4-assistant graph does not: train without it to export there")
    if c.d_model == c.n_embd:
        raise EdgespecError(f"{ckpt} is as wide as its target ({c.n_embd}); llama.cpp's "
                            "gemma4-assistant loader needs another width: train with --d-model")
    want = assistant_layers(spec)
    if tuple(c.kv_layers) != want or list(c.layer_types) != ["sliding", "global"]:
        raise EdgespecError(f"{ckpt} attends layers {c.kv_layers}; llama.cpp's assistant reads "
                            f"the target's last sliding and last global layer {list(want)}")
    ids = weights.pop(DRAFT_IDS).astype(np.int64)
    return meta, c, spec, weights, ids


def write_assistant_gguf(ckpt: str | Path, out: str | Path, quant: str = "q8_0") -> dict:
    import gguf
    from gguf.constants import GGMLQuantizationType as Q

    if quant not in QUANTS:
        raise EdgespecError(f"unknown --quant {quant} for llama-cpp; choose from {', '.join(QUANTS)}")
    meta, c, spec, weights, ids = read_assistant_checkpoint(ckpt)
    tensors = assistant_tensors(c, weights, ids, spec.n_vocab)
    qt = Q.F16 if quant == "f16" else Q.Q8_0
    out = Path(out)

    def write(tmp):
        w = gguf.GGUFWriter(tmp, ARCH)
        w.add_string("general.name", f"edgespec shared-KV head for {meta['target']}")
        w.add_uint32(f"{ARCH}.context_length", spec.n_ctx_train or 32768)
        w.add_uint32(f"{ARCH}.embedding_length", c.d_model)
        w.add_uint32(f"{ARCH}.embedding_length_out", c.n_embd)
        w.add_uint32(f"{ARCH}.block_count", c.n_layer)
        w.add_uint32(f"{ARCH}.nextn_predict_layers", c.n_layer)
        w.add_uint32(f"{ARCH}.feed_forward_length", c.n_ff)
        w.add_uint32(f"{ARCH}.attention.head_count", c.n_head)
        w.add_uint32(f"{ARCH}.attention.head_count_kv", c.n_head_kv)
        for key in ("key_length", "value_length", "key_length_swa", "value_length_swa"):
            w.add_uint32(f"{ARCH}.attention.{key}", c.head_dim)
        w.add_uint32(f"{ARCH}.attention.sliding_window", c.sliding_window)
        w.add_array(f"{ARCH}.attention.sliding_window_pattern", [t == "sliding" for t in c.layer_types])
        w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", c.rms_eps)
        w.add_float32(f"{ARCH}.rope.freq_base", c.rope_base_global)
        w.add_float32(f"{ARCH}.rope.freq_base_swa", c.rope_base_local)
        w.add_string("edgespec.target", meta["target"])
        w.add_string("edgespec.target_fingerprint", meta["target_fingerprint"])
        w.add_string("edgespec.head_config", json.dumps(c.to_dict()))
        w.add_array("edgespec.draft_vocab", [int(x) for x in ids])
        copy_tokenizer(w, spec.path)
        finish_gguf(w, tensors, qt)

    atomic_write(out, write)
    return {"out": str(out), "arch": ARCH, "quant": quant, "bytes": out.stat().st_size,
            "target": meta["target"], "kv_layers": list(c.kv_layers), "draft_vocab": int(len(ids)),
            "runs_in_stock_llama_cpp": "no: stock llama.cpp's gemma3 graph hands no t_h_nextn to the drafter",
            "run": f"llama-server -m {spec.path} -md {out} --spec-type draft-mtp (a patched server)"}


def assistant_step(t: dict[str, np.ndarray], meta: dict, tok_emb: np.ndarray, h: np.ndarray, qpos: int,
                   keys: list[np.ndarray], values: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """One draft step as llama.cpp's gemma4-assistant graph computes it, from the file's tensors
    (numpy layout, dequantized): (logits over the full vocabulary, next h). keys/values: per
    layer the target's [S, Hkv, D] the layer attends (a sliding layer's cut to its window), RoPE
    applied as the cache holds them. The export's check: this equals the trained head's step."""
    from edgespec.runtime.heads import gelu_tanh, rope_turn

    def rms(x, wt):
        x = x.astype(np.float32)
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + meta["eps"]) * wt

    e = tok_emb * np.float32(np.sqrt(meta["n_embd_out"]))
    x = np.concatenate([e, h], -1) @ t["nextn.pre_projection.weight"].T
    nh, hd = meta["n_head"], meta["head_dim"]
    for i, sliding in enumerate(meta["sliding"]):
        b = f"blk.{i}."
        q = (rms(x, t[b + "attn_norm.weight"]) @ t[b + "attn_q.weight"].T).reshape(len(x), nh, hd)
        q = rope_turn(rms(q, t[b + "attn_q_norm.weight"]), np.full(len(x), qpos),
                  meta["base_swa"] if sliding else meta["base"])
        K, V = keys[i], values[i]
        g = K.shape[1]
        s = np.einsum("tgrd,sgd->grts", q.reshape(len(x), g, nh // g, hd), K)  # scale 1
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = np.einsum("grts,sgd->tgrd", s, V).reshape(len(x), nh * hd) @ t[b + "attn_output.weight"].T
        x = rms(a, t[b + "post_attention_norm.weight"]) + x
        f = rms(x, t[b + "ffn_norm.weight"])
        f = (gelu_tanh(f @ t[b + "ffn_gate.weight"].T) * (f @ t[b + "ffn_up.weight"].T)) @ t[b + "ffn_down.weight"].T
        x = (rms(f, t[b + "post_ffw_norm.weight"]) + x) * t[b + "layer_output_scale.weight"][0]
    n = rms(x, t["output_norm.weight"])
    return n @ t["token_embd.weight"].T, n @ t["nextn.post_projection.weight"].T


def read_assistant_gguf(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """The file's tensors (dequantized, numpy layout) and the hyperparameters `assistant_step` reads."""
    from edgespec.gguf_meta import TensorRows, read_header

    header = read_header(path)
    md = header.metadata
    if md.get("general.architecture") != ARCH:
        raise EdgespecError(f"{path}: not a gemma4-assistant GGUF")
    t = {}
    for name, info in header.tensors.items():
        arr = TensorRows(header, name)[:]
        t[name] = arr.reshape(tuple(reversed(info.shape))) if len(info.shape) > 1 else arr.reshape(-1)
    k = lambda key: md[f"{ARCH}.{key}"]  # noqa: E731
    meta = {"n_embd_out": int(k("embedding_length_out")), "n_head": int(k("attention.head_count")),
            "head_dim": int(k("attention.key_length")), "eps": float(k("attention.layer_norm_rms_epsilon")),
            "base": float(k("rope.freq_base")), "base_swa": float(k("rope.freq_base_swa")),
            "sliding": [bool(x) for x in k("attention.sliding_window_pattern")]}
    return t, meta


class AssistantFile:
    """An exported gemma4-assistant GGUF run as llama.cpp's graph computes it (`assistant_step`),
    with the shared-KV heads' `step` interface: logits at the draft ids, for `--check`."""

    def __init__(self, path: str | Path):
        self.t, self.meta = read_assistant_gguf(path)
        from edgespec.gguf_meta import read_header

        md = read_header(path).metadata
        self.c = SharedKVConfig.from_dict(json.loads(md["edgespec.head_config"]))
        self.ids = np.asarray(md["edgespec.draft_vocab"], dtype=np.int64)

    def step(self, tok_emb, hidden, qpos: int, keys, values):
        from edgespec.runtime.heads import attended

        logits, h = assistant_step(self.t, self.meta, tok_emb, hidden, qpos, *attended(self.c, qpos, keys, values))
        return h, logits[:, self.ids]


def check_assistant_export(ckpt: str | Path, exported: str | Path, features: str | Path) -> dict:
    """The exported file, run as llama.cpp's assistant graph, beside the trained torch head on
    held-out features with the keys and values (`exporters/check.py`'s shared-KV check)."""
    from edgespec.exporters.check import check_shared_kv
    from edgespec.training.features import Features
    from edgespec.training.train import load_checkpoint

    head, meta = load_checkpoint(ckpt)
    r = check_shared_kv(head, meta, AssistantFile(exported), exported, Features(features), 4, 12, 8)
    r["runtime"] = "numpy, as llama.cpp's gemma4-assistant graph computes"
    return r
