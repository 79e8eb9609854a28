"""Offline acceptance of several heads on the same held-out samples, in one JSON.

    .venv/bin/python scripts/eval_heads.py --features FEAT --name NAME HEAD [HEAD ...]
        [--max-samples 200] [--max-chain 8] [--start-from 0] [--all-samples]

Each HEAD is a checkpoint folder or a carried state (`train --carry DIR`, read as the head of
its step). `edgespec.training.train.eval_head` on FEAT's held-out samples (every 20th data
index; `--all-samples`: every sample, for features of held-out text no head trained on), the
same chain starts for every head (`--start-from`: only those at that position or later).
Writes results/eval-NAME.json (append-only) with each head's acceptance by position, expected
accepted length and training record.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--features", required=True)
    ap.add_argument("--name", required=True, help="results/eval-NAME.json")
    ap.add_argument("--max-samples", type=int, default=200)
    ap.add_argument("--max-chain", type=int, default=8)
    ap.add_argument("--start-from", type=int, default=0)
    ap.add_argument("--all-samples", action="store_true")
    a = ap.parse_args()

    import torch

    from edgespec.errors import EdgespecError
    from edgespec.io import write_result
    from edgespec.measure.bench import machine_info
    from edgespec.training.train import eval_head

    heads = {}
    try:
        for h in a.heads:
            heads[h] = eval_head(h, a.features, max_chain=a.max_chain, max_samples=a.max_samples,
                                 start_from=a.start_from, all_samples=a.all_samples)
            print(h, heads[h]["acceptance_by_position"][:4], flush=True)
    except EdgespecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc = {"made_by": f"scripts/eval_heads.py --features {a.features} --name {a.name} "
                      f"--max-samples {a.max_samples} --max-chain {a.max_chain} --start-from {a.start_from}"
                      f"{' --all-samples' if a.all_samples else ''} {' '.join(a.heads)}",
           "features": a.features, "heads": heads, "machine": machine_info(torch.get_num_threads())}
    print("wrote", write_result(ROOT / "results", f"eval-{a.name}", doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
