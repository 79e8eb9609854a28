"""Draft heads to GGUF (numpy only; the reader is runtime/formats.py).

    edgespec export gguf runs/gemma/head --quant q8_0 --out head.gguf [--check --features DIR]

The file carries its own architecture name (`edgespec-mtp`; a shared-KV head's
`edgespec-shared-kv`, with the target layers it attends), every hyperparameter, the layer
types, window and RoPE bases, the target's tokenizer fingerprint and the draft vocabulary, so it
alone is enough to run the head next to its target. 2-D weights are quantized with the `gguf`
package (Q8_0 / Q4_0 / F16); norms stay F32. Like llama.cpp's own Q4_0 mixes (which keep the
output tensor in more bits), q4_0 keeps the input projection and the LM head at Q8_0: they move
the drafts most when rounded (`--check` measures the agreement with the trained head).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType as Q

from edgespec.errors import EdgespecError
from edgespec.exporters.eagle3_gguf import finish_gguf
from edgespec.io import atomic_write
from edgespec.runtime.formats import (DRAFT_IDS, GGUF_ARCH, GGUF_DRAFT_VOCAB, GGUF_FINGERPRINT,
                                      GGUF_HEAD_CONFIG, GGUF_SHARED_KV_ARCH, GGUF_TARGET,
                                      GGUF_TRAIN_META, head_arch, read_checkpoint, require_mtp_head)

ARCH = GGUF_ARCH
QUANTS = {"f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
# q4_0 keeps the input projection and the LM head at q8_0 (the MTP head's, the shared-KV head's)
KEEP_Q8 = ("fc.weight", "pre_proj.weight", "lm_head")


def write_head_gguf(ckpt: str | Path, out: str | Path, quant: str = "q8_0",
                    keep_q8: tuple[str, ...] | None = None) -> dict:
    import gguf

    if quant not in QUANTS:
        raise EdgespecError(f"unknown --quant {quant} for GGUF; choose from {', '.join(QUANTS)}")
    meta, weights = read_checkpoint(ckpt)
    c = meta["head"]
    shared = head_arch(c) == "shared-kv"
    if not shared:
        require_mtp_head(c, ckpt, " (`export gguf` writes edgespec's MTP and shared-KV heads)")
    qt = QUANTS[quant]
    keep_q8 = KEEP_Q8 if keep_q8 is None else keep_q8
    arch = GGUF_SHARED_KV_ARCH if shared else ARCH
    key = lambda name: name.replace(ARCH, arch, 1)  # noqa: E731

    def write(tmp):
        w = gguf.GGUFWriter(tmp, arch)
        w.add_string("general.name", f"edgespec {'shared-KV ' if shared else ''}draft head for {meta['target']}")
        w.add_string(key(GGUF_HEAD_CONFIG), json.dumps(c))
        w.add_string(key(GGUF_TARGET), meta["target"])
        w.add_string(key(GGUF_FINGERPRINT), meta["target_fingerprint"])
        w.add_string(key(GGUF_TRAIN_META), json.dumps({k: v for k, v in meta.items()
                                                       if k not in ("head",)}, default=str))
        if shared:  # the target layers whose keys and values each head layer attends
            w.add_array(f"{arch}.kv_layers", [int(i) for i in c["kv_layers"]])
            w.add_uint32(f"{arch}.head_width", c["d_model"])
        w.add_uint32(f"{arch}.embedding_length", c["n_embd"])
        w.add_uint32(f"{arch}.block_count", len(c["layer_types"]))
        w.add_uint32(f"{arch}.attention.head_count", c["n_head"])
        w.add_uint32(f"{arch}.attention.head_count_kv", c["n_head_kv"])
        w.add_uint32(f"{arch}.attention.key_length", c["head_dim"])
        w.add_uint32(f"{arch}.feed_forward_length", c["n_ff"])
        w.add_uint32(f"{arch}.attention.sliding_window", c["sliding_window"])
        w.add_array(f"{arch}.layer_types", list(c["layer_types"]))
        w.add_float32(f"{arch}.rope.freq_base", c["rope_base_global"])
        w.add_float32(f"{arch}.rope.freq_base_swa", c["rope_base_local"])
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_eps"])
        w.add_float32(f"{arch}.embed_scale", c["embed_scale"])
        w.add_array(key(GGUF_DRAFT_VOCAB), [int(x) for x in weights[DRAFT_IDS]])
        finish_gguf(w, {name: np.ascontiguousarray(arr, dtype=np.float32)
                        for name, arr in weights.items() if name != DRAFT_IDS},
                    lambda name: Q.Q8_0 if qt == Q.Q4_0 and name in keep_q8 else qt)

    atomic_write(out, write)
    return {"out": str(out), "quant": quant, "bytes": Path(out).stat().st_size}
