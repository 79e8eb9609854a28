"""Draft heads to ONNX: one draft step as a graph with an explicit KV cache.

    edgespec export onnx runs/gemma/head --quant int8 --out head.onnx [--check --features DIR]

Graph inputs: `tok_emb` [T, E] (unscaled target embedding rows of the tokens read), `hidden`
[T, E] (target hidden states, or the head's own output for a draft step), `position` (int64
scalar, the position of the first of the T pairs) and `past_key_values.{i}.key/value`
[1, kv_heads, past, head_dim] holding positions position-past .. position-1. Outputs: `logits`
[1, draft_vocab] for the last pair, `hidden_out` [T, E] and `present.{i}.key/value` (past + T).
T and past are dynamic. The head config, the draft vocabulary and the target fingerprint are in
the model's metadata, so the file alone runs next to its target (no torch needed to run it).

A shared-KV head has no cache of its own: its inputs are `tok_emb`, `hidden`, `position` (where
every row sits) and `kv.{i}.key/value` [S_i, kv_heads, head_dim], the target's keys and values
that head layer i attends (a sliding layer's cut to its window by the runtime); outputs
`logits` [T, draft_vocab] and `hidden_out` [T, E].

Quantization: int8 with onnxruntime's dynamic quantization (per-channel weights), int4 with
MatMulNBits (block 32, symmetric, accuracy level 4 so the CPU kernel runs int8 dot products); in
both the input projection and the LM head stay in 8 bits (see `_quantize`).
"""

from __future__ import annotations

import json
import logging
import tempfile
from contextlib import contextmanager
import warnings
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.io import atomic_write
from edgespec.runtime.formats import (ONNX_DRAFT_VOCAB, ONNX_FINGERPRINT, ONNX_FORMAT,
                                      ONNX_HEAD_CONFIG, ONNX_HEAD_FORMAT, ONNX_QUANT, ONNX_TARGET,
                                      cache_names, head_arch, require_mtp_head)

QUANTS = ("fp32", "int8", "int4")
OPSET = 17


def attention_mask(position, t: int, n, window: int = 0):
    """[T, N] bool: which of N cached + new keys each of the T queries at position.. may see."""
    import torch

    qpos = position + torch.arange(t, dtype=torch.int64)
    kpos = position + t - n + torch.arange(n, dtype=torch.int64)
    mask = kpos[None, :] <= qpos[:, None]
    if window:
        mask = mask & (kpos[None, :] > qpos[:, None] - window)
    return mask


def cached_attention(q, k, v, past_k, past_v, position, scale: float, window: int = 0, mask=None):
    """One attention call of a decode graph with an explicit KV cache.

    q [1, T, H, D] and k/v [1, T, Hkv, D] (normed, rotated) for positions position..position+T-1;
    past_k/v [1, Hkv, P, D] hold the P positions just before (a cache trimmed at the front is
    fine: key positions follow from its length). window > 0 masks keys older than the window;
    `mask` (from attention_mask) may be given instead, shared by layers with equal caches.
    Query heads are grouped by their KV head ([1, Hkv, rep * T, D]) so the cache is never
    repeated. Returns (attention output [1, T, H*D], present key, present value)."""
    import torch

    t, nh, d = q.shape[1], q.shape[2], q.shape[3]
    kk = torch.cat([past_k, k.transpose(1, 2)], 2)
    vv = torch.cat([past_v, v.transpose(1, 2)], 2)
    n, nkv = kk.shape[2], kk.shape[1]
    if mask is None:
        mask = attention_mask(position, t, n, window)
    qg = q.transpose(1, 2).reshape(1, nkv, (nh // nkv) * t, d)  # heads g*rep .. g*rep+rep-1
    s = torch.matmul(qg, kk.transpose(2, 3)).reshape(1, nh, t, n) * scale
    s = s.masked_fill(~mask[None, None], float("-inf"))
    p = torch.softmax(s, -1).reshape(1, nkv, (nh // nkv) * t, n)
    a = torch.matmul(p, vv).reshape(1, nh, t, d)
    return a.transpose(1, 2).reshape(1, t, nh * d), kk, vv


def trace_to_onnx(module, args, ins: list[str], outs: list[str], axes: dict, path) -> None:
    """Trace with the TorchScript exporter (dynamo=False: plain dynamic_axes, flat tensors in
    and out). Cache inputs get a dynamic `past` axis and presents a dynamic `total` axis."""
    import torch

    axes = dict(axes)
    for n in ins:
        if n.startswith("past_key_values."):
            axes[n] = {2: "past"}
    for n in outs:
        if n.startswith("present."):
            axes[n] = {2: "total"}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notices
        torch.onnx.export(module, args, str(path), dynamo=False, input_names=ins,
                          output_names=outs, dynamic_axes=axes, opset_version=OPSET)


def cache_io_names(first_in: list[str], first_out: list[str], n_layer: int) -> tuple[list[str], list[str]]:
    past, present = cache_names(n_layer)
    return [*first_in, *past], [*first_out, *present]


def _graph_module(head):
    import torch
    from torch import nn

    c = head.c

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = head

        def forward(self, tok_emb, hidden, position, *past):
            h = self.head
            t = tok_emb.shape[0]
            x = h.inputs(tok_emb[None], hidden[None])  # [1, T, E]
            qpos = position + torch.arange(t, dtype=torch.int64)
            presents = []
            for i, blk in enumerate(h.blocks):
                q, k, v = blk.qkv(x, qpos[None])  # q [1, T, H, D], k/v [1, T, Hkv, D]
                a, kk, vv = cached_attention(q, k, v, past[2 * i], past[2 * i + 1], position,
                                             blk.scale, c.sliding_window if blk.sliding else 0)
                presents += [kk, vv]
                x = blk.finish(x, a)
            out = h.out_norm(x)[0]
            logits = out[-1:] @ h.lm_head.T
            return (logits, out, *presents)

    return Step().eval()


@contextmanager
def quiet_quantizers():
    """onnxruntime's quantizers log advice and per-node progress on the root logger and their own."""
    # importing this module calls logging.basicConfig(level=INFO): do it before the levels are set
    import onnxruntime.quantization.matmul_nbits_quantizer  # noqa: F401

    names = ["", "onnxruntime.quantization", "onnxruntime.quantization.matmul_nbits_quantizer"]
    levels = [logging.getLogger(n).level for n in names]
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, lv in zip(names, levels):
            logging.getLogger(n).setLevel(lv)


def _projection_matmuls(model, c) -> list[str]:
    """The input projection ([2E, d] weight; d = E but in a shared-KV head) and the LM head
    ([E, draft vocab]) MatMul nodes."""
    shapes = {i.name: tuple(i.dims) for i in model.graph.initializer}
    wanted = {(2 * c.n_embd, getattr(c, "d_model", c.n_embd)), (c.n_embd, c.n_draft_vocab)}
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and shapes.get(n.input[1]) in wanted]


def nbits_quantize(model, bits: int, exclude=()):
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    qz = MatMulNBitsQuantizer(model, bits=bits, block_size=32, is_symmetric=True, accuracy_level=4,
                              nodes_to_exclude=list(exclude))
    qz.process()
    return qz.model.model


def _quantize(model, raw: Path, work: Path, quant: str, c):
    """fp32 graph -> int8 or int4 graph. The input projection and the LM head are the layers whose
    rounding moves the drafts most (`--check` measures the agreement), so both quants keep them
    as 8-bit MatMulNBits: int8
    quantizes the rest with dynamic quantization (per-channel weights), int4 with 4-bit MatMulNBits
    (block 32, symmetric, accuracy level 4 so the CPU kernel runs int8 dot products)."""
    import onnx

    keep = _projection_matmuls(model, c)
    others = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name not in keep]
    if quant == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        q = work / "q.onnx"
        quantize_dynamic(str(raw), str(q), weight_type=QuantType.QInt8, per_channel=True,
                         nodes_to_exclude=keep)
        return nbits_quantize(onnx.load(str(q)), 8, exclude=others)
    if quant == "int4":
        return nbits_quantize(nbits_quantize(model, 8, exclude=others), 4)
    return model


def _shared_kv_module(head):
    """One shared-KV draft step: (tok_emb [T, E], hidden [T, E], position, then per head layer
    the target's keys and values it attends [S_i, Hkv, D], a sliding layer's cut to its window
    by the caller) -> (logits [T, draft vocab], hidden_out [T, E]); every row at `position`."""
    import torch
    from torch import nn

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = head

        def forward(self, tok_emb, hidden, position, *kv):
            h = self.head
            x = h.step_input(tok_emb[None], hidden[None])  # [1, T, d]
            qpos = position + torch.zeros_like(tok_emb[None, :, 0], dtype=torch.int64)  # [1, T]
            for i, blk in enumerate(h.blocks):
                x = blk(x, qpos, kv[2 * i][None], kv[2 * i + 1][None])  # every key given
            out = h.post_proj(h.out_norm(x))[0]
            return h.logits(out), out

    return Step().eval()


def shared_kv_io_names(n_layer: int) -> tuple[list[str], list[str]]:
    kv = [f"kv.{i}.{kind}" for i in range(n_layer) for kind in ("key", "value")]
    return ["tok_emb", "hidden", "position", *kv], ["logits", "hidden_out"]


def io_names(n_layer: int) -> tuple[list[str], list[str]]:
    return cache_io_names(["tok_emb", "hidden", "position"], ["logits", "hidden_out"], n_layer)


def write_head_onnx(ckpt: str | Path, out: str | Path, quant: str = "int8") -> dict:
    import onnx
    import torch

    from edgespec.training.train import load_checkpoint

    if quant not in QUANTS:
        raise EdgespecError(f"unknown --quant {quant} for ONNX; choose from {', '.join(QUANTS)}")
    head, meta = load_checkpoint(ckpt)
    shared = head_arch(meta["head"]) == "shared-kv"
    if not shared:
        require_mtp_head(meta["head"], ckpt, " (`export onnx` writes edgespec's MTP and shared-KV heads)")
    c = head.c
    T, P = 3, 5  # example sizes >= 2 on every dynamic axis
    axes = {"tok_emb": {0: "seq"}, "hidden": {0: "seq"}, "hidden_out": {0: "seq"}}
    if shared:
        step = _shared_kv_module(head)
        ins, outs = shared_kv_io_names(c.n_layer)
        axes.update({"logits": {0: "seq"}, **{n: {0: f"keys{i // 2}"} for i, n in enumerate(ins[3:])}})
        args = (torch.randn(T, c.n_embd), torch.randn(T, c.n_embd), torch.tensor(P, dtype=torch.int64),
                *[torch.randn(P + i // 2, c.n_head_kv, c.head_dim) for i in range(2 * c.n_layer)])
    else:
        step = _graph_module(head)
        ins, outs = io_names(c.n_layer)
        args = (torch.randn(T, c.n_embd), torch.randn(T, c.n_embd), torch.tensor(P, dtype=torch.int64),
                *[torch.randn(1, c.n_head_kv, P, c.head_dim) for _ in range(2 * c.n_layer)])
    with tempfile.TemporaryDirectory() as td:
        raw = Path(td) / "raw.onnx"
        trace_to_onnx(step, args, ins, outs, axes, raw)
        model = onnx.load(str(raw))
        with quiet_quantizers():
            model = _quantize(model, raw, Path(td), quant, c)
        draft_ids = [int(x) for x in meta["draft_vocab"]["ids"]]
        props = {ONNX_FORMAT: ONNX_HEAD_FORMAT, ONNX_HEAD_CONFIG: json.dumps(c.to_dict()),
                 ONNX_TARGET: meta["target"], ONNX_FINGERPRINT: meta["target_fingerprint"],
                 ONNX_DRAFT_VOCAB: json.dumps(draft_ids), ONNX_QUANT: quant}
        del model.metadata_props[:]
        for k, v in props.items():
            model.metadata_props.add(key=k, value=v)
        model.producer_name = "edgespec"
        onnx.checker.check_model(model)
        atomic_write(out, lambda tmp: onnx.save(model, tmp))
    return {"out": str(out), "quant": quant, "bytes": Path(out).stat().st_size}
