"""How fast `edgespec data` writes target-written text, one continuation at a time against
several per batched decode (`--parallel N`), in alternating rounds on the same prompts.

    .venv/bin/python scripts/data_speed.py --target gemma3-270m --parallel 1 4 8 --prompts 16 --rounds 2

Each round runs every setting in turn (a fresh data folder each, the default recipe: 48 prompt
tokens, 128 new, half sampled); the rate is new tokens over the whole call. Writes
results/data-speed-TARGET.json (append-only).
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--parallel", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--source", default="stdlib")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chat", action="store_true")
    a = ap.parse_args()
    runs: dict[int, list[dict]] = {p: [] for p in a.parallel}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for p in a.parallel:
                out = Path(tmp) / f"r{r}-p{p}"
                cmd = [sys.executable, "-m", "edgespec", "data", "--target", a.target, "--prompts", a.source,
                       "--n-prompts", str(a.prompts), "--parallel", str(p), "--out", str(out),
                       *(["--chat"] if a.chat else [])]
                t0 = time.perf_counter()
                done = subprocess.run(cmd, capture_output=True, text=True)
                wall = time.perf_counter() - t0
                if done.returncode:
                    sys.exit(f"failed: {' '.join(cmd)}\n{done.stderr[-2000:]}")
                g = json.loads((out / "manifest.json").read_text())["generation"]
                runs[p].append({**g, "wall_seconds": round(wall, 1)})
                print(f"round {r} parallel {p}: {g['new_tokens_per_s']} new tok/s", flush=True)
    sys.path.insert(0, str(ROOT))
    from edgespec.io import write_result
    from edgespec.measure.bench import machine_info

    base = statistics.median(x["new_tokens_per_s"] for x in runs[a.parallel[0]])
    rows = {str(p): {"median_new_tokens_per_s": statistics.median(x["new_tokens_per_s"] for x in v),
                     "vs_first": round(statistics.median(x["new_tokens_per_s"] for x in v) / base, 3),
                     "runs": v} for p, v in runs.items()}
    doc = {"target": a.target, "source": a.source, "prompts": a.prompts, "chat": a.chat,
           "recipe": "48 prompt tokens, 128 new tokens, half of the prompts sampled (T 0.8, top-p 0.95)",
           "rounds": a.rounds, "machine": machine_info(0), "rows": rows}
    print("wrote", write_result(ROOT / "results", f"data-speed-{a.target}", doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
