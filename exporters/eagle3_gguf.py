"""EAGLE-3 heads to the GGUF that stock llama.cpp loads (architecture `eagle3`).

    edgespec export llama-cpp runs/smol/eagle3 --out eagle3.gguf [--quant f16|q8_0]
    llama-server -m SmolLM2-135M.gguf -md eagle3.gguf --spec-type draft-eagle3

What llama.cpp's loader and its `eagle3` graph read (its src/models/eagle3.cpp): the decoder
hyperparameters under `eagle3.*`, the three target layer ids (`eagle3.target_layers`) and the
target's width (`eagle3.target_hidden_size`), `eagle3.norm_before_fc`; tensors `fc`,
`enc.output_norm` (the norm before fc), one block (`attn_norm` on the token embedding,
`attn_norm_2` on g, q/k/v over both, SwiGLU FFN), `output_norm`, `output` over the draft
vocabulary, and `d2t`: int64, the absolute target id of each draft token (llama.cpp scatters the
draft logits into the full vocabulary with it). There is no `token_embd`: llama.cpp takes the
target's. The tokenizer is the target's, copied from its GGUF, so the two vocabularies match.
q and k rows are permuted from the rotate-half layout training uses to llama.cpp's interleaved
RoPE pairs (`permute_rope`, its inverse `unpermute_rope`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.io import atomic_write
from edgespec.runtime.formats import DRAFT_IDS, Eagle3Config, head_arch, read_checkpoint

ARCH = "eagle3"
QUANTS = ("f16", "q8_0")


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """[n_head * D, in] rows in rotate-half order (i, i + D/2) -> interleaved (2i, 2i + 1)."""
    out, d_in = w.shape
    d = out // n_head
    return w.reshape(n_head, 2, d // 2, d_in).swapaxes(1, 2).reshape(out, d_in)


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    out, d_in = w.shape
    d = out // n_head
    return w.reshape(n_head, d // 2, 2, d_in).swapaxes(1, 2).reshape(out, d_in)


def gguf_tensors(c: Eagle3Config, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checkpoint weights (torch layout [out, in]) -> llama.cpp tensor names, float32."""
    f = {k: np.asarray(v, dtype=np.float32) for k, v in w.items()}
    t = {"fc.weight": f["fc.weight"],
         "blk.0.attn_norm.weight": f["attn_norm.weight"],
         "blk.0.attn_norm_2.weight": f["hidden_norm.weight"],
         "blk.0.attn_q.weight": permute_rope(f["q.weight"], c.n_head),
         "blk.0.attn_k.weight": permute_rope(f["k.weight"], c.n_head_kv),
         "blk.0.attn_v.weight": f["v.weight"],
         "blk.0.attn_output.weight": f["o.weight"],
         "blk.0.ffn_norm.weight": f["ffn_norm.weight"],
         "blk.0.ffn_gate.weight": f["gate.weight"],
         "blk.0.ffn_up.weight": f["up.weight"],
         "blk.0.ffn_down.weight": f["down.weight"],
         "output_norm.weight": f["out_norm.weight"],
         "output.weight": f["lm_head"]}
    if c.norm_before_fc:
        t["enc.output_norm.weight"] = f["enc_norm.weight"]
    return t


def _copy_tokenizer(writer, target_path: str) -> int:
    """Every `tokenizer.*` key of the target's GGUF, with its type."""
    from gguf import GGUFReader
    from gguf.constants import GGUFValueType as VT

    r = GGUFReader(target_path)
    n = 0
    for name, field in r.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = VT(int(field.types[0]))
        sub = VT(int(field.types[1])) if vtype == VT.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
        n += 1
    return n


def write_eagle3_gguf(ckpt: str | Path, out: str | Path, quant: str = "q8_0") -> dict:
    import gguf
    from gguf.constants import GGMLQuantizationType as Q
    from gguf.quants import quantize

    from edgespec.targets import KNOWN_TARGETS, load_target_spec

    if quant not in QUANTS:
        raise EdgespecError(f"unknown --quant {quant} for llama-cpp; choose from {', '.join(QUANTS)}")
    meta, weights = read_checkpoint(ckpt)
    if head_arch(meta["head"]) != "eagle3":
        raise EdgespecError(f"{ckpt} is not an EAGLE-3 head (train one with --arch eagle3); "
                            "edgespec's MTP heads export with `export gguf` or `export onnx`")
    c = Eagle3Config.from_dict(meta["head"])
    spec = load_target_spec(meta["target"] if meta["target"] in KNOWN_TARGETS else meta["target_path"])
    if spec.tokenizer_fingerprint != meta["target_fingerprint"]:
        raise EdgespecError(f"target {meta['target']} does not match the head's fingerprint")
    ids = weights.pop(DRAFT_IDS).astype(np.int64)
    if len(ids) != c.n_draft_vocab or len(set(ids.tolist())) != len(ids) or ids.min() < 0 \
            or ids.max() >= spec.n_vocab:
        raise EdgespecError(f"{ckpt}: its draft vocabulary is not {c.n_draft_vocab} distinct target ids")
    tensors = gguf_tensors(c, weights)
    qt = Q.F16 if quant == "f16" else Q.Q8_0
    out = Path(out)

    def write(tmp):
        w = gguf.GGUFWriter(tmp, ARCH)
        w.add_string("general.name", f"edgespec EAGLE-3 head for {meta['target']}")
        w.add_uint32(f"{ARCH}.context_length", c.context_length)
        w.add_uint32(f"{ARCH}.embedding_length", c.n_embd)
        w.add_uint32(f"{ARCH}.block_count", 1)
        w.add_uint32(f"{ARCH}.feed_forward_length", c.n_ff)
        w.add_uint32(f"{ARCH}.attention.head_count", c.n_head)
        w.add_uint32(f"{ARCH}.attention.head_count_kv", c.n_head_kv)
        w.add_uint32(f"{ARCH}.attention.key_length", c.head_dim)
        w.add_uint32(f"{ARCH}.attention.value_length", c.head_dim)
        w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", c.rms_eps)
        w.add_float32(f"{ARCH}.rope.freq_base", c.rope_base)
        w.add_uint32(f"{ARCH}.rope.dimension_count", c.head_dim)
        w.add_uint32(f"{ARCH}.vocab_size", spec.n_vocab)
        w.add_array(f"{ARCH}.target_layers", [int(i) for i in c.target_layers])
        w.add_uint32(f"{ARCH}.target_hidden_size", c.n_embd)
        w.add_bool(f"{ARCH}.norm_before_fc", bool(c.norm_before_fc))
        w.add_string("edgespec.target", meta["target"])
        w.add_string("edgespec.target_fingerprint", meta["target_fingerprint"])
        w.add_string("edgespec.head_config", json.dumps(c.to_dict()))
        _copy_tokenizer(w, spec.path)
        for name, a in tensors.items():
            if a.ndim == 2 and a.shape[1] % 32 == 0:
                w.add_tensor(name, quantize(a, qt), raw_dtype=qt)
            else:
                w.add_tensor(name, a)
        w.add_tensor("d2t", ids)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    atomic_write(out, write)
    return {"out": str(out), "arch": ARCH, "quant": quant, "bytes": out.stat().st_size,
            "target": meta["target"], "target_layers": list(c.target_layers),
            "draft_vocab": int(c.n_draft_vocab),
            "run": f"llama-server -m {spec.path} -md {out} --spec-type draft-eagle3"}
