#!/usr/bin/env bash
# Stage 4 of the long shared-KV run: the stage-3 head (scripts/long_run_stage3.sh, finished at
# step 4000, carried in carry/gemma3-270m-shared-kv-stage3) continued on text no earlier stage
# saw: the standard library's training passages are all used, so this stage reads the installed
# packages' training passages (`data --prompts site-packages`: docstrings and function bodies,
# tests and evaluation-set packages left out, the manifest names each file and licence).
#   scripts/long_run_stage4.sh runs/stage4     (rerun the same command on any machine: it continues)
# Recipe (fixed: the carried state is only valid for it): the first N_PROMPTS (default 2,000)
# passages of the seed-5 order of site-packages' training split, first 256 tokens each, no
# generation; one int4 extraction with the keys and values of layers 16 and 17; `train --arch
# shared-kv --init-from` the carried stage-3 state (its weights and draft vocabulary; fresh
# optimizer and schedule) at the earlier stages' learning rates for STEPS steps (default 1500),
# a checkpoint every 200 steps, each also written to carry/gemma3-270m-shared-kv-stage4. The
# passages depend on the installed packages: `make setup` pins only the direct dependencies, so
# install the versions carry/gemma3-270m-shared-kv-stage4/data-sources.json lists; the carried
# recipe's token hash refuses a resume on other text.
# When the run is done: eval-head of the finished head on this stage's held-out samples (JSON
# beside the run); `scripts/eval_heads.py` compares it with the stage-3 head on samples neither
# trained on.
set -euo pipefail
out=${1:?run folder}; steps=${STEPS:-1500}; n=${N_PROMPTS:-2000}
carry=${CARRY:-carry/gemma3-270m-shared-kv-stage4}
init=${INIT:-carry/gemma3-270m-shared-kv-stage3}
source "$(dirname "$0")/stage_steps.sh"
mkdir -p "$out"
stage_features "$out" "$n" 0 site-packages
stage_train "$out" "$steps" "$init" "$carry"
