# The steps every stage of the long shared-KV run takes (scripts/long_run_more.sh and
# scripts/long_run_stage3.sh to long_run_stage5.sh source this; each gives its own recipe). Each step is skipped where
# a finished one is on disk, so rerunning a stage's command on any machine continues it.
es=.venv/bin/edgespec
target=gemma3-270m
done_() { [ -f "$1/manifest.json" ] && grep -q '"complete": true' "$1/manifest.json"; }

# stage_features OUT N SKIP [SOURCE]: the data (passages SKIP to SKIP + N of the seed-5 order of
# SOURCE's training passages, `stdlib` unless given, first 256 tokens each, no generation) and
# its int4 features with the keys and values of layers 16 and 17.
stage_features() {
    done_ "$1/data" || $es data --target $target --out "$1/data" --prompts "${4:-stdlib}" \
        --new-tokens 0 --text-tokens 256 --n-prompts "$2" --skip-prompts "$3" --seed 5
    done_ "$1/feat-kv" || $es extract --target $target --data "$1/data" --out "$1/feat-kv" \
        --dtype int4 --n-batch 256 --kv
}

# stage_train OUT STEPS INIT CARRY [FEATURES ...]: `train --arch shared-kv --init-from INIT` at a
# quarter of the default learning rates on OUT's features (and any further FEATURES folders,
# read as one with them), a checkpoint every 200 steps, each carried to CARRY (resumed from
# there, or from OUT/head, where a state is), then eval-head on OUT's held-out samples.
stage_train() {
    local resume=()
    if [ -f "$4/carry.json" ] || [ -f "$1/head/train_state.pt" ]; then resume=(--resume); fi
    $es train --target $target --features "$1/feat-kv" "${@:5}" --out "$1/head" --steps "$2" --seed 0 \
        --arch shared-kv --init-from "$3" --optimizer muon --lr 5e-4 --muon-lr 5e-3 \
        --save-every 200 --carry "$4" "${resume[@]}"
    [ -s "$1/head.eval.json" ] || { $es eval-head "$1/head" --features "$1/feat-kv" --json \
        > "$1/head.eval.tmp" && mv "$1/head.eval.tmp" "$1/head.eval.json"; }
}
