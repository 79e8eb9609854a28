#!/usr/bin/env bash
# Stage 2 of the long shared-KV run: the finished head of scripts/long_run.sh (6,000 steps on
# 1,500 standard-library passages, which it overfits: agreement ~0.85 on its training samples,
# 0.61 at position 1 on held-out ones) continued on more data of the same kind.
#   scripts/long_run_more.sh runs/long-more     (rerun the same command on any machine: it continues)
# Recipe (fixed: the carried state is only valid for it): the first N_PROMPTS (default 5,000)
# of the same seeded shuffle of standard-library passages, so the stage-1 passages are its first
# 1,500 and every data index keeps its train/held-out side (no held-out passage of either stage
# was trained on); first 256 tokens each, no generation; one int4 extraction with the keys and
# values of layers 16 and 17; `train --arch shared-kv --init-from` the stage-1 head (its weights
# and draft vocabulary, fresh optimizer and schedule) at a quarter of the default learning
# rates (at the defaults the first 150 steps undid much of what stage 1 learned: loss 0.4-0.7
# rose to 1.2) for STEPS steps (default 6000), a
# checkpoint every 200 steps, each also written to carry/gemma3-270m-shared-kv-more. Only the
# first start needs the stage-1 head (scripts/long_run.sh re-makes it from its own carried
# state); once this stage carries a step, a fresh machine re-makes the features and resumes.
# When the run is done: eval-head on the folder's held-out samples (its JSON beside the run).
# Finished (step 6000 of 6000): its head ships as runtime/heads/gemma3-270m/shared-kv-int8.onnx;
# the carried state stays as the only copy of its weights, for a next stage's --init-from.
set -euo pipefail
out=${1:?run folder}; steps=${STEPS:-6000}; n=${N_PROMPTS:-5000}
carry=${CARRY:-carry/gemma3-270m-shared-kv-more}
stage1=${STAGE1:-runs/long}
source "$(dirname "$0")/stage_steps.sh"
mkdir -p "$out"
if [ ! -f "$carry/carry.json" ] && [ ! -f "$out/head/train_state.pt" ]; then
    [ -f "$stage1/head/config.json" ] || scripts/long_run.sh "$stage1"
fi
stage_features "$out" "$n" 0
stage_train "$out" "$steps" "$stage1/head" "$carry"
