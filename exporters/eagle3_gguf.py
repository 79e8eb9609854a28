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
from edgespec.runtime.formats import (DRAFT_IDS, EAGLE3_ARCH, EAGLE3_CONFIG, EAGLE3_FINGERPRINT,
                                      EAGLE3_TARGET, EAGLE3_TENSORS, Eagle3Config, head_arch,
                                      read_checkpoint, read_eagle3_file)

ARCH = EAGLE3_ARCH
QUANTS = ("f16", "q8_0")
# Target architectures whose graph in the pinned llama.cpp (llama-cpp-python 0.3.36) hands its
# layer inputs to a draft model, as draft-eagle3 needs (`llama_set_embeddings_layer_inp`), run
# here with an exported head; and those whose graph does not: llama.cpp aborts at the first
# decode ("layer input tensor is null", its gemma3 graph never records them).
RUNS_IN_LLAMA_CPP = ("llama",)
NOT_IN_LLAMA_CPP = ("gemma3",)


def permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """[n_head * D, in] rows in rotate-half order (i, i + D/2) -> interleaved (2i, 2i + 1)."""
    out, d_in = w.shape
    d = out // n_head
    return w.reshape(n_head, 2, d // 2, d_in).swapaxes(1, 2).reshape(out, d_in)


def gguf_tensors(c: Eagle3Config, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checkpoint weights (torch layout [out, in]) -> llama.cpp tensor names, float32."""
    f = {k: np.asarray(v, dtype=np.float32) for k, v in w.items()}
    f["q.weight"] = permute_rope(f["q.weight"], c.n_head)
    f["k.weight"] = permute_rope(f["k.weight"], c.n_head_kv)
    t = {name: f[ours] for name, ours in EAGLE3_TENSORS.items()
         if name != "enc.output_norm.weight" or c.norm_before_fc}
    return t


def copy_tokenizer(writer, target_path: str) -> int:
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


def finish_gguf(writer, tensors: dict[str, np.ndarray], qtype) -> None:
    """Add the tensors (2-D float ones whose rows split into blocks of 32 quantized to `qtype`,
    or to `qtype(name)` where it is a function, the rest as they are) and write the file out."""
    from gguf.quants import quantize

    for name, a in tensors.items():
        if a.ndim == 2 and a.shape[1] % 32 == 0 and a.dtype == np.float32:
            t = qtype(name) if callable(qtype) else qtype
            writer.add_tensor(name, quantize(a, t), raw_dtype=t)
        else:
            writer.add_tensor(name, a)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_eagle3_checkpoint(ckpt: str | Path, mtp_hint: str):
    """(meta, config, target spec, weights without the draft ids, draft ids) of an EAGLE-3
    checkpoint, its target and draft vocabulary checked; `mtp_hint`: what to say to one who
    passed an MTP head instead."""
    from edgespec.targets import KNOWN_TARGETS, load_target_spec

    meta, weights = read_checkpoint(ckpt)
    if head_arch(meta["head"]) != "eagle3":
        raise EdgespecError(f"{ckpt} is not an EAGLE-3 head (train one with --arch eagle3); {mtp_hint}")
    c = Eagle3Config.from_dict(meta["head"])
    spec = load_target_spec(meta["target"] if meta["target"] in KNOWN_TARGETS else meta["target_path"])
    if spec.tokenizer_fingerprint != meta["target_fingerprint"]:
        raise EdgespecError(f"target {meta['target']} does not match the head's fingerprint")
    ids = weights.pop(DRAFT_IDS).astype(np.int64)
    if len(ids) != c.n_draft_vocab or len(set(ids.tolist())) != len(ids) or ids.min() < 0 \
            or ids.max() >= spec.n_vocab:
        raise EdgespecError(f"{ckpt}: its draft vocabulary is not {c.n_draft_vocab} distinct target ids")
    return meta, c, spec, weights, ids


def write_eagle3_gguf(ckpt: str | Path, out: str | Path, quant: str = "q8_0",
                      any_target: bool = False) -> dict:
    """`any_target`: write the file even for a target llama.cpp cannot run it with (tests)."""
    import gguf
    from gguf.constants import GGMLQuantizationType as Q

    if quant not in QUANTS:
        raise EdgespecError(f"unknown --quant {quant} for llama-cpp; choose from {', '.join(QUANTS)}")
    meta, c, spec, weights, ids = read_eagle3_checkpoint(
        ckpt, "edgespec's MTP heads export with `export gguf` or `export onnx`")
    if spec.arch in NOT_IN_LLAMA_CPP and not any_target:
        raise EdgespecError(f"stock llama.cpp (llama-cpp-python {_llama_version()}) cannot run an "
                            f"EAGLE-3 head on a {spec.arch} target: its {spec.arch} graph does not "
                            "hand layer inputs to the draft (llama-server aborts at the first decode)")
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
        w.add_string(EAGLE3_TARGET, meta["target"])
        w.add_string(EAGLE3_FINGERPRINT, meta["target_fingerprint"])
        w.add_string(EAGLE3_CONFIG, json.dumps(c.to_dict()))
        copy_tokenizer(w, spec.path)
        finish_gguf(w, {**tensors, "d2t": ids}, qt)

    atomic_write(out, write)
    verified = "yes" if spec.arch in RUNS_IN_LLAMA_CPP else "not tried for this architecture"
    return {"out": str(out), "arch": ARCH, "quant": quant, "bytes": out.stat().st_size,
            "runs_in_stock_llama_cpp": verified,
            "target": meta["target"], "target_layers": list(c.target_layers),
            "draft_vocab": int(c.n_draft_vocab),
            "run": f"llama-server -m {spec.path} -md {out} --spec-type draft-eagle3"}


def _llama_version() -> str:
    try:
        import llama_cpp

        return llama_cpp.__version__
    except ImportError:
        return "?"


# -- reading it back -------------------------------------------------------------------------
def read_eagle3_gguf(path: str | Path):
    """An exported EAGLE-3 GGUF as a torch `Eagle3Head` with the file's (dequantized) weights:
    what llama.cpp computes, up to its kernels' rounding. Returns (head, draft ids, HeadFile)."""
    import torch

    from edgespec.training.eagle3 import Eagle3Head

    info = read_eagle3_file(path)
    head = Eagle3Head(info.config)
    head.load_state_dict({k: torch.from_numpy(v) for k, v in info.weights.items()})
    return head.eval(), info.draft_ids, info


def heldout_features(head, meta: dict, features: str | Path, max_samples: int):
    """(features, up to max_samples held-out sample indices, the target's embedding rows) for
    checking an EAGLE-3 head's export: features of the head's target and layers only."""
    from edgespec.targets import embedding_rows
    from edgespec.training.features import Features
    from edgespec.training.train import checkpoint_target, split_samples

    feats = Features(features)
    if feats.fingerprint != meta["target_fingerprint"]:
        raise EdgespecError(f"{features} holds features of another target than the head's")
    if tuple(feats.layers) != tuple(head.c.target_layers):
        raise EdgespecError(f"{features} holds features of layers {list(feats.layers)}; this head "
                            f"reads layers {head.c.target_layers} (extract with --layers)")
    idx = split_samples(feats)[1][:max_samples]
    if not idx:
        raise EdgespecError(f"{features}: no held-out samples to check against")
    return feats, idx, embedding_rows(checkpoint_target(meta))


def check_eagle3_export(ckpt: str | Path, exported: str | Path, features: str | Path,
                        n_steps: int = 3, max_samples: int = 24) -> dict:
    """The exported file's head (its quantized weights, read back) beside the trained head on
    held-out features: top-1 agreement per draft step, max logit error, both acceptances."""
    import torch

    from edgespec.training.train import eval_head, load_checkpoint

    head, meta = load_checkpoint(ckpt)
    ex, ids, info = read_eagle3_gguf(exported)
    if info.fingerprint != meta["target_fingerprint"]:
        raise EdgespecError(f"{exported} is not an export of {ckpt} (target fingerprints differ)")
    feats, idx, embed = heldout_features(head, meta, features, max_samples)
    agree, total, err = [0] * n_steps, 0, 0.0
    with torch.no_grad():
        for i in idx:
            toks = feats.tokens[i].astype(np.int64)
            hid = torch.from_numpy(feats.hidden(i))
            T = len(toks) - n_steps - 1
            if T < 1:
                continue
            emb = torch.from_numpy(embed[toks])[None, 1:]
            a = head.forward_chain(emb, hid[None, :T], n_steps)
            b = ex.forward_chain(emb, hid[None, :T], n_steps)
            for j in range(n_steps):
                la, lb = head.logits(a[j][0]), ex.logits(b[j][0])
                agree[j] += int((la.argmax(-1) == lb.argmax(-1)).sum())
                err = max(err, float((la - lb).abs().max()))
            total += T
    return {"exported": str(exported), "bytes": Path(exported).stat().st_size,
            "top1_agreement_by_step": [round(x / max(total, 1), 4) for x in agree],
            "max_logit_error": round(err, 4), "compared": total,
            "acceptance_trained": eval_head(ckpt, feats, max_chain=n_steps)["acceptance_by_position"]}
