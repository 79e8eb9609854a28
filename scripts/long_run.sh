#!/usr/bin/env bash
# A head training run longer than one machine is kept: the shared-KV head for Gemma 3 270M on
# more data than the ablations, its resumable state carried in the repository.
#   scripts/long_run.sh runs/long     (rerun the same command on any machine: it continues)
# Recipe (fixed: the carried state is only valid for it): standard-library passages of Python
# 3.11 (the same on every machine of this kind; site-packages would follow whatever versions
# pip resolved), first 256 tokens each, no generation; one int4 extraction storing the keys and
# values of layers 16 and 17; `train --arch shared-kv --input-norms` for STEPS steps (default
# 6000, planned for several sessions: ~1.1 s a step on 2 cores), a checkpoint every 200 steps,
# each also written to carry/gemma3-270m-shared-kv (fp16 weights, bf16 optimizer state, files
# < 20 MB) for committing. Data and features are deterministic, so a fresh machine re-makes them
# and `--resume --carry` goes on from the committed step. When the run is done: eval-head on
# the folder's held-out samples (its JSON beside the run).
# Finished (step 6000 of 6000): its head ships as runtime/heads/gemma3-270m/shared-kv-int8.onnx
# and its carried state left the repository with that (it is in the history at commit 80cbe62:
# `git checkout 80cbe62 -- carry/gemma3-270m-shared-kv` brings it back, and this command then
# re-makes the head from it); scripts/long_run_more.sh continues the head.
set -euo pipefail
out=${1:?run folder}; steps=${STEPS:-6000}; n=${N_PROMPTS:-1500}; target=gemma3-270m
carry=${CARRY:-carry/gemma3-270m-shared-kv}
es=.venv/bin/edgespec
mkdir -p "$out"
done_() { [ -f "$1/manifest.json" ] && grep -q '"complete": true' "$1/manifest.json"; }
done_ "$out/data" || $es data --target $target --out "$out/data" --prompts stdlib \
    --new-tokens 0 --text-tokens 256 --n-prompts "$n" --seed 5
done_ "$out/feat-kv" || $es extract --target $target --data "$out/data" --out "$out/feat-kv" \
    --dtype int4 --n-batch 256 --kv
resume=()
[ -f "$carry/carry.json" ] || [ -f "$out/head/train_state.pt" ] && resume=(--resume)
$es train --target $target --features "$out/feat-kv" --out "$out/head" --steps "$steps" --seed 0 \
    --arch shared-kv --input-norms --save-every 200 --carry "$carry" "${resume[@]}"
[ -s "$out/head.eval.json" ] || { $es eval-head "$out/head" --features "$out/feat-kv" --json \
    > "$out/head.eval.tmp" && mv "$out/head.eval.tmp" "$out/head.eval.json"; }
