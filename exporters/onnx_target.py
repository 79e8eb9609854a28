"""The target itself to ONNX with an explicit KV cache, for devices that run onnxruntime only.

    edgespec export onnx-target gemma3-270m --out DIR [--quant int8|int4|fp32]
        [--lm-head lowrank|full] [--rank 256] [--candidates 64]

The graph is one decode call of the target (Gemma 3 or llama architecture), written here from
the weights transformers loads out of the same GGUF file:
  inputs   inputs_embeds [T, E] (token embedding rows, already scaled, see below), position
           (int64 scalar: position of the first of the T tokens), n_logits (int64 scalar: logits
           for the last n_logits positions only, so a prompt prefill skips the 262k-wide LM
           head), [n_candidates (same, for the candidates)], past_key_values.{i}.key/value
           [1, kv_heads, past, head_dim]
  outputs  logits [n_logits, vocab], hidden [T, E] (final hidden states after the output norm:
           what the draft head reads), [candidates [n_candidates, C] int64], present.{i}.key/value
Sliding-window layers mask keys older than the window, as the target does. The token embedding
lookup stays outside the graph: the runtime reads the rows from the GGUF file it tokenizes with
(same values llama.cpp uses), so the ONNX file does not carry a second 262k x E table.

The low-rank LM head (default). Gemma's LM head is 262,144 x 640: more than half the work of
every position, and the reason checking k drafted tokens costs nearly k decodes. Greedy decoding
only needs each position's top token, so the graph also computes rank-r scores (W U)(U^T h),
U the top principal directions of the target's own hidden states on calibration text, and
returns the C best-scoring token ids; the runtime then computes those C logits exactly from the
GGUF file's own LM-head rows and takes the best (`OrtTarget.decode(top_only=True)`). Where the
true top token is not among the C candidates the result differs from the target's: the check
measures how often that happens against the exact logits. Sampling, and any caller that wants
every logit, gets the full LM head, which stays in the graph.

DIR receives `model.onnx` (+ `model.onnx.data`) and `edgespec-target.json` (target, fingerprint,
shapes). int8 and int4 are weight-only MatMulNBits (block 32, symmetric, like llama.cpp's Q8_0 /
Q4_0, accuracy level 4: int8 dot products on CPU). Dynamic int8 quantization (activations
quantized per tensor) was tried first and lost greedy agreement with llama.cpp within a few
tokens (mean matching prefix 3.2 of 32), so it is not used for the target's layers; only the
low-rank scores use it (they only pick candidates). With --check (default) the export is run
beside llama.cpp on held-out prompts and the greedy continuations are compared.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.exporters.onnx_head import cache_io_names, cached_attention, quiet_quantizers, trace_to_onnx
from edgespec.io import atomic_write_text
from edgespec.runtime.formats import (ONNX_FINGERPRINT, ONNX_FORMAT, ONNX_QUANT, ONNX_TARGET,
                                      ONNX_TARGET_FORMAT, TARGET_META)

QUANTS = ("fp32", "int8", "int4")
LM_HEADS = ("lowrank", "full")


def _graph_module(model, spec, lowrank=None):
    import torch
    from torch import nn

    from edgespec.exporters.onnx_head import attention_mask
    from edgespec.training.head import apply_rope, rope_tables

    cfg = model.config
    gemma = spec.arch == "gemma3"
    nh, nkv, hd = spec.n_head, spec.n_head_kv, spec.head_dim
    scale = (getattr(cfg, "query_pre_attn_scalar", None) or hd) ** -0.5
    sliding = [t == "sliding" for t in spec.layer_types]
    bases = [(spec.rope_base_local or spec.rope_base_global) if s else spec.rope_base_global
             for s in sliding]
    window = spec.sliding_window or 0

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = model.model.layers
            self.norm = model.model.norm
            self.lm_head = model.lm_head
            if lowrank:
                self.basis = nn.Parameter(lowrank["basis"], requires_grad=False)  # [E, r]
                self.scores = nn.Parameter(lowrank["scores"], requires_grad=False)  # [r, V]
                self.n_cand = lowrank["candidates"]

        def forward(self, inputs_embeds, position, n_logits, *rest):
            n_cand, past = (rest[0], rest[1:]) if lowrank else (None, rest)
            t = inputs_embeds.shape[0]
            x = inputs_embeds[None]
            qpos = (position + torch.arange(t, dtype=torch.int64))[None]
            # RoPE tables and masks once per layer kind, not once per layer: every sliding
            # layer's cache has the same length, and so has every global layer's
            tables = {b: rope_tables(qpos, hd, b) for b in set(bases)}
            masks = {}
            presents = []
            for i, layer in enumerate(self.layers):
                a = layer.self_attn
                h = layer.input_layernorm(x)
                q = a.q_proj(h).view(1, t, nh, hd)
                k = a.k_proj(h).view(1, t, nkv, hd)
                v = a.v_proj(h).view(1, t, nkv, hd)
                if gemma:
                    q, k = a.q_norm(q), a.k_norm(k)
                q, k = apply_rope(q, *tables[bases[i]]), apply_rope(k, *tables[bases[i]])
                if sliding[i] not in masks:
                    masks[sliding[i]] = attention_mask(position, t, past[2 * i].shape[2] + t,
                                                       window if sliding[i] else 0)
                o, kk, vv = cached_attention(q, k, v, past[2 * i], past[2 * i + 1], position,
                                             scale, mask=masks[sliding[i]])
                presents += [kk, vv]
                o = a.o_proj(o)
                if gemma:
                    x = x + layer.post_attention_layernorm(o)
                    x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
                else:
                    x = x + o
                    x = x + layer.mlp(layer.post_attention_layernorm(x))
            hidden = self.norm(x)[0]
            logits = self.lm_head(hidden[t - n_logits:])
            if not lowrank:
                return (logits, hidden, *presents)
            approx = (hidden[t - n_cand:] @ self.basis) @ self.scores
            cand = torch.topk(approx, self.n_cand, dim=-1, sorted=False).indices
            return (logits, hidden, cand, *presents)

    return Step().eval()


def io_names(n_layer: int, lowrank: bool = False) -> tuple[list[str], list[str]]:
    if lowrank:
        return cache_io_names(["inputs_embeds", "position", "n_logits", "n_candidates"],
                              ["logits", "hidden", "candidates"], n_layer)
    return cache_io_names(["inputs_embeds", "position", "n_logits"], ["logits", "hidden"], n_layer)


def export_graph(model, spec, path: Path, lowrank=None) -> None:
    """Trace the decode graph of a transformers causal LM (fp32) into `path`."""
    import torch

    step = _graph_module(model, spec, lowrank)
    ins, outs = io_names(spec.n_layer, bool(lowrank))
    T, P = 3, 5  # example sizes >= 2 on every dynamic axis
    counts = [torch.tensor(2, dtype=torch.int64)] * (2 if lowrank else 1)
    args = (torch.randn(T, spec.n_embd), torch.tensor(P, dtype=torch.int64), *counts,
            *[torch.randn(1, spec.n_head_kv, P, spec.head_dim) for _ in range(2 * spec.n_layer)])
    axes = {"inputs_embeds": {0: "seq"}, "hidden": {0: "seq"}, "logits": {0: "n_logits"},
            "candidates": {0: "n_candidates"}}
    trace_to_onnx(step, args, ins, outs, axes, path)


def lowrank_scores(model, spec, rank: int, n_tokens: int = 32768, log=print) -> dict:
    """A rank-r stand-in for the LM head that finds the candidates for the top logit.

    Logits are W h (W: [V, E]). With U the top-r principal directions of the target's own final
    hidden states, W h ~ (W U)(U^T h): r x V multiply-adds instead of E x V. Calibration text:
    the training side of the stdlib passages (never the bench prompts), the first 128 tokens of
    each (so that many passage starts are in), n_tokens in all."""
    import numpy as np
    import torch

    from edgespec.training.data import stdlib_passages
    from edgespec.runtime.llama_target import VocabOnly
    from edgespec.training.torch_target import forward_hidden

    tok = VocabOnly(spec)  # llama.cpp's tokenizer of the same file
    passages = stdlib_passages("train")
    step = max(1, len(passages) // max(1, n_tokens // 100))
    cov, seen = torch.zeros(spec.n_embd, spec.n_embd, dtype=torch.float64), 0
    try:
        for p in passages[::step]:
            ids = tok.tokenize(p["text"])[:128]
            _, h = forward_hidden(model, torch.tensor([ids]))
            h = h[0].double()
            cov += h.T @ h
            seen += len(ids)
            if seen >= n_tokens:
                break
    finally:
        tok.close()
    log(f"low-rank LM head: rank {rank} from {seen} calibration tokens")
    _, vecs = np.linalg.eigh(cov.numpy())
    basis = torch.from_numpy(np.ascontiguousarray(vecs[:, ::-1][:, :rank])).float()  # [E, r]
    with torch.no_grad():
        scores = (model.lm_head.weight.float() @ basis).T.contiguous()  # [r, V]
    return {"basis": basis, "scores": scores}


def _lowrank_matmuls(model) -> tuple[list[str], list[str]]:
    """(basis projection, scores) MatMul nodes of the low-rank LM head, by their weights' names
    (the Step module's parameters; shapes can collide: rank 256 = Gemma's K/V width)."""
    mm = [n for n in model.graph.node if n.op_type == "MatMul"]
    return ([n.name for n in mm if n.input[1] == "basis"], [n.name for n in mm if n.input[1] == "scores"])


def _quantize(m, quant: str, lowrank: bool, work: Path, log):
    """Weight-only MatMulNBits for the target's layers and its full LM head (int8: 8 bits, int4:
    4 bits). The low-rank head's small basis projection stays fp32 (the hidden states it reads
    have a few channels far larger than the rest, which a shared activation scale would crush),
    and its [rank, vocab] scores get dynamic int8 quantization, one scale per tensor
    (onnxruntime's integer GEMM, whose cost grows slowly with the number of rows, unlike 8-bit
    MatMulNBits; only the candidates come from it, their logits are recomputed exactly)."""
    import onnx

    from edgespec.exporters.onnx_head import nbits_quantize

    basis, scores = _lowrank_matmuls(m) if lowrank else ([], [])
    if lowrank and not (len(basis) == len(scores) == 1):
        raise EdgespecError("internal: the low-rank LM head's MatMul nodes were not found")
    log(f"{quant}: MatMulNBits quantization (block 32, symmetric) ...")
    m = nbits_quantize(m, 8 if quant == "int8" else 4, exclude=basis + scores)
    if not scores:
        return m
    from onnxruntime.quantization import QuantType, quantize_dynamic

    src, dst = work / "nbits.onnx", work / "dyn.onnx"
    onnx.save(m, str(src), save_as_external_data=True, location="nbits.onnx.data")
    del m
    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=False,
                     nodes_to_quantize=scores, use_external_data_format=True)
    return onnx.load(str(dst))


def export_onnx_target(target: str, out_dir: str | Path, quant: str = "int8", check: bool = True,
                       log=print, lm_head: str = "lowrank", rank: int = 256,
                       candidates: int = 64) -> dict:
    import time

    import onnx

    from edgespec.targets import load_target_spec
    from edgespec.training.torch_target import load_torch_target

    if quant not in QUANTS:
        raise EdgespecError(f"unknown --quant {quant} for an ONNX target; choose from {', '.join(QUANTS)}")
    if lm_head not in LM_HEADS:
        raise EdgespecError(f"unknown --lm-head {lm_head}; choose from {', '.join(LM_HEADS)}")
    spec = load_target_spec(target)
    if lm_head == "lowrank" and not (0 < rank < spec.n_embd and rank % 32 == 0 and 0 < candidates <= 1024):
        raise EdgespecError(f"--rank must be a multiple of 32 below {spec.n_embd} and --candidates "
                            f"1..1024 (got {rank}, {candidates})")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / TARGET_META).exists():
        raise EdgespecError(f"{out_dir} exists and is not an edgespec ONNX target folder")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EdgespecError(f"cannot write {out_dir}: {e.strerror}") from None
    t0 = time.time()
    model = load_torch_target(target)
    work = Path(tempfile.mkdtemp(prefix=".onnx-target-", dir=out_dir.parent))
    try:
        raw = work / "raw" / "model.onnx"
        raw.parent.mkdir()
        lowrank = None
        if lm_head == "lowrank":
            lowrank = lowrank_scores(model, spec, rank, log=log)
            lowrank["candidates"] = candidates
        log(f"exporting {spec.name} ({spec.n_layer} layers) to ONNX ...")
        export_graph(model, spec, raw, lowrank)
        del model, lowrank
        final = work / "final"
        final.mkdir()
        with quiet_quantizers():
            m = onnx.load(str(raw))
            if quant != "fp32":
                m = _quantize(m, quant, lm_head == "lowrank", work, log)
        del m.metadata_props[:]
        for k, v in {ONNX_FORMAT: ONNX_TARGET_FORMAT, ONNX_TARGET: spec.name,
                     ONNX_FINGERPRINT: spec.tokenizer_fingerprint, ONNX_QUANT: quant}.items():
            m.metadata_props.add(key=k, value=v)
        for f in final.iterdir():
            f.unlink()
        onnx.save(m, str(final / "model.onnx"), save_as_external_data=True,
                  location="model.onnx.data", size_threshold=1024)
        del m
        onnx.checker.check_model(str(final / "model.onnx"))
        meta = {"format": ONNX_TARGET_FORMAT, "target": spec.name, "target_path": str(spec.path),
                "target_fingerprint": spec.tokenizer_fingerprint, "quant": quant,
                "n_layer": spec.n_layer, "n_embd": spec.n_embd, "n_head_kv": spec.n_head_kv,
                "head_dim": spec.head_dim, "n_vocab": spec.n_vocab, "embed_scale": spec.embed_scale,
                "sliding_window": spec.sliding_window, "layer_types": spec.layer_types,
                "lm_head": {"kind": "full"}}
        if lm_head == "lowrank":
            from edgespec.gguf_meta import read_header

            tensors = read_header(spec.path).tensors
            meta["lm_head"] = {"kind": "lowrank", "rank": rank, "candidates": candidates,
                               "rescore": "output.weight" if "output.weight" in tensors
                               else "token_embd.weight"}
        atomic_write_text(final / TARGET_META, json.dumps(meta, indent=1) + "\n")
        # swap the finished folder in: a failed export never leaves a half-written one
        if out_dir.exists():
            old = work / "old"
            out_dir.rename(old)
        final.rename(out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"out": str(out_dir), "quant": quant, "lm_head": lm_head, "export_s": round(time.time() - t0, 1),
              "bytes": sum(f.stat().st_size for f in out_dir.iterdir())}
    if check:
        report["check"] = check_onnx_target(out_dir, spec.name)
    return report


def _exact_argmax(rows, hidden, chunk: int = 32768):
    """Argmax over every row of the target's stored LM head (dequantized, fp32 products)."""
    import numpy as np

    best = np.full(len(hidden), -np.inf, np.float32)
    arg = np.zeros(len(hidden), np.int64)
    for c in range(0, rows.n_rows, chunk):
        lg = hidden @ rows[slice(c, min(c + chunk, rows.n_rows))].T
        i = lg.argmax(1)
        v = lg[np.arange(len(hidden)), i]
        better = v > best
        best[better], arg[better] = v[better], c + i[better]
    return arg


def _lowrank_agreement(eng, prompts: list[str], continuations: list[list[int]]) -> dict:
    """The candidate search against every logit, on prompt + continuation, 8 positions a pass
    after a fresh prefill of what comes before: each pass runs with the full LM head, is rolled
    back and runs again top-only."""
    import numpy as np

    full_top, lr_top, hidden = [], [], []
    for p, cont in zip(prompts, continuations):
        ids = eng.tokenize(p) + cont
        for s in range(0, len(ids) - 8, 8):
            eng.reset()
            eng.prefill(ids[:s])
            full, h = eng.decode(ids[s:s + 8], hidden=True)
            full_top.append(full.argmax(1))
            hidden.append(h.copy())
            eng.truncate(s)
            top, _ = eng.decode(ids[s:s + 8], top_only=True)
            lr_top.append(top.argmax(1))
    exact = _exact_argmax(eng.top.rows, np.concatenate(hidden))
    full_top, lr_top = np.concatenate(full_top), np.concatenate(lr_top)
    return {"positions": len(exact),
            "lowrank_top1_agreement_with_exact": round(float((lr_top == exact).mean()), 4),
            "full_head_top1_agreement_with_exact": round(float((full_top == exact).mean()), 4),
            "lowrank_top1_agreement_with_full_head": round(float((lr_top == full_top).mean()), 4)}


def check_onnx_target(folder: str | Path, target: str, n_prompts: int = 4, max_tokens: int = 32) -> dict:
    """Greedy continuations of held-out prompts on the ONNX target and on llama.cpp: the share
    of prompts whose continuation is identical and the mean matching prefix, plus decode speed
    and the cost of checking k = 1..8 tokens in one decode on each engine (median ms).
    With the low-rank LM head, also how often its top token (and the full ONNX LM head's) is the
    top token of the exact logits (the target's stored LM head in fp32), position by position."""
    from edgespec.prompts import DEFAULT_PROMPTS, read_prompts
    from edgespec.runtime.decoding import Generation
    from edgespec.runtime.llama_target import LlamaTarget
    from edgespec.runtime.ort_target import OrtTarget
    from edgespec.runtime.policies import FixedK, verify_cost_curve
    from edgespec.runtime.sampling import SamplingParams

    prompts = [p["prompt"] for p in read_prompts(DEFAULT_PROMPTS)][::6][:n_prompts]  # every kind
    res, extra = {}, {}
    for name, make in (("llama.cpp", lambda: LlamaTarget(target, n_ctx=1024, lm_head="full")),
                       ("onnxruntime", lambda: OrtTarget(folder, n_ctx=1024))):
        eng = make()
        outs, secs, toks = [], 0.0, 0
        for p in prompts:
            eng.reset()
            g = Generation(eng, eng.tokenize(p), SamplingParams(), max_tokens=max_tokens,
                           drafter=None, policy=FixedK(0))
            for _ in g:
                pass
            secs += g.stats.decode_s
            toks += g.stats.tokens
            outs.append(g.token_ids)
        res[name] = (outs, toks / max(secs, 1e-9), verify_cost_curve(eng, 8))
        if name == "onnxruntime" and eng.lowrank:  # llama.cpp's continuations are in by now
            extra = _lowrank_agreement(eng, prompts, res["llama.cpp"][0])
        eng.close()
    a, b = res["llama.cpp"][0], res["onnxruntime"][0]
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    return {"prompts": len(a), "max_tokens": max_tokens,
            "same_continuation_share": round(sum(x == y for x, y in zip(a, b)) / len(a), 3),
            "mean_matching_prefix": round(sum(prefix) / len(prefix), 1),
            "tokens_per_s_llama_cpp": round(res["llama.cpp"][1], 1),
            "tokens_per_s_onnxruntime": round(res["onnxruntime"][1], 1),
            "verify_ms_llama_cpp": res["llama.cpp"][2], "verify_ms_onnxruntime": res["onnxruntime"][2],
            **extra}
