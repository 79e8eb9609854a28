#!/usr/bin/env bash
# Head ablation at an equal budget: what to change in the MTP head's recipe, on the same data.
#   scripts/head_ablation.sh runs/head-abl      -> results/ablation-head-gemma3-270m.json
# (STEPS, N_PROMPTS: steps per head, default 400; passages, default 1000; ROWS: which heads,
#  default the first four below; FEAT: what the extraction stores besides the final hidden
#  states, "layers" (default: layers 2, n/2 and n-3, for eagle3) or "kv" (the keys and values
#  shared-kv reads); STEM: the results file, default ablation-head-gemma3-270m)
# Real text only (site-packages and standard-library passages, first 256 tokens each, no
# generation), one int4 extraction that also stores the inputs of layers 2, n/2 and n-3, so one
# folder feeds every head. Heads, same steps, batch, seed and features:
#   mtp-kl        the default recipe (MTP head on the final hidden state, forward KL, 4,096 tokens)
#   mtp-topk      the same plus 1.0 x cross-entropy on the target's 10 most likely draft tokens
#   mtp-vocab8k   the same as mtp-kl with an 8,192-token draft vocabulary
#   eagle3        llama.cpp's EAGLE-3 graph on the fused three-layer features
#   mtp-kl-seed1  mtp-kl with another seed (initial weights and batch order): the noise floor
#   mtp-topk-vocab8k  the top-K term and the 8,192-token vocabulary together
#   shared-kv     the head that attends the target's KV cache (FEAT=kv)
#   shared-kv-norms  the same with its two inputs RMS-normed, as the MTP head's are (FEAT=kv)
# All are scored with `eval-head` on the folder's held-out samples (acceptance against the
# target's full-vocabulary argmax). Every stage resumes: rerun the same command after a stop.
set -euo pipefail
out=${1:?run folder}; steps=${STEPS:-400}; n=${N_PROMPTS:-1000}; target=gemma3-270m
stem=${STEM:-ablation-head-gemma3-270m}
case ${FEAT:-layers} in
  layers) feat_args="--layers eagle3"; feat="$out/feat" ;;
  kv) feat_args="--kv"; feat="$out/feat-kv" ;;
  *) echo "head_ablation.sh: FEAT must be layers or kv" >&2; exit 2 ;;
esac
es=.venv/bin/edgespec
declare -A extra=([mtp-kl]="" [mtp-topk]="--topk-weight 1 --topk 10"
                  [mtp-vocab8k]="--draft-vocab 8192" [eagle3]="--arch eagle3"
                  [mtp-kl-seed1]="--seed 1"
                  [mtp-topk-vocab8k]="--topk-weight 1 --topk 10 --draft-vocab 8192"
                  [shared-kv]="--arch shared-kv"
                  [shared-kv-norms]="--arch shared-kv --input-norms")
rows=${ROWS:-mtp-kl mtp-topk mtp-vocab8k eagle3}
for r in $rows; do
  [ -n "${extra[$r]+set}" ] || { echo "head_ablation.sh: unknown row '$r' (known: ${!extra[*]})" >&2; exit 2; }
done
mkdir -p "$out"
done_() { [ -f "$1/manifest.json" ] && grep -q '"complete": true' "$1/manifest.json"; }
done_ "$out/data" || $es data --target $target --out "$out/data" --prompts site-packages stdlib \
    --new-tokens 0 --text-tokens 256 --n-prompts "$n" --seed 3
# shellcheck disable=SC2086  # the feature flags are meant to split
done_ "$feat" || $es extract --target $target --data "$out/data" --out "$feat" \
    --dtype int4 --n-batch 256 $feat_args
mkdir -p "$out/$steps"  # heads by step budget: another STEPS never reuses (or extends) these
for r in $rows; do
  d="$out/$steps/$r"
  # shellcheck disable=SC2086  # the extra flags are meant to split
  $es train --target $target --features "$feat" --out "$d" --steps "$steps" --seed 0 \
      --resume ${extra[$r]}  # a finished head is left as it is (a later --seed wins)
  [ -s "$d.eval.json" ] || { $es eval-head "$d" --features "$feat" --json > "$d.eval.tmp" \
      && mv "$d.eval.tmp" "$d.eval.json"; }
done
.venv/bin/python - "$out" "$steps" "$feat" "$stem" $rows <<'PY'
import json, platform, sys
from edgespec.io import write_result
from edgespec.runtime.policies import cpu_model
out, steps, feat_dir, stem, names = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
feat = json.load(open(f"{feat_dir}/manifest.json"))
rows = {}
for r in names:
    c = json.load(open(f"{out}/{steps}/{r}/config.json"))
    t, e = c["train"], json.load(open(f"{out}/{steps}/{r}.eval.json"))
    rows[r] = {"arch": t["arch"], "draft_vocab": c["draft_vocab"]["size"],
               "draft_vocab_coverage": c["draft_vocab"]["coverage"],
               "trainable_parameters": t.get("trainable_parameters"),
               "topk_weight": t.get("topk_weight"),
               "topk": t.get("topk"), "seed": t.get("seed"), "steps": t["steps_done"],
               "seconds": t["seconds"],
               "train_tokens": t.get("train_tokens"),
               "final_loss": t["history"][-1]["loss"] if t.get("history") else None,
               "acceptance_by_position": e["acceptance_by_position"],
               "expected_accepted": e["expected_accepted"],
               "eval": {k: v for k, v in e.items()
                        if k not in ("acceptance_by_position", "expected_accepted")}}
doc = {"target": "gemma3-270m", "steps": steps, "rows": rows,
       "features": {"dtype": feat.get("dtype"), "layers": feat.get("layers"),
                    "kv_layers": feat.get("kv_layers", []), "bytes_per_token": feat.get("bytes_per_token"),
                    "tokens": feat.get("tokens"), "samples": feat.get("samples")},
       "data": "edgespec data --prompts site-packages stdlib --new-tokens 0 --text-tokens 256 "
               f"--n-prompts {json.load(open(f'{out}/data/manifest.json'))['config']['n_prompts']} --seed 3",
       "note": "same features, steps, batch and seed (0 unless the row says) for every head; "
               "eval-head on the folder's held-out samples",
       "machine": f"{cpu_model()}, {platform.machine()}, 2 cores, torch CPU, Python {platform.python_version()}"}
print("wrote", write_result("results", stem, doc))
print(json.dumps({r: (v["acceptance_by_position"][0], v["expected_accepted"].get("4"), v["seconds"])
                  for r, v in rows.items()}, indent=1))
PY
