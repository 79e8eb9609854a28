"""An edgespec EAGLE-3 head inside stock llama.cpp, checked against edgespec's own reading of it.

    scripts/eagle3_check.py smollm2-135m runtime/heads/smollm2-135m/eagle3-q8_0.gguf --json OUT

Stock `llama-server` (from `make llama-tools`) decodes each prompt greedily twice: plain, and with
`--spec-type draft-eagle3 -md HEAD` (its default 3 drafts per step). Its `/metrics` counters give
the drafted and accepted tokens of every request. edgespec then runs the target over the same
text (prompt + the server's continuation), reads the three layer inputs the head was trained on,
and replays llama.cpp's draft loop with the file's own weights read back into torch
(`greedy_draft_walk`): the two acceptance figures must agree up to llama.cpp's batch numerics.
Also reported: how often the speculative text equals the server's plain text, and both speeds.
"""

from __future__ import annotations

import time
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.measure.peers import LlamaServer, server_configs


def tok_s(row: dict) -> float | None:
    """A request's generation speed (None where it generated nothing: an immediate end)."""
    return round(row["tokens"] / row["decode_s"], 2) if row["tokens"] and row["decode_s"] > 0 else None


def eagle3_in_llama_server(target: str, head_gguf: str | Path, prompts: list[str],
                           n_predict: int = 96, n_ctx: int = 1024, threads: int | None = None) -> dict:
    from edgespec.exporters.eagle3_gguf import read_eagle3_gguf
    from edgespec.runtime.llama_target import LlamaTarget

    head, draft_ids, info = read_eagle3_gguf(head_gguf)
    eng = LlamaTarget(target, n_ctx=n_ctx, n_threads=threads, lm_head="full", probe=True, n_batch=64)
    try:
        return _check(eng, target, head, draft_ids, info, head_gguf, prompts, n_predict, n_ctx)
    finally:
        eng.close()


def greedy_runs(eng, configs: dict[str, list[str]], ids: list[list[int]], n_predict: int, n_ctx: int,
                tool: str = "llama-server") -> dict[str, list[dict]]:
    """Each configuration's llama-server (`tool`) on the engine's file decodes every prompt
    greedily; per request its result and its speculation counters (from /metrics)."""
    runs: dict[str, list[dict]] = {}
    for name, extra in configs.items():
        with LlamaServer(eng.model_file, extra, eng.n_threads, n_ctx, tool=tool) as srv:
            srv.complete(ids[0][:16], 8, 0.0, 0)  # page the model in
            rows = []
            for p in ids:
                time.sleep(0.3)  # counters update as the slot is released
                before = srv.spec_counters()
                r = srv.complete(p, n_predict, 0.0, 0)
                time.sleep(0.3)
                after = srv.spec_counters()
                r.update({k: after[k] - before[k] for k in after})
                rows.append(r)
            runs[name] = rows
    return runs


def _check(eng, target, head, draft_ids, info, head_gguf, prompts, n_predict, n_ctx) -> dict:
    from edgespec.targets import embedding_rows
    from edgespec.training.eagle3 import greedy_draft_walk

    if info.fingerprint != eng.spec.tokenizer_fingerprint:
        raise EdgespecError(f"{head_gguf} is a head for another target")
    ids = [eng.tokenize(p) for p in prompts]
    configs = server_configs(head_gguf)
    runs = greedy_runs(eng, {n: configs[n] for n in ("none", "draft-eagle3")}, ids, n_predict, n_ctx)
    embed = embedding_rows(eng.spec)
    per = []
    for p, plain, spec in zip(ids, runs["none"], runs["draft-eagle3"]):
        seq = p + spec["token_ids"]
        eng.reset()
        hid = eng.hidden_states(seq, layers=tuple(head.c.target_layers))
        walk = greedy_draft_walk(head, draft_ids, seq, hid, embed, start=len(p) - 1)
        per.append({"prompt_tokens": len(p), "tokens": spec["tokens"],
                    "llama_drafted": spec["draft_n"], "llama_accepted": spec["draft_n_accepted"],
                    "llama_acceptance": round(spec["draft_n_accepted"] / max(spec["draft_n"], 1), 4),
                    "edgespec_drafted": walk["drafted"], "edgespec_accepted": walk["accepted"],
                    "edgespec_acceptance": walk["acceptance"],
                    "same_text_as_plain": spec["token_ids"] == plain["token_ids"],
                    "tok_s_plain": tok_s(plain), "tok_s_eagle3": tok_s(spec)})

    def total(key):
        return sum(r[key] for r in per)

    dec = {n: sum(r["decode_s"] for r in rows) for n, rows in runs.items()}
    tok = {n: sum(r["tokens"] for r in rows) for n, rows in runs.items()}
    return {"target": target, "head": str(head_gguf), "prompts": len(per), "n_predict": n_predict,
            "llama_acceptance": round(total("llama_accepted") / max(total("llama_drafted"), 1), 4),
            "edgespec_acceptance": round(total("edgespec_accepted") / max(total("edgespec_drafted"), 1), 4),
            "same_text_as_plain_share": round(sum(r["same_text_as_plain"] for r in per) / len(per), 4),
            "tok_s_plain": round(tok["none"] / max(dec["none"], 1e-9), 2),
            "tok_s_eagle3": round(tok["draft-eagle3"] / max(dec["draft-eagle3"], 1e-9), 2),
            "server_args": configs["draft-eagle3"], "per_prompt": per}
