"""Can tighter bounds certify the candidate search, for greedy rows and for sampled ones?

    .venv/bin/python scripts/certificate_bounds.py --target gemma3-270m

`scripts/lowrank_certificate.py` bounded every non-candidate's logit by its low-rank score plus
||w_perp|| ||h_perp|| and certified almost no rows. This measures the tighter bounds the issue
names, on the same kind of rows (the target's own sampled continuations, one decode per row,
exact logits from that decode):

- **blocks**: the directions outside the basis, ordered by the target's own hidden-state energy,
  cut into B blocks; a token's logit is at most its low-rank score plus sum_b ||w_b|| ||h_b||
  (Cauchy-Schwarz per block: never looser than one block, tighter where h's residual sits in
  few blocks); B more multiply-adds per token and row.
- **clusters** (CSV-Decode): k-means clusters of the LM-head rows; a logit is at most
  <centroid, h> + radius x ||h||. And the same on the residual alone (`residual clusters`):
  low-rank score + <centroid_perp, h_perp> + radius_perp x ||h_perp||.
- **what sampling needs**: llama-cpp-python's default chain (top-k 40, top-p 0.95, min-p 0.05,
  then temperature) keeps only tokens whose logit is within ln 20 of the best one, so a row's
  law is the full head's when no token outside the candidates can reach that cut and the top-p
  cut falls at the same place whatever mass the unseen tokens have: a test 3 nats stricter
  than greedy's (the best logit must beat every left-out bound by ln 20, not just beat it).

Candidates are the C tokens with the highest upper bounds, the best choice for certifying; a row is certified when
the best bound left out, plus a margin for the runtime's int8 scores, is under the cut. Writes
results/certificate-bounds-TARGET.json (append-only: -run2, ...).
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

LN_MIN_P = float(np.log(0.05))  # llama-cpp-python's default min_p, on the untempered logits
TOP_K, TOP_P = 40, 0.95


def sampled_exact(top: np.ndarray, tau: float) -> bool:
    """Whether llama-cpp-python's default chain keeps the same tokens with the same logits as
    on the full logits, knowing the candidates' exact logits `top` (sorted, best first) and that
    every other token's logit is under tau. min-p then keeps exactly the candidates within
    ln 20 of the best; top-p (on the top-k's softmax, before min-p) must cut at or after them,
    or at the same index, for any mass of the unseen tokens."""
    lmax = top[0]
    if tau >= lmax + LN_MIN_P:
        return False
    m = int((top >= lmax + LN_MIN_P).sum())
    known = np.exp(top[:TOP_K] - lmax)
    z_lo = known.sum()
    pool = np.sort(np.concatenate([top[:TOP_K], np.full(TOP_K, tau)]))[::-1][:TOP_K]
    z_hi = np.exp(pool - lmax).sum()
    cum = np.cumsum(known)
    cut_lo = int(np.searchsorted(cum, TOP_P * z_lo)) + 1  # tokens top-p keeps
    if cut_lo >= m:
        return True  # more mass only moves the cut later: min-p's set is what survives
    cut_hi = int(np.searchsorted(cum, TOP_P * z_hi)) + 1
    return cut_hi == cut_lo


def certify(bound: np.ndarray, logits: np.ndarray, c: int, margin: float) -> dict:
    """Rows certified for greedy and for the default sampled chain with the C candidates of
    the highest upper bounds (`bound`: rows x vocab), how far the greedy test misses (median
    of the best left-out bound minus the best logit), and the largest amount any logit exceeds
    its bound (a check of the bound itself: llama.cpp rounds h to Q8_0 blocks, the bound does
    not, so only that rounding may show, well inside the margin)."""
    greedy = sampled = 0
    miss, over = [], 0.0
    for t in range(len(bound)):
        cand = np.argpartition(-bound[t], c)[:c]
        rest = np.ones(bound.shape[1], bool)
        rest[cand] = False
        tau = float(bound[t, rest].max()) + margin
        top = np.sort(logits[t, cand])[::-1]
        greedy += bool(tau < top[0])
        sampled += sampled_exact(top, tau)
        miss.append(tau - top[0])
        over = max(over, float((logits[t] - bound[t]).max()))
    return {"candidates": c, "greedy_certified": greedy, "sampled_defaults_certified": sampled,
            "greedy_miss_median": round(float(np.median(miss)), 2),
            "largest_logit_over_bound": round(over, 4)}


def kmeans(x: np.ndarray, k: int, iters: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Centroids fitted on a sample of the rows, then every row assigned to its nearest one."""
    sample = x[rng.choice(len(x), min(len(x), 32 * k), replace=False)]
    cent = sample[rng.choice(len(sample), k, replace=False)].copy()

    def assign(rows):
        out = np.empty(len(rows), np.int64)
        c2 = (cent ** 2).sum(1)
        for s in range(0, len(rows), 16384):
            out[s:s + 16384] = np.argmin(c2[None] - 2 * rows[s:s + 16384] @ cent.T, axis=1)
        return out

    for _ in range(iters):
        lab = assign(sample)
        for j in range(k):
            pick = sample[lab == j]
            if len(pick):
                cent[j] = pick.mean(0)
    lab = assign(x)
    for j in range(k):  # the centroids of the final assignment (a tighter radius)
        pick = x[lab == j]
        if len(pick):
            cent[j] = pick.mean(0)
    return cent, lab


def clusters(x: np.ndarray, k: int, rng):
    """Centroids, radii and each row's cluster, for k clusters of the rows x."""
    cent, lab = kmeans(x, k, 6, rng)
    radius = np.zeros(k, np.float32)
    np.maximum.at(radius, lab, np.linalg.norm(x - cent[lab], axis=1))
    return cent, radius, lab


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--rows-per-text", type=int, default=60)
    ap.add_argument("--ranks", type=int, nargs="+", default=[256, 448])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--clusters", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--candidates", type=int, nargs="+", default=[128, 2048, 8192])
    ap.add_argument("--margin", type=float, default=0.5)
    a = ap.parse_args()

    from lowrank_certificate import sample_rows

    from edgespec.io import write_result
    from edgespec.measure.bench import machine_info
    from edgespec.runtime.llama_target import LlamaTarget

    eng = LlamaTarget(a.target, n_ctx=1024, lm_head="full")
    fit, hs, logits, w = sample_rows(eng, a.rows_per_text)
    logits = logits.astype(np.float32)
    rng = np.random.default_rng(0)
    vecs = np.linalg.eigh(fit.T @ fit)[1][:, ::-1].astype(np.float32)  # by energy, best first
    h_norm = np.linalg.norm(hs, axis=1)
    doc = {"target": a.target, "file": Path(eng.spec.path).name, "rows": len(hs),
           "fit_tokens": int(len(fit)), "margin_for_int8_scores": a.margin,
           "sampled_chain": {"top_k": TOP_K, "top_p": TOP_P, "min_p": 0.05}, "bounds": []}

    def record(name, fn):
        t0 = time.perf_counter()
        entry = {"bound": name, **fn()}
        entry["numpy_seconds"] = round(time.perf_counter() - t0, 1)
        doc["bounds"].append(entry)
        print(entry, flush=True)

    for k in a.clusters:  # CSV-Decode on the whole rows: no basis
        def whole(k=k):
            cent, radius, lab = clusters(w, k, rng)
            bound = (hs @ cent.T + radius[None] * h_norm[:, None])[:, lab]
            return {"by_candidates": [certify(bound, logits, c, a.margin) for c in a.candidates]}
        record(f"clusters {k}", whole)
    for r in a.ranks:
        u, comp = vecs[:, :r], vecs[:, r:]
        scores = (hs @ u) @ (w @ u).T
        w_perp, h_perp = w @ comp, hs @ comp
        for b in a.blocks:
            def blocks(b=b):
                cuts = np.array_split(np.arange(comp.shape[1]), b)
                wb = np.stack([np.linalg.norm(w_perp[:, i], axis=1) for i in cuts], 1)
                hb = np.stack([np.linalg.norm(h_perp[:, i], axis=1) for i in cuts], 1)
                bound = scores + hb @ wb.T
                return {"h_perp_share_median": round(float(np.median(np.linalg.norm(h_perp, axis=1) / h_norm)), 4),
                        "by_candidates": [certify(bound, logits, c, a.margin) for c in a.candidates]}
            record(f"rank {r}, {b} residual blocks", blocks)
        for k in a.clusters:
            def residual(k=k):
                cent, radius, lab = clusters(w_perp, k, rng)
                hp_norm = np.linalg.norm(h_perp, axis=1)
                bound = scores + (h_perp @ cent.T + radius[None] * hp_norm[:, None])[:, lab]
                return {"by_candidates": [certify(bound, logits, c, a.margin) for c in a.candidates]}
            record(f"rank {r}, residual clusters {k}", residual)
    doc["machine"] = machine_info(eng.n_threads)
    print("wrote", write_result(ROOT / "results", f"certificate-bounds-{a.target}", doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
