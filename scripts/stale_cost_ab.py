"""A/B of the verify-cost curve's stale timings (runtime/policies.py, VerifyCost.STALE, off as
shipped): after a busy stretch that made the long verify passes look dear, a drop-in whose
timings go stale after --stale passes against one whose timings never do (as shipped), both
against llama_cpp.Llama: the app's call, greedy and sampled at llama-cpp-python's defaults.

    .venv/bin/python scripts/stale_cost_ab.py [--target gemma3-270m] [--max-tokens 128]
        [--rounds 3] [--mode "temperature 0"] [--stretch 0.12] [--stale 256]

The busy stretch is made, not waited for: once each drop-in has measured its own verify-cost
curves (a warm-up call per mode, each drop-in with a cache folder of its own), every length n
of every curve they learn is timed 16 times at the mean of the two drop-ins' measured costs
times 1 + STRETCH x (n - 1) (0.12: a 7-row pass 1.72x dearer, as a curve found in a cache here
once read against a fresh measurement), the same for both. Then the same prompts, rounds and seeds as
scripts/peek_ab.py (development prompts, not the bench's held-out set), each prompt in turn:
llama_cpp.Llama, then the two drop-ins in alternating order. Reported per mode and per round:
the median of per-prompt ratios and the total-tokens ratio of each drop-in against
llama_cpp.Llama, tokens per verify pass, and each curve as it ended. Writes
results/stale-cost-ab-TARGET.json (append-only).
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from peek_ab import MODES, PROMPTS, add_run_args, summarise, timed_call  # noqa: E402

ARMS = ("stale timings forgotten", "timings kept")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, rounds=3)
    ap.add_argument("--stretch", type=float, default=0.12,
                    help="the busy stretch times n rows at cost x (1 + STRETCH x (n - 1))")
    ap.add_argument("--stale", type=int, default=256,
                    help="passes after which the first drop-in's timings go stale")
    a = ap.parse_args()
    if a.max_tokens < 1 or a.rounds < 1 or a.stale < 1 or a.stretch < 0:
        ap.error("--max-tokens, --rounds and --stale must be positive, --stretch not negative")

    from llama_cpp import Llama

    from edgespec import cache
    from edgespec.io import write_result
    from edgespec.measure.bench import machine_info
    from edgespec.runtime import policies
    from edgespec.runtime.api import SpeculativeLlama
    from edgespec.runtime.llama_target import default_threads
    from edgespec.targets import resolve_target

    path, threads = str(resolve_target(a.target)), default_threads()
    ref_name = "llama_cpp.Llama"
    modes = a.mode or list(MODES)
    objs = {ref_name: Llama(model_path=path, n_ctx=2048, n_threads=threads, verbose=False),
            **{arm: SpeculativeLlama(model_path=path, n_ctx=2048, n_threads=threads, draft="default")
               for arm in ARMS}}
    learned = tempfile.mkdtemp(prefix="edgespec-stale-ab.")
    roots = {arm: os.path.join(learned, arm.replace(" ", "-")) for arm in ARMS}
    home = os.environ.get("EDGESPEC_CACHE")

    def call(name, prompt, seed, max_tokens, kw):
        if name != ref_name:  # this drop-in's own policy state
            os.environ["EDGESPEC_CACHE"] = roots[name]
        return timed_call(objs[name], prompt, seed, max_tokens, kw)

    def curves(arm):
        os.environ["EDGESPEC_CACHE"] = roots[arm]
        root = str(cache.cache_root())
        return {key: c for (r, key), c in policies._LIVE.items() if r == root}

    summary, per_prompt, before, after = {}, {}, {}, {}
    try:
        for name in objs:  # the first call pages the file in; each mode's curve is measured
            for mode in modes:
                call(name, "Warm-up: the quick brown fox", 0, 8, MODES[mode])
        live = {arm: curves(arm) for arm in ARMS}
        for key in live[ARMS[0]]:  # the same busy stretch for both, on the mean of their curves
            pair = [live[arm][key] for arm in ARMS]
            base = [sum(x) / len(pair) for x in zip(*(c.curve for c in pair))]
            before[key] = {"measured_ms": {arm: ms(c.curve) for arm, c in zip(ARMS, pair)},
                           "stretch_base_ms": ms(base)}
            for arm, c in zip(ARMS, pair):
                c.STALE = a.stale if arm == ARMS[0] else None
                for n in range(1, len(base) + 1):
                    for _ in range(16):
                        c.observe(n, base[n - 1] * (1 + a.stretch * (n - 1)))
            before[key]["after_stretch_ms"] = ms(pair[0].curve)
        for mode in modes:
            kw = MODES[mode]
            rows = {name: [] for name in objs}
            for r in range(a.rounds):
                for i, prompt in enumerate(PROMPTS):
                    order = [ref_name, *(ARMS if (i + r) % 2 == 0 else ARMS[::-1])]
                    for name in order:
                        rows[name].append(call(name, prompt, a.seed + i, a.max_tokens, kw) | {"round": r})
            per_prompt[mode] = rows
            summary[mode] = {"all": summarise(rows, ref_name, ARMS)}
            for r in range(a.rounds):
                summary[mode][f"round {r + 1}"] = summarise(
                    {name: [x for x in v if x["round"] == r] for name, v in rows.items()}, ref_name, ARMS)
            for arm in ARMS:
                print(mode, arm, {k: v[arm]["speedup"] for k, v in summary[mode].items()}, flush=True)
        for arm in ARMS:
            after[arm] = {key: ms(c.curve) for key, c in curves(arm).items()}
    finally:
        if home is None:
            os.environ.pop("EDGESPEC_CACHE", None)
        else:
            os.environ["EDGESPEC_CACHE"] = home
    doc = {"target": a.target, "call": "create_completion(prompt, max_tokens, seed, **mode)",
           "stale_passes": a.stale, "shipped_stale": policies.VerifyCost.STALE, "stretch": a.stretch,
           "prompts": len(PROMPTS), "rounds": a.rounds, "seed": a.seed, "max_tokens": a.max_tokens,
           "summary": summary, "curves_before": before, "curves_after": after,
           "per_prompt": per_prompt, "machine": machine_info(threads)}
    print("wrote", write_result(ROOT / "results", f"stale-cost-ab-{a.target}", doc))
    return 0


def ms(curve) -> list[float]:
    return [round(1000 * x, 2) for x in curve]


if __name__ == "__main__":
    sys.exit(main())
