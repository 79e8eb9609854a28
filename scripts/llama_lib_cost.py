"""What the batch-invariant llama.cpp build (edgespec/llama_lib.py) costs, and what prefix reuse
saves: one interleaved run, the stock and the invariant library in alternating fresh processes.

    scripts/llama_lib_cost.py gemma3-270m --prompts 12 --rounds 2 --json results/x.json

Each process (EDGESPEC_LLAMA_LIB=stock or invariant; the order flips every round) runs
`--prompts` bench prompts spread over the file (code, prose, chat), greedy, `--max-tokens` new tokens each, through every
configuration in turn per prompt: llama_cpp.Llama with its defaults (the plain reference),
edgespec without a draft (full LM head), the default drafter with the full LM head (exact where
the start-up check allows) and the default drafter as shipped (`lm_head="auto"`). Timed: the
whole call, prompt included. Reported per configuration and library: median tok/s over
prompts (each prompt's median over rounds), whether the text equals llama_cpp.Llama's and
edgespec's plain decoding, and per configuration the invariant build's speed over the stock
one's (median of per-prompt ratios, total-tokens ratio). Then prefix reuse: a two-turn chat,
the second turn's prefill time when the cache keeps the first turn and when it starts empty,
for edgespec and for llama_cpp.Llama (which keeps its prefix too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {  # name -> SpeculativeLlama arguments (None: llama_cpp.Llama)
    "llama_cpp.Llama": None,
    "edgespec, no draft, full LM head": {"draft": None, "lm_head": "full"},
    "edgespec default drafter, full LM head": {"draft": "default", "lm_head": "full"},
    "edgespec default drafter, lm_head auto": {"draft": "default", "lm_head": "auto"},
}


def child(target: str, n_prompts: int, max_tokens: int, n_ctx: int) -> dict:
    import edgespec  # noqa: F401  (chooses the library before llama_cpp loads)
    from edgespec import llama_lib
    from edgespec.prompts import DEFAULT_PROMPTS, read_prompts
    from edgespec.runtime.api import SpeculativeLlama
    from edgespec.targets import resolve_target
    from llama_cpp import Llama

    path = str(resolve_target(target))
    llms = {name: Llama(model_path=path, n_ctx=n_ctx, verbose=False) if kw is None
            else SpeculativeLlama(model_path=path, n_ctx=n_ctx, **kw) for name, kw in CONFIGS.items()}
    every = [p["prompt"] for p in read_prompts(DEFAULT_PROMPTS)]
    prompts = every[::max(1, len(every) // n_prompts)][:n_prompts]  # across code, prose, chat
    for llm in llms.values():  # page the model in
        llm.create_completion("Hello", temperature=0, max_tokens=4)
    rows = {name: [] for name in CONFIGS}
    for p in prompts:
        for name, llm in llms.items():
            if hasattr(llm, "reset"):
                llm.reset()  # every call prefills its whole prompt
            t0 = time.perf_counter()
            out = llm.create_completion(p, temperature=0, max_tokens=max_tokens)
            dt = time.perf_counter() - t0
            rows[name].append({"tokens": out["usage"]["completion_tokens"], "seconds": dt,
                               "text": out["choices"][0]["text"],
                               "exact": out.get("speculative", {}).get("exact")})
    return {"invariant": llama_lib.loaded_is_invariant(), "lib": str(llama_lib.loaded_lib_dir()),
            "rows": rows, "reuse": prefix_reuse(llms, max_tokens)}


def prefix_reuse(llms: dict, max_tokens: int) -> dict:
    """A chat's second turn: prefill seconds with the first turn kept in the cache and from an
    empty cache (edgespec's plain engine and llama_cpp.Llama, each timed on its own)."""
    msgs = [{"role": "user", "content": "Describe how a bicycle gear system works, in detail."}]
    out = {}
    for name in ("llama_cpp.Llama", "edgespec, no draft, full LM head"):
        llm = llms[name]
        first = llm.create_chat_completion(messages=msgs, temperature=0, max_tokens=max_tokens)
        turn2 = msgs + [first["choices"][0]["message"],
                        {"role": "user", "content": "Now explain why the chain needs oil."}]
        timings = {}
        for mode in ("kept", "empty"):
            if mode == "empty":
                llm.reset()
            else:  # the state the first turn left: its prompt and reply in the cache
                llm.create_chat_completion(messages=msgs, temperature=0, max_tokens=max_tokens)
            t0 = time.perf_counter()
            r = llm.create_chat_completion(messages=turn2, temperature=0, max_tokens=1)
            timings[mode] = {"seconds_to_first_token": time.perf_counter() - t0,
                             "prompt_tokens": r["usage"]["prompt_tokens"],
                             "prompt_reused": r.get("speculative", {}).get("prompt_reused")}
        out[name] = timings
    return out


def run_child(lib: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    env["EDGESPEC_LLAMA_LIB"] = lib
    cmd = [sys.executable, __file__, args.target, "--child", "--prompts", str(args.prompts),
           "--max-tokens", str(args.max_tokens), "--n-ctx", str(args.n_ctx)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {lib} run failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(runs: dict[str, list[dict]]) -> dict:
    out = {"configs": {}}
    for name in CONFIGS:
        per = {}
        for lib, rs in runs.items():
            n = len(rs[0]["rows"][name])
            secs = [statistics.median(r["rows"][name][i]["seconds"] for r in rs) for i in range(n)]
            toks = [rs[0]["rows"][name][i]["tokens"] for i in range(n)]
            ref = [x["text"] for x in rs[0]["rows"]["llama_cpp.Llama"]]
            plain = [x["text"] for x in rs[0]["rows"]["edgespec, no draft, full LM head"]]
            texts = [x["text"] for x in rs[0]["rows"][name]]
            per[lib] = {"tok_s_median": statistics.median(t / s for t, s in zip(toks, secs)),
                        "tok_s_total": sum(toks) / sum(secs), "tokens": toks, "seconds": secs,
                        "same_as_llama_cpp": sum(a == b for a, b in zip(texts, ref)),
                        "same_as_plain": sum(a == b for a, b in zip(texts, plain)),
                        "exact_runs": sum(bool(x["exact"]) for x in rs[0]["rows"][name]),
                        "prompts": n}
        s, i = per["stock"], per["invariant"]
        per["invariant_vs_stock"] = {
            "median": statistics.median((ti / si) / (ts / ss) for ti, si, ts, ss in
                                        zip(i["tokens"], i["seconds"], s["tokens"], s["seconds"])),
            "total": i["tok_s_total"] / s["tok_s_total"]}
        out["configs"][name] = per
    out["prefix_reuse"] = {lib: rs[-1]["reuse"] for lib, rs in runs.items()}
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.target, args.prompts, args.max_tokens, args.n_ctx)))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from edgespec.io import atomic_write_text
    from edgespec.measure.bench import ensure_new, machine_info

    if args.json:
        ensure_new(Path(args.json))
    runs: dict[str, list[dict]] = {"stock": [], "invariant": []}
    for r in range(args.rounds):
        for lib in (("stock", "invariant") if r % 2 == 0 else ("invariant", "stock")):
            print(f"round {r + 1}: {lib} library", file=sys.stderr, flush=True)
            runs[lib].append(run_child(lib, args))
    if runs["stock"][0]["invariant"] or not runs["invariant"][0]["invariant"]:
        raise SystemExit("the stock and invariant runs did not load the libraries asked for")
    report = {"target": args.target, "prompts": args.prompts, "max_tokens": args.max_tokens,
              "rounds": args.rounds, "machine": machine_info(len(os.sched_getaffinity(0))),
              "libraries": {lib: rs[0]["lib"] for lib, rs in runs.items()}, **summarize(runs)}
    text = json.dumps(report, indent=1)
    if args.json:
        atomic_write_text(Path(args.json), text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
