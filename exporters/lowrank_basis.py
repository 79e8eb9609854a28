"""`edgespec export lowrank-basis TARGET --out FILE.npz`: the basis of a low-rank LM head for
greedy decoding on llama.cpp (runtime/lowrank.py), and a check of what it costs and saves.

Calibration: the target's own final hidden states (read through llama.cpp's eval callback,
without its LM head) over the training side of the stdlib passages, the first 128 tokens of
each, `n_tokens` in all; the bench prompts are never used for it. The check decodes greedy
continuations of the shipped bench prompts with llama.cpp's full LM head and compares, position
by position in 8-token batches (as verification sees them), the top token of the low-rank head
with llama.cpp's; and it times one decode of k tokens with each head (medians, interleaved).
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.io import atomic_write


def export_lowrank_basis(target: str, out: str | Path, rank: int = 256, n_tokens: int = 32768,
                         check: bool = True, threads: int | None = None, log=print) -> dict:
    from edgespec.runtime.llama_target import LlamaTarget
    from edgespec.runtime.lowrank import calibrate_basis
    from edgespec.targets import load_target_spec

    out = Path(out)
    if out.suffix != ".npz":
        raise EdgespecError(f"--out {out}: a basis file ends in .npz")
    spec = load_target_spec(target)
    if not 8 <= rank < spec.n_embd:
        raise EdgespecError(f"--rank must be 8..{spec.n_embd - 1} for {spec.name} (got {rank})")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    eng = LlamaTarget(target, n_ctx=1024, n_threads=threads, lm_head="full", probe=True, spec=spec)
    basis, seen = calibrate_basis(eng, calibration_sequences(eng, n_tokens), rank, log=log)
    eng.close()
    buf = io.BytesIO()
    np.savez(buf, basis=basis.astype(np.float16), target_fingerprint=spec.tokenizer_fingerprint,
             calibration_tokens=seen)
    atomic_write(out, lambda tmp: Path(tmp).write_bytes(buf.getvalue()))
    report = {"target": spec.name, "out": str(out), "rank": rank, "calibration_tokens": seen,
              "calibration_s": round(time.perf_counter() - t0, 1), "bytes": out.stat().st_size}
    if check:
        report["check"] = check_lowrank(target, out, threads=threads, log=log)
    return report


def calibration_sequences(engine, n_tokens: int, per_text: int = 128):
    """The first `per_text` tokens of the training-side stdlib passages, `n_tokens` in all."""
    from edgespec.training.data import stdlib_passages

    passages = stdlib_passages("train")
    seen = 0
    for p in passages[::max(1, len(passages) // max(1, n_tokens // 100))]:
        ids = engine.tokenize(p["text"])[:per_text]
        seen += len(ids)
        yield ids
        if seen >= n_tokens:
            break


def _greedy(engine, ids: list[int], n: int) -> list[int]:
    """ids + the target's greedy continuation (up to n tokens, llama.cpp's full LM head)."""
    engine.reset()
    engine.prefill(ids[:-1])
    seq, pending = list(ids), ids[-1]
    for _ in range(n):
        logits, _ = engine.decode([pending], all_logits=False)
        pending = int(logits[-1].argmax())
        if engine.is_eog(pending):
            break
        seq.append(pending)
    return seq


def check_lowrank(target: str, basis: str | Path, threads: int | None = None, n_prompts: int = 0,
                  max_tokens: int = 32, log=print) -> dict:
    from edgespec.prompts import DEFAULT_PROMPTS, read_prompts
    from edgespec.runtime.llama_target import LlamaTarget
    from edgespec.runtime.policies import verify_cost_curve

    full = LlamaTarget(target, n_ctx=2048, n_threads=threads, lm_head="full")
    t0 = time.perf_counter()
    lr = LlamaTarget(target, n_ctx=2048, n_threads=threads, lm_head=str(basis), spec=full.spec)
    load_s = time.perf_counter() - t0
    prompts = read_prompts(DEFAULT_PROMPTS)
    prompts = prompts[:n_prompts] if n_prompts else prompts
    same = total = 0
    by_kind: dict[str, list[int]] = {}
    for p in prompts:
        ids = full.tokenize(p["prompt"])
        seq = _greedy(full, ids, max_tokens)
        for eng in (full, lr):
            eng.reset()
            eng.prefill(ids[:-1])
        for s in range(len(ids) - 1, len(seq) - 1, 8):
            chunk = seq[s:s + 8]
            a, _ = full.decode(chunk, all_logits=True)
            b, _ = lr.decode(chunk, all_logits=True, top_only=True)
            hits = int((a.argmax(1) == b.argmax(1)).sum())
            same, total = same + hits, total + len(chunk)
            kind = by_kind.setdefault(p.get("kind", "all"), [0, 0])
            kind[0], kind[1] = kind[0] + hits, kind[1] + len(chunk)
    # each head as verification uses it, interleaved so machine drift hits both alike
    ca, cb = [], []
    for _ in range(3):
        ca.append(verify_cost_curve(full, 8, top_only=False))
        cb.append(verify_cost_curve(lr, 8, top_only=True))
    cost = {"ms_full": [round(float(x), 1) for x in np.median(ca, 0)],
            "ms_lowrank": [round(float(x), 1) for x in np.median(cb, 0)]}
    full.close()
    lr.close()
    res = {"positions": total, "top1_agreement_with_llama_cpp": round(same / max(total, 1), 4),
           "by_kind": {k: round(h / n, 4) for k, (h, n) in sorted(by_kind.items())},
           "load_s": round(load_s, 2), **cost}
    log(f"low-rank LM head: top token = llama.cpp's at {same}/{total} positions; "
        f"c(k) ms full {res['ms_full']} / low-rank {res['ms_lowrank']}")
    return res

