#!/usr/bin/env bash
# Stage 5 of the long shared-KV run: mixed text. Stage 4 (scripts/long_run_stage4.sh, carried in
# carry/gemma3-270m-shared-kv-stage4) learned the installed packages' passages but lost accuracy
# on the standard library's held-out samples, so this stage continues it on both sources at once:
# the next N_PROMPTS (default 2,000) site-packages passages no earlier stage saw, read as one with
# stage 3's standard-library features again (their held-out samples stay held out).
#   scripts/long_run_stage5.sh runs/stage5 [runs/stage3]   (rerun the same command on any machine:
#   it continues; the second folder holds stage 3's data and features, made there if missing)
# Recipe (fixed: the carried state is only valid for it): passages 2,000 to 2,000 + N_PROMPTS of
# the seed-5 order of site-packages' training split, first 256 tokens each, no generation; stage
# 3's passages (3,262 from 5,000 of the standard library's seed-5 order, the same recipe); int4
# features with the keys and values of layers 16 and 17; `train --arch shared-kv --init-from` the
# carried stage-4 state (fresh optimizer and schedule) at the earlier stages' learning rates for
# STEPS steps (default 1500), a checkpoint every 200 steps, each also written to
# carry/gemma3-270m-shared-kv-stage5. The site-packages passages depend on the installed
# packages: install the versions the carry's data-sources.json lists; the carried recipe's token
# hash refuses a resume on other text.
set -euo pipefail
out=${1:?run folder}; stdlib=${2:-runs/stage3}; steps=${STEPS:-1500}; n=${N_PROMPTS:-2000}
carry=${CARRY:-carry/gemma3-270m-shared-kv-stage5}
init=${INIT:-carry/gemma3-270m-shared-kv-stage4}
source "$(dirname "$0")/stage_steps.sh"
mkdir -p "$out"
stage_features "$stdlib" 3262 5000
stage_features "$out" "$n" 2000 site-packages
stage_train "$out" "$steps" "$init" "$carry" "$stdlib/feat-kv"
