#!/usr/bin/env bash
# Offline acceptance of heads on held-out passages two ways: the passages' own text, and the
# target's greedy continuation of the same passages (the text the bench verifies online). A head
# trained on real text that scores lower on the target's own text has a data gap, not a runtime
# one; where both score alike, the gap between offline and online acceptance lies in the run.
#   scripts/written_text_eval.sh OUT NAME HEAD [HEAD ...]
# Passages: N_PROMPTS (default 48, half code and half prose) of the held-out side of the stdlib
# split, none a bench prompt's source, each of 900 characters or more (about 192 tokens of its own
# text or more), seeded; the first 32 tokens of each are the prompt, then
# 160 tokens, either the target's greedy continuation (`data --sample-share 0`) or the passage's
# own next tokens (`--new-tokens 0 --text-tokens 192`). Only chain starts past the prompt count
# (`--start-from 32`), over every sample (`--all-samples`). Writes results/eval-NAME-written.json
# and results/eval-NAME-text.json.
set -euo pipefail
out=${1:?run folder}; name=${2:?result name}; shift 2
n=${N_PROMPTS:-48}; es=.venv/bin/edgespec; py=.venv/bin/python
mkdir -p "$out"
[ -s "$out/prompts.jsonl" ] || $py - "$out/prompts.jsonl" "$n" <<'PY'
import json, random, sys
from pathlib import Path
from edgespec.io import atomic_write_text
from edgespec.prompts import DEFAULT_PROMPTS
from edgespec.training.data import held_out_passages
bench = {json.loads(l).get("source") for l in DEFAULT_PROMPTS.read_text().splitlines() if l.strip()}
pool = [p for p in held_out_passages() if p["source"] not in bench and len(p["text"]) >= 900]
n, rng = int(sys.argv[2]), random.Random(11)
picked = [p for kind in ("code", "prose") for p in rng.sample([q for q in pool if q["kind"] == kind], n // 2)]
atomic_write_text(Path(sys.argv[1]), "".join(json.dumps({"prompt": p["text"], "kind": p["kind"]}) + "\n" for p in picked))
PY
done_() { [ -f "$1/manifest.json" ] && grep -q '"complete": true' "$1/manifest.json"; }
done_ "$out/written" || $es data --target gemma3-270m --prompts "$out/prompts.jsonl" --out "$out/written" \
    --n-prompts "$n" --prompt-tokens 32 --new-tokens 160 --sample-share 0 --parallel 8
done_ "$out/text" || $es data --target gemma3-270m --prompts "$out/prompts.jsonl" --out "$out/text" \
    --n-prompts "$n" --new-tokens 0 --text-tokens 192
for kind in written text; do
    done_ "$out/$kind-kv" || $es extract --target gemma3-270m --data "$out/$kind" --out "$out/$kind-kv" \
        --dtype int4 --n-batch 256 --kv
    $py scripts/eval_heads.py --features "$out/$kind-kv" --name "$name-$kind" --all-samples \
        --start-from 32 --max-samples "$n" "$@"
done
