#!/usr/bin/env bash
# Storage ablation: the same data and training steps on fp16, int8 and int4 hidden states.
#   scripts/storage_ablation.sh runs/gemma   (after scripts/train_head.sh made the data)
# Writes results/ablation-storage.json.
# int8 and int4 are re-quantized from the fp16 features with the default transform (channel
# scales + DCT); `int4-plain` is the int4 folder extracted without it. Every head is evaluated on
# the fp16 held-out set.
set -euo pipefail
out=${1:?run folder}; steps=${STEPS:-300}
es=.venv/bin/edgespec
[ -f "$out/feat-fp16/manifest.json" ] || $es extract --target gemma3-270m --data "$out/data" --out "$out/feat-fp16" --dtype fp16
[ -f "$out/feat-int4-plain/manifest.json" ] || $es extract --target gemma3-270m --data "$out/data" --out "$out/feat-int4-plain" --dtype int4 --transform none
for d in int8 int4; do
  [ -f "$out/feat-$d-dct/manifest.json" ] || .venv/bin/python -c "from edgespec.training.features import requantize; requantize('$out/feat-fp16', '$out/feat-$d-dct', '$d', 32)"
done
for d in fp16 int8-dct int4-dct int4-plain; do
  [ -f "$out/abl-$d/config.json" ] || $es train --target gemma3-270m --features "$out/feat-$d" --out "$out/abl-$d" --draft-vocab 4096 --steps "$steps"
  $es eval-head "$out/abl-$d" --features "$out/feat-fp16" --json > "$out/abl-$d.eval.json"
done
.venv/bin/python - "$out" "$steps" <<'PY'
import json, sys
from edgespec.io import write_result
out, steps = sys.argv[1], int(sys.argv[2])
rows = {}
for d in ("fp16", "int8-dct", "int4-dct", "int4-plain"):
    m = json.load(open(f"{out}/feat-{d}/manifest.json"))
    e = json.load(open(f"{out}/abl-{d}.eval.json"))
    rows[d] = {"bytes_per_token": m["bytes_per_token"], "transform": (m.get("transform") or {}).get("kind", "none"),
               "expected_accepted": e["expected_accepted"], "acceptance_by_position": e["acceptance_by_position"]}
doc = {"steps": steps, "rows": rows,
       "note": "fp16 extracted with `edgespec extract --dtype fp16`; int8-dct/int4-dct re-quantized from it "
               "(group 32, channel scales + DCT); int4-plain extracted directly with --transform none "
               "(group 32); heads: Muon, batch 4x96, unroll 4, draft vocab 4096; eval-head on the fp16 "
               "held-out features",
       "machine": "AMD EPYC, 2 cores, torch 2.13.0 CPU"}
print("wrote", write_result("results", "ablation-storage", doc))
print(json.dumps(doc, indent=1))
PY
