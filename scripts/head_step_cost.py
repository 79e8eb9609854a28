"""What one draft step of a shared-KV head's ONNX export costs as the context grows.

    .venv/bin/python scripts/head_step_cost.py --name NAME HEAD.onnx [HEAD.onnx ...]
        [--contexts 32,64,128,256,512,1024] [--reps 200] [--cold]

Each file is loaded the way the runtime loads it (`runtime.heads.load_head`: onnxruntime, one
thread) and runs the drafter's own `step` (one row, the keys and values of every position before
the query, a sliding layer's cut to its window) at each context length, the files interleaved
rep by rep so that machine noise falls on all of them alike. Inputs are random rows at the
target's scale: a step's cost depends on the shapes, not the values. Also reported: how far the
files' outputs are apart on the same inputs (the same head exported twice must agree).
--cold: before every timed step, write through a 64 MB buffer, so the head's weights are out of
the caches as they are in the decode loop (the target's pass in between reads ~100 MB).
Writes results/head-step-cost-NAME.json (ms per step: median and quartiles per file and context).
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--name", required=True)
    ap.add_argument("--contexts", default="32,64,128,256,512,1024")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--cold", action="store_true", help="evict the caches before every timed step")
    a = ap.parse_args()

    from edgespec.io import write_result
    from edgespec.measure.bench import machine_info
    from edgespec.runtime.heads import load_head

    heads = [load_head(p)[0] for p in a.heads]
    c = heads[0].c
    if any(h.c.to_dict() != c.to_dict() for h in heads[1:]):
        print("error: the files are heads of different shapes", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    contexts = [int(x) for x in a.contexts.split(",")]
    flush = np.ones(64 * 2**20 // 4, np.float32) if a.cold else None
    rows = []
    for n in contexts:
        keys = [rng.standard_normal((n, c.n_head_kv, c.head_dim)).astype(np.float32) for _ in range(c.n_layer)]
        values = [rng.standard_normal((n, c.n_head_kv, c.head_dim)).astype(np.float32) for _ in range(c.n_layer)]
        x = rng.standard_normal((1, c.n_embd)).astype(np.float32) * 0.05
        hid = rng.standard_normal((1, c.n_embd)).astype(np.float32) * 5
        outs = [h.step(x, hid, n, keys, values) for h in heads]  # warm-up, and the outputs
        ms = [[] for _ in heads]
        for _ in range(a.reps):
            for i, h in enumerate(heads):
                if flush is not None:
                    flush += 1.0
                t0 = time.perf_counter()
                h.step(x, hid, n, keys, values)
                ms[i].append(1000 * (time.perf_counter() - t0))
        row = {"context": n, "files": []}
        for p, m, (out, lg) in zip(a.heads, ms, outs):
            q1, med, q3 = np.percentile(m, [25, 50, 75])
            row["files"].append({"head": p, "ms_median": round(float(med), 3),
                                 "ms_q1": round(float(q1), 3), "ms_q3": round(float(q3), 3),
                                 "max_logit_diff_vs_first": round(float(np.abs(lg - outs[0][1]).max()), 5),
                                 "same_top1_as_first": bool(lg.argmax() == outs[0][1].argmax())})
        rows.append(row)
        print(n, " ".join(f"{f['ms_median']:.3f}" for f in row["files"]), flush=True)
    doc = {"command": "scripts/head_step_cost.py " + " ".join(sys.argv[1:]),
           "machine": machine_info(1), "reps": a.reps, "cold": a.cold, "rows": rows}
    print("wrote", write_result(ROOT / "results", f"head-step-cost-{a.name}", doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
