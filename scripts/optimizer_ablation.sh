#!/usr/bin/env bash
# Optimizer ablation: AdamW vs Muon on the same int4 features, steps and seed.
#   scripts/optimizer_ablation.sh runs/gemma      (after scripts/storage_ablation.sh)
# Both heads are evaluated on the fp16 held-out features; writes results/ablation-optimizer.json.
set -euo pipefail
out=${1:?run folder}; steps=${STEPS:-300}
es=.venv/bin/edgespec
for o in adamw muon; do
  d="$out/opt-$o"
  [ -f "$d/config.json" ] || $es train --target gemma3-270m --features "$out/feat-int4" --out "$d" \
      --draft-vocab 4096 --steps "$steps" --optimizer "$o"
  $es eval-head "$d" --features "$out/feat-fp16" --json > "$d.eval.json"
done
.venv/bin/python - "$out" "$steps" <<'PY'
import json, sys
from edgespec.io import write_result
out, steps = sys.argv[1], int(sys.argv[2])
rows = {}
for o in ("adamw", "muon"):
    c = json.load(open(f"{out}/opt-{o}/config.json"))["train"]
    e = json.load(open(f"{out}/opt-{o}.eval.json"))
    rows[o] = {"lr": c["muon_lr"] if o == "muon" else c["lr"], "seconds": c["seconds"],
               "final_loss": c["history"][-1]["loss"],
               "expected_accepted": e["expected_accepted"],
               "acceptance_by_position": e["acceptance_by_position"]}
doc = {"steps": steps, "features": "int4", "eval_features": "fp16 held-out", "rows": rows}
print("wrote", write_result("results", "ablation-optimizer", doc))
print(json.dumps(doc, indent=1))
PY
