"""What one sampled row costs: edgespec's sampler chain against llama.cpp's own, same logits.

    .venv/bin/python scripts/sampler_cost.py --target gemma3-270m --rows 64

The target decodes a text one token at a time; at each row both samplers draw from the same
logits, interleaved: llama.cpp's chain as llama-cpp-python builds it for its defaults
(penalties, top-k 40, typical 1, top-p 0.95, min-p 0.05, temperature 0.8, dist), called with
`llama_sampler_sample` on the context (it builds its 262k-entry candidate array from the
context's logits, as every `llama_cpp.Llama` token pays), and `runtime.sampling.chain` + draw
on the float32 view of the same row. Also timed: a top_k 0 chain (top-p 0.95 alone) on both.
Writes results/sampler-cost-TARGET.json (append-only: -run2, ...).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = ("The lighthouse keeper climbed the stairs every evening at dusk, counting the steps as "
        "his father had, and lit the lamp that the ships had trusted for a hundred years.")

CHAINS = {
    "library defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "top-p alone": dict(temperature=0.8, top_k=0, top_p=0.95, min_p=0.0),
}


def llama_chain(lc, n_vocab: int, sp, seed: int):
    """llama.cpp's sampler chain in the order llama-cpp-python's `_init_sampler` adds it."""
    ch = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    lc.llama_sampler_chain_add(ch, lc.llama_sampler_init_penalties(n_vocab, 64, 1.0, 0.0, 0.0))
    lc.llama_sampler_chain_add(ch, lc.llama_sampler_init_top_k(sp.top_k))
    lc.llama_sampler_chain_add(ch, lc.llama_sampler_init_typical(sp.typical_p, 1))
    lc.llama_sampler_chain_add(ch, lc.llama_sampler_init_top_p(sp.top_p, 1))
    lc.llama_sampler_chain_add(ch, lc.llama_sampler_init_min_p(sp.min_p, 1))
    lc.llama_sampler_chain_add(ch, lc.llama_sampler_init_temp(sp.temperature))
    lc.llama_sampler_chain_add(ch, lc.llama_sampler_init_dist(seed))
    return ch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="timings per row and sampler (median)")
    a = ap.parse_args()
    if a.rows < 4 or a.reps < 1:
        ap.error("--rows must be at least 4 and --reps at least 1")

    import llama_cpp as lc

    from edgespec.io import write_result
    from edgespec.measure.bench import machine_info
    from edgespec.runtime.llama_target import LlamaTarget
    from edgespec.runtime.sampling import SamplingParams, chain

    t = LlamaTarget(a.target, n_ctx=1024, lm_head="full")
    ids = t.tokenize(TEXT)
    t.reset()
    t.prefill(ids[:1])
    out = {}
    for name, kw in CHAINS.items():
        sp = SamplingParams(seed=0, **kw)
        ours, theirs, support = [], [], []
        ch = llama_chain(lc, t.n_vocab, sp, 0)
        rng = np.random.default_rng(0)
        t.truncate(1)
        for i in range(a.rows):
            tok = ids[1 + i % (len(ids) - 1)]
            logits, _ = t.decode([tok], copy=False)
            row = logits[0]
            for _ in range(a.reps):
                t0 = time.perf_counter()
                lc.llama_sampler_sample(ch, t._ctx, -1)
                t1 = time.perf_counter()
                d = chain(row, sp)
                d.draw(rng)
                t2 = time.perf_counter()
                theirs.append(1000 * (t1 - t0))
                ours.append(1000 * (t2 - t1))
            support.append(int(d.ids.size))
            if len(t.tokens) > 900:
                t.truncate(1)
        lc.llama_sampler_free(ch)
        out[name] = {"params": kw, "ms_per_row_median": {"edgespec": round(statistics.median(ours), 4),
                                                         "llama.cpp": round(statistics.median(theirs), 4)},
                     "edgespec_over_llama_cpp": round(statistics.median(ours) / statistics.median(theirs), 3),
                     "support_median": statistics.median(support)}
        print(name, out[name])
    doc = {"target": a.target, "file": Path(t.spec.path).name, "n_vocab": t.n_vocab, "rows": a.rows,
           "reps": a.reps, "chains": out, "machine": machine_info(t.n_threads)}
    print("wrote", write_result(ROOT / "results", f"sampler-cost-{a.target}", doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
