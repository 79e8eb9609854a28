"""How often greedy text generated concurrently on `serve --parallel N` slots equals the same
request run alone, and whether every concurrent reply is the target's own greedy text.

    scripts/parallel_agreement.py gemma3-270m --slots 8 --prompts 16 --json results/x.json

For each drafter: the bench prompts (their first `--prompts`, as `edgespec bench` tokenizes
them) run one at a time on a one-sequence engine, then in groups of `--slots` at once on the
slots of one batched engine (runtime/batching.py). Reported per drafter: replies identical
token for token, the median first position where a differing pair parts, and the share of the
concurrent replies' tokens that are the argmax of a plain full-LM-head engine fed that reply
(teacher-forced: a reply built on another request's text would score near zero; batch
numerics flip only near-ties).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.io import atomic_write_text


def _greedy(llm, ids: list[int], max_tokens: int) -> list[int]:
    gen = llm._run(list(ids), max_tokens, None, None, temperature=0.0)
    for _ in gen:
        pass
    return list(gen.token_ids)


def measure(target: str, slots: int, n_prompts: int, max_tokens: int, drafts: list[str],
            n_ctx: int = 1024) -> dict:
    from edgespec.measure.bench import machine_info, prompt_ids
    from edgespec.prompts import DEFAULT_PROMPTS, read_prompts
    from edgespec.runtime.api import SpeculativeLlama
    from edgespec.runtime.llama_target import LlamaTarget
    from edgespec.runtime.server import open_slots
    from edgespec.runtime.spec import SpecConfig

    ref = LlamaTarget(target, n_ctx=n_ctx, lm_head="full")
    prompts = prompt_ids(read_prompts(DEFAULT_PROMPTS)[:n_prompts], ref, max_tokens, n_ctx)
    out = {"target": ref.spec.name, "slots": slots, "prompts": len(prompts),
           "max_tokens": max_tokens, "machine": machine_info(ref.n_threads), "drafts": {}}
    for draft in drafts:
        d = None if draft == "none" else draft
        solo = SpeculativeLlama(target, n_ctx=n_ctx, draft=d)
        alone = [_greedy(solo, p, max_tokens) for p in prompts]
        solo.close()
        llms, batcher = open_slots(target, SpecConfig(draft=d), slots, n_ctx, None)
        together: list[list[int] | None] = [None] * len(prompts)
        t0 = time.perf_counter()
        for g in range(0, len(prompts), slots):
            def run(i: int, s: int) -> None:
                together[i] = _greedy(llms[s], prompts[i], max_tokens)
                batcher.deactivate(s)

            threads = [threading.Thread(target=run, args=(i, i - g))
                       for i in range(g, min(g + slots, len(prompts)))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wall = time.perf_counter() - t0
        rows = batcher.rows / max(1, batcher.batches)
        batcher.engine.close()
        same, parts, agree = 0, [], []
        for p, a, b in zip(prompts, alone, together):
            if a == b:
                same += 1
            else:
                parts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
            ref.reset()
            seq = (list(p) + b)[:n_ctx]
            logits = np.concatenate([ref.decode(seq[s:s + 256], all_logits=True)[0]
                                     for s in range(0, len(seq), 256)])
            picks = np.argmax(logits[len(p) - 1:len(seq) - 1], axis=1)
            agree.append(float(np.mean(picks == np.asarray(b[:len(picks)]))) if len(picks) else 1.0)
        out["drafts"][draft] = {
            "identical": same, "of": len(prompts),
            "first_difference_median": statistics.median(parts) if parts else None,
            "target_argmax_share_mean": round(float(np.mean(agree)), 4),
            "target_argmax_share_min": round(float(np.min(agree)), 4),
            "rows_per_batch": round(rows, 3), "concurrent_wall_s": round(wall, 2)}
        print(f"{draft}: {same}/{len(prompts)} identical; target argmax share mean "
              f"{np.mean(agree):.4f}, min {np.min(agree):.4f}", file=sys.stderr)
    ref.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--drafts", default="default,none")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    if Path(a.json).exists():
        print(f"edgespec: error: {a.json} exists; results are append-only, pick a new name",
              file=sys.stderr)
        return 2
    try:
        r = measure(a.target, a.slots, a.prompts, a.max_tokens, a.drafts.split(","))
    except EdgespecError as e:
        print(f"edgespec: error: {e}", file=sys.stderr)
        return 2
    atomic_write_text(a.json, json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
