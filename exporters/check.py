"""Check an exported head (GGUF or ONNX) against the trained torch head it came from.

Both run on the same recorded inputs (held-out hidden states from `edgespec extract`): the real
pairs in chunks as after each verify pass, then draft chains where the head feeds on its own
output. Reported: max logit error, top-1 agreement, file size, ms per draft step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError


def load_exported_head(path: str | Path):
    """A runtime head (numpy for GGUF, onnxruntime for ONNX) with `.info` (fingerprint, ids)."""
    from edgespec.runtime.drafters import NumpyHead, OnnxHead

    path = Path(path)
    if not path.is_file():
        raise EdgespecError(f"{path}: no such exported head")
    if path.suffix == ".onnx":
        return OnnxHead(path)
    from edgespec.exporters.gguf_head import read_head_gguf

    config, w, info = read_head_gguf(path)
    h = NumpyHead(config, w)
    h.info = info
    return h


def check_head_export(ckpt: str | Path, exported: str | Path, features: str | Path,
                      n_steps: int = 4, max_samples: int = 12, every: int = 8) -> dict:
    """Run the exported head (as the runtime runs it) beside the trained torch head on recorded inputs
    (held-out hidden states): max logit error, top-1 agreement, size, ms per draft step."""
    import time

    import torch

    from edgespec.features import Features
    from edgespec.train import _embed_for, is_eval, load_checkpoint

    head, meta = load_checkpoint(ckpt)
    nh = load_exported_head(exported)
    if nh.info["target_fingerprint"] != meta["target_fingerprint"]:
        raise EdgespecError(f"{exported} is not an export of {ckpt} (target fingerprints differ)")
    feats = Features(features)
    embed = _embed_for(meta)
    idx = [i for i, s in enumerate(feats.sample_ids()) if is_eval(s)][:max_samples]
    if not idx:
        raise EdgespecError(f"{features}: no held-out samples to check against")
    errs, agree, total, step_s, steps = [], 0, 0, 0.0, 0
    for i in idx:
        toks = feats.tokens[i].astype(np.int64)
        hid = feats.hidden(i)
        T = len(toks) - n_steps - 1
        emb = embed[toks]
        with torch.no_grad():
            ref = head.forward_chain(torch.from_numpy(emb)[None, 1:], torch.from_numpy(hid[:T])[None], n_steps)
            ref_logits = [head.logits(o[0]).numpy() for o in ref]
        nh.reset()
        done = 0
        for t in range(0, T, every):
            out, _ = nh.forward(emb[done + 1:t + 2], hid[done:t + 1], done, commit=True)
            done = t + 1
            cache, last = (nh.k, nh.v), out[-1:]
            for j in range(n_steps):
                if j:
                    t0 = time.perf_counter()
                    last, cache = nh.forward(emb[t + 1 + j][None], last, t + j, commit=False, cache=cache)
                    step_s += time.perf_counter() - t0
                    steps += 1
                lg = nh.last_logits
                errs.append(float(np.abs(lg - ref_logits[j][t]).max()))
                agree += int(lg.argmax() == ref_logits[j][t].argmax())
                total += 1
    return {"exported": str(exported), "runtime": "onnxruntime" if Path(exported).suffix == ".onnx"
            else "numpy", "bytes": Path(exported).stat().st_size,
            "max_logit_error": round(max(errs), 5), "top1_agreement": round(agree / total, 4),
            "compared": total, "ms_per_draft_step": round(1000 * step_s / max(steps, 1), 3)}
