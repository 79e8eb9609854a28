"""Check an exported head (GGUF or ONNX) against the trained torch head it came from.

Both run on the same recorded inputs (held-out hidden states from `edgespec extract`): the real
pairs in chunks as after each verify pass, then draft chains where the head feeds on its own
output. Reported: max logit error, top-1 agreement, file size, ms per draft step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.runtime.formats import head_arch


def check_head_export(ckpt: str | Path, exported: str | Path, features: str | Path,
                      n_steps: int = 4, max_samples: int = 12, every: int = 8) -> dict:
    """Run the exported head (as the runtime runs it) beside the trained torch head on recorded inputs
    (held-out hidden states): max logit error, top-1 agreement, size, ms per draft step."""
    import time

    import torch

    from edgespec.runtime.heads import load_head
    from edgespec.targets import embedding_rows
    from edgespec.training.features import Features, final_state_only
    from edgespec.training.train import checkpoint_target, load_checkpoint, split_samples

    head, meta = load_checkpoint(ckpt)
    if not Path(exported).is_file():
        raise EdgespecError(f"{exported}: no such exported head")
    nh, info = load_head(exported)
    if info.fingerprint != meta["target_fingerprint"]:
        raise EdgespecError(f"{exported} is not an export of {ckpt} (target fingerprints differ)")
    if head_arch(meta["head"]) == "shared-kv":
        return check_shared_kv(head, meta, nh, exported, Features(features), n_steps, max_samples, every)
    feats = final_state_only(Features(features))  # with layer inputs stored: the final state alone
    if feats.fingerprint != meta["target_fingerprint"]:
        raise EdgespecError(f"{features}: not features of this head's target")
    embed = embedding_rows(checkpoint_target(meta))
    idx = split_samples(feats)[1][:max_samples]
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


def check_shared_kv(head, meta, nh, exported, feats, n_steps: int, max_samples: int, every: int) -> dict:
    """`check_head_export` for a shared-KV head: features with the keys and values it attends
    (`extract --kv`), the exported head stepping each chain as the drafter does (every step at
    the position after the chain start, over the target's keys up to it, teacher-forced)."""
    import time

    import torch

    from edgespec.targets import embedding_rows
    from edgespec.training.train import checkpoint_target, split_samples

    c = head.c
    if tuple(getattr(feats, "kv_layers", ())) != tuple(c.kv_layers):
        raise EdgespecError(f"the check needs features with the keys and values of layers "
                            f"{list(c.kv_layers)} (extract with --kv)")
    if feats.fingerprint != meta["target_fingerprint"]:
        raise EdgespecError("the features are not of this head's target")
    embed = embedding_rows(checkpoint_target(meta))
    idx = split_samples(feats)[1][:max_samples]
    if not idx:
        raise EdgespecError("no held-out samples to check against")
    e, w, n_l = c.n_embd, c.kv_width, c.n_layer
    errs, agree, total, step_s, steps = [], 0, 0, 0.0, 0
    for i in idx:
        toks = feats.tokens[i].astype(np.int64)
        rows = feats.hidden(i)
        hid, kv = rows[:, :e], rows[:, e:e + 2 * w * n_l]
        T = len(toks) - n_steps - 1
        emb = embed[toks]
        with torch.no_grad():
            ref = head.forward_chain(torch.from_numpy(emb)[None, 1:], torch.from_numpy(hid[:T])[None], n_steps,
                                     kv=torch.from_numpy(kv)[None], kv_valid=torch.ones(1, len(kv), dtype=torch.bool))
            ref_logits = [head.logits(o[0]).numpy() for o in ref]
        per = kv.reshape(len(kv), n_l, 2, c.n_head_kv, c.head_dim)
        for t in range(0, T, every):
            keys = [per[:t + 1, j, 0] for j in range(n_l)]
            values = [per[:t + 1, j, 1] for j in range(n_l)]
            x = hid[t:t + 1]
            for j in range(n_steps):
                t0 = time.perf_counter()
                x, lg = nh.step(emb[t + 1 + j][None], x, t + 1, keys, values)
                lg = lg[0]
                step_s += time.perf_counter() - t0
                steps += 1
                errs.append(float(np.abs(lg - ref_logits[j][t]).max()))
                agree += int(lg.argmax() == ref_logits[j][t].argmax())
                total += 1
    if not total:
        raise EdgespecError(f"the held-out samples are too short for {n_steps}-step chains")
    return {"exported": str(exported), "runtime": "onnxruntime" if Path(exported).suffix == ".onnx"
            else "numpy", "bytes": Path(exported).stat().st_size, "max_logit_error": round(max(errs), 5), "top1_agreement": round(agree / total, 4),
            "compared": total, "ms_per_draft_step": round(1000 * step_s / max(steps, 1), 3)}
