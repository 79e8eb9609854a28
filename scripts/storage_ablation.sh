#!/usr/bin/env bash
# Storage ablation: the same data and training steps on fp16, int8 and int4 hidden states.
#   scripts/storage_ablation.sh runs/gemma     (after scripts/train_head.sh made data + int4)
# int8 is re-quantized from the fp16 features; every head is evaluated on the fp16 held-out set.
set -euo pipefail
out=${1:?run folder}; steps=${STEPS:-400}
es=.venv/bin/edgespec
[ -f "$out/feat-fp16/manifest.json" ] || $es extract --target gemma3-270m --data "$out/data" --out "$out/feat-fp16" --dtype fp16
[ -f "$out/feat-int8/manifest.json" ] || .venv/bin/python -c "from edgespec.features import requantize; requantize('$out/feat-fp16', '$out/feat-int8', 'int8', 32)"
for d in fp16 int8 int4; do
  [ -f "$out/abl-$d/config.json" ] || $es train --target gemma3-270m --features "$out/feat-$d" --out "$out/abl-$d" --draft-vocab 4096 --steps "$steps"
  $es eval-head "$out/abl-$d" --features "$out/feat-fp16" --json > "$out/abl-$d.eval.json"
done
.venv/bin/python - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = {}
for d in ("fp16", "int8", "int4"):
    m = json.load(open(f"{out}/feat-{d}/manifest.json"))
    e = json.load(open(f"{out}/abl-{d}.eval.json"))
    rows[d] = {"bytes_per_token": m["bytes_per_token"], "expected_accepted": e["expected_accepted"],
               "acceptance_by_position": e["acceptance_by_position"]}
print(json.dumps({"steps": int(__import__("os").environ.get("STEPS", 400)), "rows": rows}, indent=1))
PY
