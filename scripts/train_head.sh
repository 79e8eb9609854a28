#!/usr/bin/env bash
# Reproduce a default head end to end from a clean checkout: data -> extract -> train -> eval.
#   scripts/train_head.sh gemma3-270m runs/gemma        (after `make setup`)
# Every stage resumes if killed; re-running skips finished stages.
set -euo pipefail
target=${1:?target name}; out=${2:?output folder}; shift 2
es=.venv/bin/edgespec
mkdir -p "$out"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$out/pipeline.log"; }
stamp "data"
$es data --target "$target" --out "$out/data" ${DATA_ARGS:-} | tee -a "$out/pipeline.log"
stamp "extract"
$es extract --target "$target" --data "$out/data" --out "$out/feat-int4" --dtype int4 | tee -a "$out/pipeline.log"
stamp "train"
if [ -f "$out/head/train_state.pt" ]; then resume=--resume; else resume=; fi
$es train --target "$target" --features "$out/feat-int4" --out "$out/head" $resume ${TRAIN_ARGS:-} "$@" | tee -a "$out/pipeline.log"
stamp "eval"
$es eval-head "$out/head" --features "$out/feat-int4" --json | tee "$out/eval.json"
stamp "done"
