"""Data-scaling curve: the same head recipe trained on growing subsets of one pool of features,
each head evaluated offline on the same held-out features.

    .venv/bin/python scripts/scaling_curve.py --target gemma3-270m \
        --features runs/g/feat-a runs/g/feat-b --eval-features runs/g/feat-a \
        --points 65000 250000 all --steps 800 --runs runs/g/scale

Each point is `edgespec train --max-train-tokens N` (a fixed random subset of the pool's training
samples; `all` = the whole pool), trained into RUNS/tokens-N (resumed where a run was killed,
skipped where finished), then `edgespec eval-head --features EVAL`. Training never sees a sample
equal to a held-out one of any pool folder. `--extra LABEL=HEAD` adds a head trained elsewhere
(its own recorded data; a head continued with `train --init-from` counts the steps and seconds
of the runs it continued). Writes results/scaling-TARGET.json (append-only: -run2, ...).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ES = [sys.executable, "-m", "edgespec"]


def run(cmd: list[str], log: Path) -> str:
    print("+", " ".join(cmd), flush=True)
    with open(log, "a") as err:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    if r.returncode:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}; see {log}")
    return r.stdout


def lineage(head: Path) -> tuple[int, float, list[str]]:
    """Steps and seconds of a head's training, counting the runs it was continued from
    (`train --init-from`), and those runs' folders."""
    t = json.loads((head / "config.json").read_text())["train"]
    steps, secs, chain = t["steps_done"], t["seconds"], []
    while t.get("init_from"):
        chain.append(t["init_from"])
        src = Path(t["init_from"]) / "config.json"
        if not src.exists():  # the earlier run's folder is gone: count what is known
            chain.append("(not found: earlier steps not counted)")
            break
        t = json.loads(src.read_text())["train"]
        steps, secs = steps + t["steps_done"], secs + t["seconds"]
    return steps, secs, chain


def row(label: str, head: Path, ev: dict) -> dict:
    c = json.loads((head / "config.json").read_text())
    t = c["train"]
    steps, secs, chain = lineage(head)
    return {"label": label, "head": str(head), "max_train_tokens": t.get("max_train_tokens", 0),
            "train_tokens": t["train_tokens"], "train_samples": t["train_samples"],
            "steps": steps, "batch": t["batch"], "seq_len": t["seq_len"],
            "train_seconds": secs, "features": t["features"],
            **({"continued_from": chain, "steps_last_run": t["steps_done"]} if chain else {}),
            "draft_vocab": c["draft_vocab"]["size"], "draft_vocab_coverage": c["draft_vocab"]["coverage"],
            "eval": ev}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--features", nargs="+", required=True, help="the training pool")
    ap.add_argument("--eval-features", required=True, help="held-out samples of this folder are scored")
    ap.add_argument("--points", nargs="+", required=True, help="token budgets, or 'all'")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--runs", required=True)
    ap.add_argument("--extra", action="append", default=[], help="LABEL=HEAD_FOLDER")
    ap.add_argument("--train-args", default="", help="more `edgespec train` arguments")
    a = ap.parse_args()
    runs = Path(a.runs)
    runs.mkdir(parents=True, exist_ok=True)
    log = runs / "scaling.log"
    rows = []
    for p in a.points:
        head = runs / f"tokens-{p}"
        cmd = [*ES, "train", "--target", a.target, "--features", *a.features, "--out", str(head),
               "--steps", str(a.steps), *a.train_args.split()]
        if p != "all":
            cmd += ["--max-train-tokens", str(int(p))]
        if (head / "train_state.pt").exists():
            cmd.append("--resume")
        t0 = time.time()
        run(cmd, log)
        print(f"trained {head} ({time.time() - t0:.0f} s this call)", flush=True)
        ev = json.loads(run([*ES, "eval-head", str(head), "--features", a.eval_features, "--json"], log))
        rows.append(row(str(p), head, ev))
    for e in a.extra:
        label, head = e.split("=", 1)
        ev = json.loads(run([*ES, "eval-head", head, "--features", a.eval_features, "--json"], log))
        rows.append(row(label, Path(head), ev))
    pool = []
    for f in a.features:
        m = json.loads((Path(f) / "manifest.json").read_text())
        pool.append({"folder": f, "tokens": m["tokens"], "samples": m["samples"], "dtype": m["dtype"],
                     "bytes_per_token": m["bytes_per_token"], "extract_tokens_per_s": m["tokens_per_s"],
                     "data": m.get("data")})
    sys.path.insert(0, str(ROOT))
    from edgespec.io import write_result
    from edgespec.measure.bench import machine_info

    machine = machine_info(0)
    machine["versions"]["torch"] = __import__("torch").__version__
    doc = {"target": a.target, "steps": a.steps, "pool": pool, "eval_features": a.eval_features,
           "machine": machine, "rows": sorted(rows, key=lambda r: r["train_tokens"])}
    print("wrote", write_result(ROOT / "results", f"scaling-{a.target}", doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
