#!/usr/bin/env bash
# Export a trained head in every quant type, check each against the trained torch head, and
# ship the chosen ones (GGUF q8_0 and ONNX int8 by default) inside the package.
#   scripts/ship_head.sh gemma3-270m runs/gemma/head-muon runs/gemma/feat-fp16
# Writes results/export-head-TARGET.json (all exports) and runtime/heads/TARGET/ (shipped files
# plus export-check.json with their reports).
set -euo pipefail
target=${1:?target}; ckpt=${2:?checkpoint folder}; feats=${3:?features folder for the check}
ship=${SHIP:-"head-q8_0.gguf head-int8.onnx"}
es=.venv/bin/edgespec
work=$(dirname "$ckpt")/exports-$(basename "$ckpt")
mkdir -p "$work"
for q in f16 q8_0 q4_0; do
  $es export gguf "$ckpt" --quant $q --out "$work/head-$q.gguf" --check --features "$feats" --json > "$work/head-$q.gguf.json"
done
for q in fp32 int8 int4; do
  $es export onnx "$ckpt" --quant $q --out "$work/head-$q.onnx" --check --features "$feats" --json > "$work/head-$q.onnx.json"
done
.venv/bin/python - "$target" "$work" $ship <<'PY'
import json, shutil, sys
from pathlib import Path
from edgespec.io import atomic_write_text, write_result
target, work, ship = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
reports = [json.loads(p.read_text()) for p in sorted(work.glob("head-*.json"))]
for r in reports:
    r["shipped"] = Path(r["out"]).name in ship
print("wrote", write_result("results", f"export-head-{target}", {"target": target, "exports": reports}))
dest = Path("runtime/heads") / target
dest.mkdir(parents=True, exist_ok=True)
for old in dest.glob("head-*"):  # the MTP head's files only: the low-rank basis and an EAGLE-3 head stay
    old.unlink()
shipped = []
for r in reports:
    if r["shipped"]:
        shutil.copy(r["out"], dest / Path(r["out"]).name)
        shipped.append(dict(r, out=str(dest / Path(r["out"]).name)))
atomic_write_text(dest / "export-check.json", json.dumps({"target": target, "exports": shipped}, indent=1) + "\n")
for r in reports:
    c = r["check"]
    print(f"{Path(r['out']).name:18s} {r['bytes']/2**20:6.1f} MB  top1 {c['top1_agreement']:.4f}  "
          f"max err {c['max_logit_error']:.3f}  {c['ms_per_draft_step']:.2f} ms/step  {'shipped' if r['shipped'] else ''}")
PY
