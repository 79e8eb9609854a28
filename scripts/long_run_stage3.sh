#!/usr/bin/env bash
# Stage 3 of the long shared-KV run: the stage-2 head (scripts/long_run_more.sh, finished at step
# 6000, its weights only in carry/gemma3-270m-shared-kv-more) continued on the standard-library
# passages no earlier stage saw: the same seeded shuffle (seed 5), passages 5,000 on
# (`data --skip-prompts 5000`; stages 1 and 2 took the first 1,500 and 5,000).
#   scripts/long_run_stage3.sh runs/stage3     (rerun the same command on any machine: it continues)
# Why only the new passages: a machine is not kept past a session and features are not carried
# (gigabytes), so every session re-extracts what it trains on (~400 tok/s here); a stage that
# trains on fresh passages only re-makes ~0.5M tokens (~20 min), not the 1.3M of every passage
# so far, and stage 2 found the head bound by its data (held-out acceptance rose with passages,
# not with epochs). Recipe (fixed: the carried state is only valid for it): passages 5,000 to
# 5,000 + N_PROMPTS (default 3,262: the rest of the standard library's training split on
# Python 3.11), first 256 tokens each, no generation; one int4 extraction with the keys and
# values of layers 16 and 17; `train --arch shared-kv --init-from` the carried stage-2 state
# (its weights and draft vocabulary; fresh optimizer and schedule) at stage 2's learning rates
# for STEPS steps (default 4000, about three epochs), a checkpoint every 200 steps, each also
# written to carry/gemma3-270m-shared-kv-stage3 (~1.5 s a step on 2 cores: a run spans
# sessions; each re-makes the data and features, then resumes).
# Carried: the finished run, step 4000 of 4000 (over two sessions; the command re-makes the
# features where they are missing, then finds the run done).
# When the run is done: eval-head of the finished head on this stage's held-out samples (JSON
# beside the run); `scripts/eval_heads.py --features runs/stage3/feat-kv ...` compares it with
# the stage-2 head on the same samples, which neither trained on.
set -euo pipefail
out=${1:?run folder}; steps=${STEPS:-4000}; n=${N_PROMPTS:-3262}
carry=${CARRY:-carry/gemma3-270m-shared-kv-stage3}
init=${INIT:-carry/gemma3-270m-shared-kv-more}
source "$(dirname "$0")/stage_steps.sh"
mkdir -p "$out"
stage_features "$out" "$n" 5000
stage_train "$out" "$steps" "$init" "$carry"
