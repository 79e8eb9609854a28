"""A/B of the cost policy's peeks (runtime/policies.py, PEEK_SEEN: a scored head held short
still drafts where its first confidences say a kept draft pays, its chain going on while
`go_on` says so), on and off, against llama_cpp.Llama: the app's call, sampled at
llama-cpp-python's defaults and greedy.

    .venv/bin/python scripts/peek_ab.py [--target gemma3-270m] [--max-tokens 128] [--rounds 1]
        [--compare peeks|set-aside]

`--compare set-aside` runs, instead, the default drafter with `MixedDrafter.set_aside_peeks`
on (a peeked head draft the policy would trim away leaves the pass to a one-token match) against
the default drafter as it ships (off: every peeked draft goes to the policy's trim).

Development prompts of this script's own (not the bench's held-out set, whose figures come from
`edgespec bench`). Three objects on the same file, each prompt in turn (llama_cpp.Llama, then
the drop-in with peeks and the drop-in without them, in alternating order: `CostAware._peeks`
answering False and `go_on` True for the second's calls), the same seed per prompt, wall time
of the whole call. Each drop-in keeps what its policy learns (acceptance, verify cost) in a cache
folder of its own, so neither learns from the other's passes. Reported per mode: the median of
per-prompt ratios and the total-tokens ratio of each drop-in against llama_cpp.Llama, tokens
per verify pass and the head's share of accepted tokens. Writes results/peek-ab-TARGET.json
(append-only).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "class Stack:\n    \"\"\"A last-in, first-out stack on a Python list.\"\"\"\n\n    def __init__(self):\n",
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and fill in defaults.\"\"\"\n",
    "# Count how often each word occurs in a text file\nfrom collections import Counter\n\n",
    "function debounce(fn, wait) {\n  // call fn once the calls have stopped for `wait` ms\n",
    "def is_palindrome(s: str) -> bool:\n",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain, in a few paragraphs, how a refrigerator keeps food cold.",
    "The three main reasons cities grew so quickly in the nineteenth century were",
    "Here are some practical tips for someone learning to play the guitar:",
    "A simple recipe for tomato soup. Ingredients:",
    "Dear hiring manager, I am writing to apply for the position of",
]

MODES = {"library defaults": {}, "temperature 0": {"temperature": 0.0}}


def add_run_args(ap: argparse.ArgumentParser, rounds: int) -> None:
    """The arguments every A/B on these prompts takes."""
    ap.add_argument("--target", default="gemma3-270m")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=rounds, help="passes over the prompts")
    ap.add_argument("--mode", choices=sorted(MODES), action="append",
                    help="modes to run (default: both)")
    ap.add_argument("--seed", type=int, default=2000, help="prompt i samples with seed + i")


def timed_call(obj, prompt: str, seed: int, max_tokens: int, kw: dict) -> dict:
    """One create_completion, timed whole: its tokens, seconds and decode statistics."""
    t0 = time.perf_counter()
    out = obj.create_completion(prompt, max_tokens=max_tokens, seed=seed, **kw)
    sec = time.perf_counter() - t0
    spec = out.get("speculative") or {}
    return {"tokens": out["usage"]["completion_tokens"], "seconds": round(sec, 6),
            "verify_passes": spec.get("verify_passes"), "by_source": spec.get("by_source")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, rounds=1)
    ap.add_argument("--compare", choices=("peeks", "set-aside"), default="peeks",
                    help="the switch the two arms differ in (see the module doc)")
    a = ap.parse_args()
    if a.max_tokens < 1 or a.rounds < 1:
        ap.error("--max-tokens and --rounds must be positive")

    from llama_cpp import Llama

    from edgespec.io import write_result
    from edgespec.measure.bench import machine_info
    from edgespec.runtime import policies
    from edgespec.runtime.api import SpeculativeLlama
    from edgespec.runtime.llama_target import default_threads
    from edgespec.targets import resolve_target

    path, threads = str(resolve_target(a.target)), default_threads()
    ref_name = "llama_cpp.Llama"
    arms = ("peeks on", "peeks off") if a.compare == "peeks" else ("set aside", "verified whole")
    objs = {ref_name: Llama(model_path=path, n_ctx=2048, n_threads=threads, verbose=False),
            **{arm: SpeculativeLlama(model_path=path, n_ctx=2048, n_threads=threads, draft="default")
               for arm in arms}}
    real_peeks, real_go_on = policies.CostAware._peeks, policies.CostAware.go_on
    learned = tempfile.mkdtemp(prefix="edgespec-peek-ab.")
    home = os.environ.get("EDGESPEC_CACHE")

    def call(name, prompt, seed, max_tokens, kw):
        off = name == "peeks off"
        policies.CostAware._peeks = (lambda self, s: False) if off else real_peeks
        policies.CostAware.go_on = (lambda self, s, c, u=None: True) if off else real_go_on
        if name in ("set aside", "verified whole"):
            objs[name].drafter.set_aside_peeks = name == "set aside"
        if name != ref_name:  # this drop-in's own policy state
            os.environ["EDGESPEC_CACHE"] = os.path.join(learned, name.replace(" ", "-"))
        return timed_call(objs[name], prompt, seed, max_tokens, kw)

    summary, per_prompt = {}, {}
    try:
        for name in objs:  # the first call pages the file in
            call(name, "Warm-up: the quick brown fox", 0, 8, {})
        for mode in a.mode or list(MODES):
            kw = MODES[mode]
            rows = {name: [] for name in objs}
            for r in range(a.rounds):
                for i, prompt in enumerate(PROMPTS):
                    order = [ref_name, *(arms if (i + r) % 2 == 0 else arms[::-1])]
                    for name in order:
                        rows[name].append(call(name, prompt, a.seed + i, a.max_tokens, kw))
            per_prompt[mode] = rows
            summary[mode] = summarise(rows, ref_name, arms)
            for arm in arms:
                print(mode, arm, summary[mode][arm], flush=True)
    finally:
        policies.CostAware._peeks, policies.CostAware.go_on = real_peeks, real_go_on
        if home is None:
            os.environ.pop("EDGESPEC_CACHE", None)
        else:
            os.environ["EDGESPEC_CACHE"] = home
    doc = {"target": a.target, "call": "create_completion(prompt, max_tokens, seed, **mode)",
           "compare": a.compare,
           "prompts": len(PROMPTS), "rounds": a.rounds, "seed": a.seed, "max_tokens": a.max_tokens,
           "summary": summary, "per_prompt": per_prompt, "machine": machine_info(threads)}
    print("wrote", write_result(ROOT / "results", f"peek-ab-{a.target}", doc))
    return 0


def summarise(rows: dict, ref_name: str, arms) -> dict:
    rate = lambda r: r["tokens"] / r["seconds"]  # noqa: E731
    ref = rows[ref_name]
    out = {}
    for arm in arms:
        ours = rows[arm]
        accepted = {}
        for r in ours:
            for src, (_, _, acc) in (r["by_source"] or {}).items():
                accepted[src] = accepted.get(src, 0) + acc
        head = sum(v for s, v in accepted.items() if s.startswith("head"))
        out[arm] = {
            "speedup": round(statistics.median(rate(x) / rate(y) for x, y in zip(ours, ref)), 4),
            "speedup_total": round((sum(r["tokens"] for r in ours) / sum(r["seconds"] for r in ours))
                                   / (sum(r["tokens"] for r in ref) / sum(r["seconds"] for r in ref)), 4),
            "tokens_per_pass": round(sum(r["tokens"] for r in ours)
                                     / max(1, sum(r["verify_passes"] or 0 for r in ours)), 3),
            "head_share_of_accepted": round(head / max(1, sum(accepted.values())), 3),
            "accepted_by_source": accepted}
    return out


if __name__ == "__main__":
    sys.exit(main())
