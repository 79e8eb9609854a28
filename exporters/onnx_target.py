"""The target itself to ONNX with an explicit KV cache, for devices that run onnxruntime only.

    edgespec export onnx-target gemma3-270m --out DIR [--quant int8|int4|fp32]

The graph is one decode call of the target (Gemma 3 or llama architecture), written here from
the weights transformers loads out of the same GGUF file:
  inputs   inputs_embeds [T, E] (token embedding rows, already scaled, see below), position
           (int64 scalar: position of the first of the T tokens), n_logits (int64 scalar: logits
           for the last n_logits positions only, so a prompt prefill skips the 262k-wide LM
           head), past_key_values.{i}.key/value [1, kv_heads, past, head_dim]
  outputs  logits [n_logits, vocab], hidden [T, E] (final hidden states after the output norm:
           what the draft head reads), present.{i}.key/value
Sliding-window layers mask keys older than the window, as the target does. The token embedding
lookup stays outside the graph: the runtime reads the rows from the GGUF file it tokenizes with
(same values llama.cpp uses), so the ONNX file does not carry a second 262k x E table.

DIR receives `model.onnx` (+ `model.onnx.data`) and `edgespec-target.json` (target, fingerprint,
shapes). int8 and int4 are weight-only MatMulNBits (block 32, symmetric, like llama.cpp's Q8_0 /
Q4_0, accuracy level 4: int8 dot products on CPU). Dynamic int8 quantization (activations
quantized per tensor) was tried first and lost greedy agreement with llama.cpp within a few
tokens (mean matching prefix 3.2 of 32), so it is not used for the target. With --check (default) the export is run beside
llama.cpp on held-out prompts and the greedy continuations are compared.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.exporters.onnx_head import cache_io_names, cached_attention, quiet_quantizers, trace_to_onnx
from edgespec.io import atomic_write_text

QUANTS = ("fp32", "int8", "int4")
META_NAME = "edgespec-target.json"


def _graph_module(model, spec):
    import torch
    from torch import nn

    from edgespec.head import rope

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

        def forward(self, inputs_embeds, position, n_logits, *past):
            t = inputs_embeds.shape[0]
            x = inputs_embeds[None]
            qpos = position + torch.arange(t, dtype=torch.int64)
            presents = []
            for i, layer in enumerate(self.layers):
                a = layer.self_attn
                h = layer.input_layernorm(x)
                q = a.q_proj(h).view(1, t, nh, hd)
                k = a.k_proj(h).view(1, t, nkv, hd)
                v = a.v_proj(h).view(1, t, nkv, hd)
                if gemma:
                    q, k = a.q_norm(q), a.k_norm(k)
                q, k = rope(q, qpos[None], bases[i]), rope(k, qpos[None], bases[i])
                o, kk, vv = cached_attention(q, k, v, past[2 * i], past[2 * i + 1], position,
                                             scale, window if sliding[i] else 0)
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
            return (logits, hidden, *presents)

    return Step().eval()


def io_names(n_layer: int) -> tuple[list[str], list[str]]:
    return cache_io_names(["inputs_embeds", "position", "n_logits"], ["logits", "hidden"], n_layer)


def export_graph(model, spec, path: Path) -> None:
    """Trace the decode graph of a transformers causal LM (fp32) into `path`."""
    import torch

    step = _graph_module(model, spec)
    ins, outs = io_names(spec.n_layer)
    T, P = 3, 5  # example sizes >= 2 on every dynamic axis
    args = (torch.randn(T, spec.n_embd), torch.tensor(P, dtype=torch.int64),
            torch.tensor(2, dtype=torch.int64),
            *[torch.randn(1, spec.n_head_kv, P, spec.head_dim) for _ in range(2 * spec.n_layer)])
    axes = {"inputs_embeds": {0: "seq"}, "hidden": {0: "seq"}, "logits": {0: "n_logits"}}
    trace_to_onnx(step, args, ins, outs, axes, path)


def export_onnx_target(target: str, out_dir: str | Path, quant: str = "int8", check: bool = True,
                       log=print) -> dict:
    import time

    import onnx

    from edgespec.targets import load_target_spec
    from edgespec.torch_target import load_torch_target

    if quant not in QUANTS:
        raise EdgespecError(f"unknown --quant {quant} for an ONNX target; choose from {', '.join(QUANTS)}")
    spec = load_target_spec(target)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / META_NAME).exists():
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
        log(f"exporting {spec.name} ({spec.n_layer} layers) to ONNX ...")
        export_graph(model, spec, raw)
        del model
        final = work / "final"
        final.mkdir()
        with quiet_quantizers():
            m = onnx.load(str(raw))
            if quant != "fp32":
                from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

                bits = 8 if quant == "int8" else 4
                log(f"{quant}: MatMulNBits quantization (block 32, symmetric) ...")
                qz = MatMulNBitsQuantizer(m, bits=bits, block_size=32, is_symmetric=True,
                                          accuracy_level=4)
                qz.process()
                m = qz.model.model
        del m.metadata_props[:]
        for k, v in {"edgespec.format": "edgespec-target-onnx", "edgespec.target": spec.name,
                     "edgespec.target_fingerprint": spec.tokenizer_fingerprint,
                     "edgespec.quant": quant}.items():
            m.metadata_props.add(key=k, value=v)
        for f in final.iterdir():
            f.unlink()
        onnx.save(m, str(final / "model.onnx"), save_as_external_data=True,
                  location="model.onnx.data", size_threshold=1024)
        del m
        onnx.checker.check_model(str(final / "model.onnx"))
        meta = {"format": "edgespec-target-onnx", "target": spec.name, "target_path": str(spec.path),
                "target_fingerprint": spec.tokenizer_fingerprint, "quant": quant,
                "n_layer": spec.n_layer, "n_embd": spec.n_embd, "n_head_kv": spec.n_head_kv,
                "head_dim": spec.head_dim, "n_vocab": spec.n_vocab, "embed_scale": spec.embed_scale,
                "sliding_window": spec.sliding_window, "layer_types": spec.layer_types}
        atomic_write_text(final / META_NAME, json.dumps(meta, indent=1) + "\n")
        # swap the finished folder in: a failed export never leaves a half-written one
        if out_dir.exists():
            old = work / "old"
            out_dir.rename(old)
        final.rename(out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"out": str(out_dir), "quant": quant, "export_s": round(time.time() - t0, 1),
              "bytes": sum(f.stat().st_size for f in out_dir.iterdir())}
    if check:
        report["check"] = check_onnx_target(out_dir, spec.name)
    return report


def check_onnx_target(folder: str | Path, target: str, n_prompts: int = 4, max_tokens: int = 32) -> dict:
    """Greedy continuations of held-out prompts on the ONNX target and on llama.cpp: the share
    of prompts whose continuation is identical and the mean matching prefix, plus decode speed."""
    from edgespec.bench import DEFAULT_PROMPTS, read_prompts
    from edgespec.runtime.decoding import Generation
    from edgespec.runtime.llama_target import LlamaTarget
    from edgespec.runtime.ort_target import OrtTarget
    from edgespec.runtime.policies import FixedK
    from edgespec.runtime.sampling import SamplingParams

    prompts = [p["prompt"] for p in read_prompts(DEFAULT_PROMPTS)][:n_prompts]
    res = {}
    for name, make in (("llama.cpp", lambda: LlamaTarget(target, n_ctx=1024)),
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
        res[name] = (outs, toks / max(secs, 1e-9))
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
            "tokens_per_s_onnxruntime": round(res["onnxruntime"][1], 1)}
