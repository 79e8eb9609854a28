#!/usr/bin/env bash
# Sliding vs global head attention on inputs longer than the target's 512-token window.
#   scripts/window_ablation.sh runs/long      -> results/ablation-window.json
# Long prompts: whole standard-library modules (train split), cut to 768 tokens, continued by the
# target for 64 more; features int4 (default transform). Two heads, same data, steps and seed:
# every layer sliding (window 512) or every layer global. Both are evaluated on held-out samples,
# on all chain starts and on the starts past the window (position >= 512).
set -euo pipefail
out=${1:?run folder}; steps=${STEPS:-150}
es=.venv/bin/edgespec
mkdir -p "$out"
[ -f "$out/prompts.jsonl" ] || .venv/bin/python - "$out/prompts.jsonl" <<'PY'
import json, sys, sysconfig
from pathlib import Path
from edgespec.training.data import split_of
from edgespec.io import atomic_write_text
root = Path(sysconfig.get_paths()["stdlib"])
rows = []
for p in sorted(root.glob("*.py")):
    text = p.read_text(encoding="utf-8", errors="replace")
    if split_of(p.name) == "train" and len(text) >= 6000:
        rows.append(json.dumps({"prompt": text[:6000], "kind": "code", "source": p.name}))
atomic_write_text(sys.argv[1], "\n".join(rows) + "\n")
PY
[ -f "$out/data/manifest.json" ] && grep -q '"complete": true' "$out/data/manifest.json" || \
  $es data --target gemma3-270m --prompts "$out/prompts.jsonl" --out "$out/data" --n-prompts 60 \
      --prompt-tokens 768 --new-tokens 64 --sample-share 0
[ -f "$out/feat/manifest.json" ] && grep -q '"complete": true' "$out/feat/manifest.json" || \
  $es extract --target gemma3-270m --data "$out/data" --out "$out/feat" --dtype int4
for lt in sliding,sliding global,global; do
  d="$out/head-${lt/,/-}"
  $es train --target gemma3-270m --features "$out/feat" --out "$d" --layer-types "$lt" \
      --steps "$steps" --batch 2 --seq-len 640 --resume  # a finished head is left as it is
  $es eval-head "$d" --features "$out/feat" --json > "$d.eval.json"
  $es eval-head "$d" --features "$out/feat" --start-from 512 --json > "$d.eval-past-window.json"
done
.venv/bin/python - "$out" "$steps" <<'PY'
import json, sys
from edgespec.io import write_result
out, steps = sys.argv[1], int(sys.argv[2])
rows = {}
for lt in ("sliding-sliding", "global-global"):
    c = json.load(open(f"{out}/head-{lt}/config.json"))
    rows[lt] = {"layer_types": c["head"]["layer_types"], "sliding_window": c["head"]["sliding_window"],
                "seconds": c["train"]["seconds"],
                "all_starts": json.load(open(f"{out}/head-{lt}.eval.json")),
                "past_window": json.load(open(f"{out}/head-{lt}.eval-past-window.json"))}
doc = {"steps": steps, "batch": 2, "seq_len": 640, "rows": rows,
       "note": "stdlib modules cut to 768 tokens + 64 target tokens (greedy), int4 features; "
               "eval on held-out samples of the same data",
       "machine": "AMD EPYC, 2 cores, torch 2.13.0 CPU"}
print("wrote", write_result("results", "ablation-window", doc))
print(json.dumps(doc, indent=1))
PY
