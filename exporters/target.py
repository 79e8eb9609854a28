"""Verify-friendly target export: re-write a target GGUF with a cheaper LM head, or with weights
of a type llama.cpp's CPU kernels batch well.

    edgespec export target gemma3-270m --out gemma3-270m-q4head.gguf [--head-type Q4_0]
    edgespec export target smollm2-135m --quant Q4_0 --out smollm2-q4_0.gguf

`--quant TYPE` re-quantizes the transformer's weight matrices (the LM head and embeddings keep
their type unless --head-type says otherwise) with llama.cpp's own quantizer: on AVX2 CPUs
llama.cpp multiplies several rows at once efficiently only for some block types (llamafile's
sgemm: Q8_0, Q4_0, Q5_0, IQ4_NL; repacked kernels: Q4_0, IQ4_NL), so a file in another type
(SmolLM2's Q4_1) pays nearly a decode per verified row. Re-quantizing from quantized weights
loses a little more: the report gives the agreement with the source.

Checking k drafted tokens needs the target's logits at k + 1 positions, and on CPU the
262k-row LM head dominates that cost. This export keeps every other tensor byte for
byte (llama.cpp's quantize API copies a tensor whose type does not change) and re-quantizes
only the LM head (Gemma: the tied `token_embd`). The report gives, for the original and the
new file, the measured cost c(k) of one decode with logits at all k positions, k = 1..8, the
file sizes, and the new file's top-1 agreement with the original on held-out text.
"""

from __future__ import annotations

import ctypes
import os
import re
import time
from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType

from edgespec.errors import EdgespecError
from edgespec.gguf_meta import read_header
from edgespec.runtime.policies import verify_cost_curve
from edgespec.targets import load_target_spec

HEAD_TYPES = ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K", "BF16", "F16")
# --quant: llama.cpp file types whose blocks its AVX2 kernels batch (see the module doc)
QUANT_FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q5_0": 8, "IQ4_NL": 25}


def requantize_weights(src: str | Path, out: str | Path, quant: str, threads: int = 0) -> None:
    """Every weight matrix of the trunk to `quant` (llama.cpp's llama_model_quantize, from the
    source's own values); token_embd and output keep their types; written atomically."""
    import llama_cpp as lc

    if quant not in QUANT_FTYPES:
        raise EdgespecError(f"unknown --quant {quant} for a target; choose from {', '.join(QUANT_FTYPES)}")
    header = read_header(src)
    params = lc.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = QUANT_FTYPES[quant]
    params.allow_requantize = True
    params.token_embedding_type = GGMLQuantizationType[header.tensors["token_embd.weight"].type_name].value
    if "output.weight" in header.tensors:
        params.output_tensor_type = GGMLQuantizationType[header.tensors["output.weight"].type_name].value
    else:
        params.quantize_output_tensor = False
    keep = [("token_embd.weight", header.tensors["token_embd.weight"].type_name)]
    _quantize(src, out, params, keep, f" to {quant}")


def _quantize(src, out, params, keep: list[tuple[str, str]], what: str = "") -> None:
    """llama.cpp's llama_model_quantize into a temp file, renamed to `out` once the tensors in
    `keep` still have their types."""
    import llama_cpp as lc

    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        rc = lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise EdgespecError(f"llama.cpp could not re-quantize {src}{what} (code {rc})")
        got = read_header(tmp).tensors
        for n, tname in keep:
            if got[n].type_name != tname:
                raise EdgespecError(f"export changed {n} from {tname} to {got[n].type_name}")
        os.replace(tmp, out)
    except OSError as e:
        raise EdgespecError(f"{out}: write failed ({e.strerror})") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def rewrite_lm_head(src: str | Path, out: str | Path, head_type: str, threads: int = 0) -> None:
    import llama_cpp as lc

    if head_type not in HEAD_TYPES:
        raise EdgespecError(f"unknown --head-type {head_type}; choose from {', '.join(HEAD_TYPES)}")
    header = read_header(src)
    head_name = "output.weight" if "output.weight" in header.tensors else "token_embd.weight"
    keep = [(n, t.type_name) for n, t in header.tensors.items() if n != head_name]
    overrides = (lc.llama_model_tensor_override * (len(keep) + 1))()
    patterns = [f"^{re.escape(n)}$".encode() for n, _ in keep]  # kept alive for the call
    for i, ((_, tname), pat) in enumerate(zip(keep, patterns)):
        overrides[i].pattern = pat
        overrides[i].type = GGMLQuantizationType[tname].value
    overrides[len(keep)].pattern = None
    params = lc.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = int(header.metadata.get("general.file_type", 15))
    params.allow_requantize = True
    params.quantize_output_tensor = True
    qt = GGMLQuantizationType[head_type].value
    params.token_embedding_type = qt
    params.output_tensor_type = qt
    params.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(lc.llama_model_tensor_override))
    _quantize(src, out, params, keep)  # nothing but the LM head may change


def add_untied_head(src: str | Path, out: str | Path, head_type: str) -> None:
    """Copy a tied-embedding GGUF and add a separate `output.weight` of `head_type`.

    The input embeddings (token_embd) keep their type, so hidden states do not move; only the
    LM head that verification pays for gets cheaper. llama.cpp uses output.weight when present.
    """
    import gguf
    from gguf.constants import GGUFValueType
    from gguf.quants import quantize

    from edgespec.gguf_meta import StringArray, TensorRows
    from edgespec.io import atomic_write

    if head_type not in HEAD_TYPES:
        raise EdgespecError(f"unknown --head-type {head_type}; choose from {', '.join(HEAD_TYPES)}")
    header = read_header(src)
    if "output.weight" in header.tensors:
        raise EdgespecError(f"{src} already has an untied output.weight; use --mode requantize")
    arch = header.metadata["general.architecture"]
    emb = TensorRows(header, "token_embd.weight")

    def write(tmp):
        w = gguf.GGUFWriter(tmp, arch)
        for key, val in header.metadata.items():
            if key == "general.architecture":
                continue
            vt, item = header.value_types[key]
            if isinstance(val, StringArray):
                val = [val[i] for i in range(len(val))]
            elif isinstance(val, np.ndarray):
                val = val.tolist()
            w.add_key_value(key, val, GGUFValueType(vt), GGUFValueType(item) if item is not None else None)
        raw = np.memmap(header.path, dtype=np.uint8, mode="r")
        for name, t in header.tensors.items():
            qt = GGMLQuantizationType[t.type_name]
            data = np.asarray(raw[t.offset:t.offset + t.nbytes])
            shape = tuple(reversed(t.shape))  # numpy order; the last axis is stored in bytes
            w.add_tensor(name, data.reshape(*shape[:-1], -1), raw_dtype=qt)
        qt = GGMLQuantizationType[head_type]
        parts = []
        for s0 in range(0, emb.n_rows, 32768):  # quantize in slices to bound memory
            parts.append(quantize(emb[s0:s0 + 32768], qt))
        head = np.concatenate(parts)
        w.add_tensor("output.weight", head, raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    atomic_write(out, write)
    new = read_header(out)
    from edgespec.targets import spec_from_header

    if spec_from_header(new).tokenizer_fingerprint != spec_from_header(header).tokenizer_fingerprint:
        Path(out).unlink()
        raise EdgespecError("the rewritten vocabulary does not match the source; export aborted")


def top1_agreement(a, b, texts: list[str], max_tokens: int = 2048) -> float:
    """Share of positions where two engines' greedy next token agrees, over held-out text."""
    same = total = 0
    for text in texts:
        ids = a.tokenize(text)[:256]
        if len(ids) < 2:
            continue
        a.reset()
        b.reset()
        for s in range(0, len(ids), 32):
            chunk = ids[s:s + 32]
            la, _ = a.decode(chunk, copy=False)
            top_a = la.argmax(1)
            lb, _ = b.decode(chunk, copy=False)
            same += int((top_a == lb.argmax(1)).sum())
            total += len(chunk)
        if total >= max_tokens:
            break
    return same / max(total, 1)


def export_target(target: str, out: str | Path, head_type: str | None = "Q4_0", threads: int | None = None,
                  check: bool = True, k_max: int = 8, mode: str = "untie", quant: str | None = None) -> dict:
    """mode: "untie" adds a separate LM head (inputs unchanged; tied models only),
    "requantize" re-quantizes the existing LM head tensor in place (inputs change too when tied).
    quant: re-quantize the trunk's weights to this type instead (head_type None: the LM head
    keeps its type)."""
    from edgespec.training.data import held_out_passages
    from edgespec.runtime.llama_target import LlamaTarget

    spec = load_target_spec(target)
    out = Path(out)
    if out.resolve() == Path(spec.path).resolve():
        raise EdgespecError("--out must differ from the target file")
    if not out.parent.is_dir():
        raise EdgespecError(f"{out.parent}: no such folder")
    if not os.access(out.parent, os.W_OK):
        raise EdgespecError(f"{out.parent}: not writable")
    t0 = time.time()
    if quant is not None:
        if head_type is not None:
            raise EdgespecError("--quant re-quantizes the trunk and keeps the LM head; give "
                                "--head-type in a second export")
        requantize_weights(spec.path, out, quant)
    elif mode == "untie" and spec.tied_embeddings:
        add_untied_head(spec.path, out, head_type)
    elif mode in ("untie", "requantize"):
        rewrite_lm_head(spec.path, out, head_type)
    else:
        raise EdgespecError(f"unknown export mode {mode}; choose untie or requantize")
    report = {"source": spec.path, "out": str(out), "head_type": head_type or spec.lm_head_type,
              "mode": f"quant {quant}" if quant else mode,
              "source_head_type": spec.lm_head_type, "export_s": round(time.time() - t0, 1),
              "size_source": os.path.getsize(spec.path), "size_out": os.path.getsize(out)}
    if check:
        # llama.cpp's own LM heads: comparing them is the point
        a = LlamaTarget(spec.path, n_ctx=512, n_threads=threads, lm_head="full")
        b = LlamaTarget(out, n_ctx=512, n_threads=threads, lm_head="full")
        texts = [p["text"] for p in held_out_passages()[:40]]
        report["top1_agreement"] = round(top1_agreement(a, b, texts), 4)
        # interleave the two files' measurements so machine drift hits both alike
        ca, cb = [], []
        for _ in range(3):
            ca.append(verify_cost_curve(a, k_max))
            cb.append(verify_cost_curve(b, k_max))
        report["verify_ms_source"] = [round(float(x), 3) for x in np.median(ca, 0)]
        report["verify_ms_out"] = [round(float(x), 3) for x in np.median(cb, 0)]
        report["threads"] = a.n_threads
        report["offer_as_default"] = report["top1_agreement"] >= 0.98
        a.close()
        b.close()
    return report
