"""Where one verify decode's time goes, by the number of rows it checks.

    .venv/bin/python scripts/verify_cost.py --target gemma3-270m --rows 1 2 3 4 6 --reps 20

For each row count k, on the same context, in interleaved repetitions (medians):
- llama.cpp with its own LM head, logits at the last row only (what one-token decoding pays,
  and what k rows of the transformer trunk cost when only one row reaches the LM head);
- llama.cpp with its own LM head, logits at every row (a verify pass without the low-rank head);
- the low-rank LM head's parts (runtime/lowrank.py): the trunk up to the final norm, read by the
  eval callback with no LM head; the candidate search (onnxruntime); the exact rescoring of the
  candidates; and the whole `decode(..., hidden=True, top_only=True)` call a greedy verify makes;
- the batched LM head (runtime/batched_head.py, where the target's head type allows it): the
  whole `decode` with every row's logits, as a sampled verify makes it.
Writes results/verify-cost-TARGET.json (append-only: -run2, ...).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONTEXT = ("The history of the Roman Empire is long and complicated. It begins with the founding "
           "of the city, grows through the Republic and ends, in the West, in the fifth century.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if min(a.rows) < 1 or a.reps < 3:
        ap.error("--rows must be positive and --reps at least 3")

    from edgespec.io import write_result
    from edgespec.measure.bench import machine_info
    from edgespec.runtime.assets import shipped_basis
    from edgespec.runtime.batched_head import supports as batched_supported
    from edgespec.runtime.llama_target import LlamaTarget

    full = LlamaTarget(a.target, n_ctx=1024, lm_head="full")
    # the low-rank parts where a basis ships for the target (Gemma), the batched head where the
    # target's LM head type allows it: a target with neither gets llama.cpp's rows alone
    low = LlamaTarget(a.target, n_ctx=1024, lm_head="lowrank") if shipped_basis(full.spec) else None
    bat = LlamaTarget(a.target, n_ctx=1024, lm_head="batched") if batched_supported(full.spec) else None
    head = low.lowrank_head if low is not None else None
    context = full.tokenize(CONTEXT)
    for e in (full, low, bat):
        if e is not None:
            e.reset()
            e.decode(context, all_logits=False)
    kept_full, kept_low = len(full.tokens), len(low.tokens) if low is not None else 0
    parts = (("full_last_row", "full_every_row")
             + (("lowrank_trunk", "lowrank_candidates", "lowrank_rescore", "lowrank_decode") if low else ())
             + (("batched_decode",) if bat else ()))
    times = {k: {p: [] for p in parts} for k in a.rows}
    rng = np.random.default_rng(a.seed)

    def clock(fn):
        t0 = time.perf_counter()
        out = fn()
        return out, 1000 * (time.perf_counter() - t0)

    for rep in range(a.reps + 1):  # the first round warms up and is not counted
        for k in a.rows:
            toks = [int(t) for t in rng.integers(1000, 20000, size=k)]
            got = {}
            full.truncate(kept_full)
            _x, got["full_last_row"] = clock(lambda: full.decode(toks, all_logits=False))
            full.truncate(kept_full)
            _x, got["full_every_row"] = clock(lambda: full.decode(toks, all_logits=True))
            if low is not None:
                low.truncate(kept_low)
                h, got["lowrank_trunk"] = clock(lambda: low._decode_grab(toks, [True] * k))
                cand, got["lowrank_candidates"] = clock(lambda: head.candidates(h[:, :low.n_embd]))
                _x, got["lowrank_rescore"] = clock(lambda: head.top(cand, h[:, :low.n_embd]))
                low.truncate(kept_low)
                _x, got["lowrank_decode"] = clock(lambda: low.decode(toks, hidden=True, top_only=True))
            if bat is not None:
                bat.truncate(kept_full)
                _x, got["batched_decode"] = clock(lambda: bat.decode(toks, all_logits=True))
            if rep:
                for p in parts:
                    times[k][p].append(got[p])
    rows = []
    for k in a.rows:
        med = {p: round(statistics.median(v), 3) for p, v in times[k].items()}
        rows.append({"rows": k, "ms_median": med})
    one = rows[0]["ms_median"]
    for r in rows:
        r["vs_first"] = {p: round(r["ms_median"][p] / one[p], 3) for p in parts}
    doc = {"target": a.target, "file": Path(full.spec.path).name, "context_tokens": len(context),
           "reps": a.reps, "lowrank": head.info.describe("exactly") if head else None, "rows": rows,
           "machine": machine_info(full.n_threads)}
    for r in rows:
        print(r["rows"], r["ms_median"])
    print("wrote", write_result(ROOT / "results", f"verify-cost-{a.target}", doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
