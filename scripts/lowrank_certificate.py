"""Can the low-rank LM head's candidate search be certified? Measured on the real target.

    .venv/bin/python scripts/lowrank_certificate.py --target gemma3-270m

A row of the search is certified when every token outside the C candidates provably scores
below the K-th best candidate's exact logit: its low-rank score (W U)(U^T h) plus the residual
bound ||w_perp|| ||h_perp|| (Cauchy-Schwarz on the parts outside the basis) stays under it, with
a 0.5 margin for the int8 scores. K = 1 certifies a greedy argmax, K = 40 the survivors of
top-k 40 (llama-cpp-python's default sampling). Counted per row: certified, and (for reference)
whether the true top K were among the candidates at all.

Rows: the target decodes, one token at a time, continuations it samples itself from generic
openings (not the bench prompts); logits and hidden states from the same decode. Bases: the
shipped one, and bases fitted (uncentred PCA, as `export lowrank-basis`) on hidden states of
other such continuations, at several ranks. Writes results/lowrank-certificate-TARGET.json
(append-only: -run2, ...).
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIT = ["The city council met on Tuesday to", "In this tutorial we will build", "She opened the letter and",
       "SELECT name, count(*) FROM", "The recipe calls for two cups of", "#include <stdio.h>\nint main() {",
       "Photosynthesis is the process", "My favourite holiday was when", "The stock market fell sharply",
       "function debounce(fn, ms) {", "The lecture on quantum mechanics", "A guide to growing tomatoes:",
       "He looked at the map and said", "The history of the printing press", "Q: What is the capital of",
       "package main\n\nimport \"fmt\"", "Climate change affects", "The detective entered the room",
       "Here are five tips for better sleep:", "The treaty was signed in"]
TEST = ["Once upon a time in a small village", "def merge_sort(arr):", "The weather report for tomorrow says",
        "Dear hiring manager, I am writing", "import numpy as np\n\nclass Model:", "The three laws of thermodynamics are"]


def sample_rows(eng, rows_per_text: int):
    """The rows both certificate studies read: hidden states to fit bases on (the target's own
    continuations of FIT), TEST rows (hidden state and full logits from one-token decodes of
    continuations the target samples itself, T=0.8, top-k 40), and the LM head's rows."""
    from llama_cpp import Llama

    from edgespec.gguf_meta import TensorRows, read_header
    from edgespec.runtime.lowrank import lm_head_tensor

    spec = eng.spec
    llm = Llama(model_path=spec.path, n_ctx=1024, n_threads=eng.n_threads, verbose=False)
    fit_texts = [s + llm.create_completion(s, max_tokens=150, seed=i)["choices"][0]["text"]
                 for i, s in enumerate(FIT)]
    del llm
    fit = []
    for text in fit_texts:
        eng.reset()
        fit.append(eng.hidden_states(eng.tokenize(text)).astype(np.float64))
    fit = np.concatenate(fit)
    rng = np.random.default_rng(0)
    hs, logits = [], []
    for text in TEST:
        eng.reset()
        ids = eng.tokenize(text)
        eng.prefill(ids[:-1])
        tok = ids[-1]
        for _ in range(rows_per_text):
            lg, h = eng.decode([tok], hidden=True)
            hs.append(h[0].copy())
            logits.append(lg[0].astype(np.float64))
            top = np.argpartition(-lg[0], 40)[:40]
            p = np.exp((lg[0][top] - lg[0][top].max()) / 0.8)
            tok = int(top[rng.choice(40, p=p / p.sum())])
    rows = TensorRows(read_header(spec.path), lm_head_tensor(spec))
    w = np.concatenate([rows[s:s + 16384] for s in range(0, rows.n_rows, 16384)])
    return fit, np.array(hs, np.float32), np.array(logits), w


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--rows-per-text", type=int, default=60)
    ap.add_argument("--ranks", type=int, nargs="+", default=[256, 384, 448])
    ap.add_argument("--candidates", type=int, nargs="+", default=[128, 512, 2048])
    a = ap.parse_args()

    from edgespec.io import write_result
    from edgespec.measure.bench import machine_info
    from edgespec.runtime.assets import shipped_basis
    from edgespec.runtime.llama_target import LlamaTarget
    from edgespec.runtime.lowrank import read_basis

    eng = LlamaTarget(a.target, n_ctx=1024, lm_head="full")
    spec = eng.spec
    fit, hs, logits, w = sample_rows(eng, a.rows_per_text)
    w_norm = np.linalg.norm(w, axis=1)
    vecs = np.linalg.eigh(fit.T @ fit)[1][:, ::-1]
    bases = {}
    shipped = shipped_basis(spec)
    if shipped is not None:
        bases["shipped"] = read_basis(shipped, spec)
    for r in a.ranks:
        bases[f"fitted rank {r}"] = np.ascontiguousarray(vecs[:, :r], dtype=np.float32)
    out = []
    for name, u in bases.items():
        wu = w @ u
        w_perp = np.sqrt(np.maximum(w_norm ** 2 - (wu ** 2).sum(1), 0))
        hu = hs @ u
        h_perp = np.sqrt(np.maximum((hs.astype(np.float64) ** 2).sum(1) - (hu.astype(np.float64) ** 2).sum(1), 0))
        scores = hu @ wu.T
        entry = {"basis": name, "rank": int(u.shape[1]),
                 "h_perp_share_median": round(float(np.median(h_perp / np.linalg.norm(hs, axis=1))), 4),
                 "w_perp_share_median": round(float(np.median(w_perp / w_norm)), 4), "by_candidates": []}
        for c in a.candidates:
            res = {"candidates": c}
            t0 = time.perf_counter()
            for k in (1, 40):
                cert = held = 0
                for t in range(len(hs)):
                    cand = np.argpartition(-scores[t], c)[:c]
                    kth = np.sort(logits[t, cand])[-k]
                    outside = np.ones(scores.shape[1], bool)
                    outside[cand] = False
                    cert += bool((scores[t, outside] + w_perp[outside] * h_perp[t]).max() < kth - 0.5)
                    held += bool(np.isin(np.argpartition(-logits[t], k)[:k], cand).all())
                res[f"top{k}"] = {"certified": cert, "true_top_among_candidates": held}
            res["numpy_check_ms_per_row"] = round(1000 * (time.perf_counter() - t0) / (2 * len(hs)), 2)
            entry["by_candidates"].append(res)
        out.append(entry)
        print(name, entry)
    doc = {"target": a.target, "file": Path(spec.path).name, "rows": len(hs),
           "fit_tokens": int(len(fit)), "margin_for_int8_scores": 0.5, "bases": out,
           "machine": machine_info(eng.n_threads)}
    print("wrote", write_result(ROOT / "results", f"lowrank-certificate-{a.target}", doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
