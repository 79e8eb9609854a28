"""A shared-KV head exported as llama.cpp's `gemma4-assistant`, run by llama.cpp itself, checked
against edgespec's replay of llama.cpp's draft loop.

    .venv/bin/python scripts/assistant_check.py gemma3-270m assistant.gguf [--limit 12]

`llama-server-nextn` (`make llama-tools`: the pinned llama.cpp with scripts/patches/gemma3-nextn.patch,
whose gemma3 graph hands the drafter the post-norm hidden state) decodes each prompt greedily
twice: plain, and with `--spec-type draft-mtp -md FILE` (llama.cpp's 3 drafts a step: at each
step the argmax of the file's logits over the full vocabulary, every step at the position of the
last verified token, over the target's own keys and values). Its /metrics counters give the
drafted and accepted tokens. edgespec then runs the target over the same text (prompt + the
server's continuation), reads each position's hidden state and the keys and values of the
layers the head attends, and replays that loop with the file's tensors as llama.cpp's graph
computes them (`exporters/gemma4_assistant.assistant_step`): the two acceptance figures must
agree up to llama.cpp's batch numerics (the server's verify batches against one batch here).
Also reported: how often the speculative text equals the plain text, and both speeds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError

SERVER = "llama-server-nextn"
N_MAX = 3  # llama.cpp's default drafts per step (common_params_speculative.draft.n_max)
# The most the two acceptance figures may differ and still agree: the server verifies in its own
# batches, the replay reads the text in one, so a near tie between two tokens can flip a draft
# (on a trained head the two agreed to 0.001 over 12 prompts); a server that reads no hidden
# state at all is off by far more
TOLERANCE = 0.03


def replay(file, seq: list[int], rows: np.ndarray, embed: np.ndarray, start: int, n_max: int = N_MAX) -> dict:
    """llama.cpp's draft-mtp loop on a greedy text, offline: from the first generated position
    `start` (its token the last verified one), draft n_max tokens greedily from the file (an
    `AssistantFile`), keep the prefix the text has, move on by that many + 1. rows: the target's
    [T, E + 2 * kv_width * layers] (hidden state, then per layer keys and values)."""
    c = file.c
    e, w, n_l = c.n_embd, c.kv_width, c.n_layer
    per = rows[:, e:e + 2 * w * n_l].reshape(len(rows), n_l, 2, c.n_head_kv, c.head_dim)
    keys = [per[:, j, 0] for j in range(n_l)]
    values = [per[:, j, 1] for j in range(n_l)]
    T, p, drafted, accepted, steps, unsure = len(seq), start, 0, 0, 0, 0
    while p < T - 1:
        x, h, drafts = embed[[seq[p]]], rows[p - 1:p, :e], []
        for _ in range(n_max):
            h, lg = file.step(x, h, p, keys, values)
            best = int(np.argmax(lg[0]))
            unsure += int(lg[0, best] <= 0.0)  # a 0-logit token outside the draft vocabulary may tie
            drafts.append(int(file.ids[best]))
            x = embed[[drafts[-1]]]
        a = 0
        while a < n_max and p + a + 1 < T and drafts[a] == seq[p + a + 1]:
            a += 1
        drafted, accepted, steps = drafted + n_max, accepted + a, steps + 1
        p += a + 1
    return {"drafted": drafted, "accepted": accepted, "verify_steps": steps, "unsure_drafts": unsure,
            "acceptance": round(accepted / max(drafted, 1), 4)}


def assistant_in_llama_server(target: str, head_gguf: str | Path, prompts: list[str],
                              n_predict: int = 96, n_ctx: int = 1024, threads: int | None = None,
                              server: str = SERVER) -> dict:
    """server: the llama-server binary (`llama-server` for stock llama.cpp, whose gemma3 graph
    hands the drafter no hidden state: its acceptance then falls apart from the replay's)."""
    from edgespec.exporters.gemma4_assistant import AssistantFile
    from edgespec.measure.eagle3_check import tok_s, greedy_runs
    from edgespec.runtime.llama_target import LlamaTarget
    from edgespec.targets import embedding_rows

    file = AssistantFile(head_gguf)
    eng = LlamaTarget(target, n_ctx=n_ctx, n_threads=threads, lm_head="full", probe=True, n_batch=64)
    try:
        if eng.spec.n_embd != file.c.n_embd:
            raise EdgespecError(f"{head_gguf} is a head for another target")
        ids = [eng.tokenize(p) for p in prompts]
        configs = {"none": [], "draft-mtp": ["-md", str(head_gguf), "--spec-type", "draft-mtp"]}
        runs = greedy_runs(eng, configs, ids, n_predict, n_ctx, tool=server)
        embed = embedding_rows(eng.spec)
        per = []
        for p, plain, spec in zip(ids, runs["none"], runs["draft-mtp"]):
            seq = p + spec["token_ids"]
            eng.reset()
            rows = eng.hidden_states(seq, kv_layers=tuple(file.c.kv_layers))
            walk = replay(file, seq, rows, embed, start=len(p))
            per.append({"prompt_tokens": len(p), "tokens": spec["tokens"],
                        "llama_drafted": spec["draft_n"], "llama_accepted": spec["draft_n_accepted"],
                        "llama_acceptance": round(spec["draft_n_accepted"] / max(spec["draft_n"], 1), 4),
                        "edgespec_drafted": walk["drafted"], "edgespec_accepted": walk["accepted"],
                        "edgespec_acceptance": walk["acceptance"], "unsure_drafts": walk["unsure_drafts"],
                        "same_text_as_plain": spec["token_ids"] == plain["token_ids"],
                        "tok_s_plain": tok_s(plain), "tok_s_mtp": tok_s(spec)})
    finally:
        eng.close()

    def total(key):
        return sum(r[key] for r in per)

    dec = {n: sum(r["decode_s"] for r in rows) for n, rows in runs.items()}
    tok = {n: sum(r["tokens"] for r in rows) for n, rows in runs.items()}
    ours = total("edgespec_accepted") / max(total("edgespec_drafted"), 1)
    theirs = total("llama_accepted") / max(total("llama_drafted"), 1)
    agrees = abs(ours - theirs) <= TOLERANCE
    return {"target": target, "head": str(head_gguf), "server": server, "prompts": len(per),
            "n_predict": n_predict, "agrees": agrees, "tolerance": TOLERANCE,
            "diagnosis": "llama.cpp drafts with the file as edgespec reads it" if agrees else
            (f"llama.cpp's acceptance {theirs:.3f} is far from the replay's {ours:.3f}: this server does "
             "not run the file as exported (stock llama.cpp's gemma3 graph hands the drafter no hidden "
             "state; use llama-server-nextn)"),
            "llama_acceptance": round(theirs, 4), "edgespec_acceptance": round(ours, 4),
            "unsure_drafts": total("unsure_drafts"),
            "same_text_as_plain_share": round(sum(r["same_text_as_plain"] for r in per) / len(per), 4),
            "tok_s_plain": round(tok["none"] / max(dec["none"], 1e-9), 2),
            "tok_s_mtp": round(tok["draft-mtp"] / max(dec["draft-mtp"], 1e-9), 2),
            "server_args": configs["draft-mtp"], "per_prompt": per}
