"""A/B of the cost policy's trimming by the target's draws (runtime/policies.py, U_BINS), on and
off, against llama_cpp.Llama: the app's call at llama-cpp-python's defaults.

    .venv/bin/python scripts/draws_ab.py [--target gemma3-270m] [--limit 6] [--max-tokens 128]

Three objects on the same file, each prompt in turn (llama_cpp.Llama, the drop-in with the
draw-aware trim, the drop-in without it: `CostAware._by_draw` replaced by the identity for its
calls), the same seed per prompt, wall time of the whole call. Each drop-in keeps what its policy
learns (acceptance, verify cost) in a cache folder of its own, so neither learns from the other's
passes. Reported: the median of
per-prompt ratios and the total-tokens ratio of each drop-in against llama_cpp.Llama, and
tokens per verify pass. Writes results/draws-ab-TARGET.json (append-only).
"""

import argparse
import os
import statistics
import tempfile
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="gemma3-270m")
    ap.add_argument("--limit", type=int, default=6, help="prompts of each kind (code, prose)")
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    if a.limit < 1 or a.max_tokens < 1:
        ap.error("--limit and --max-tokens must be positive")

    from llama_cpp import Llama

    from edgespec.io import write_result
    from edgespec.measure.bench import machine_info
    from edgespec.prompts import read_prompts
    from edgespec.runtime import policies
    from edgespec.runtime.api import SpeculativeLlama
    from edgespec.runtime.llama_target import default_threads
    from edgespec.targets import resolve_target

    by_kind: dict[str, list[dict]] = {}
    for p in read_prompts():
        if p.get("kind") in ("code", "prose"):
            by_kind.setdefault(p["kind"], []).append(p)
    prompts = [p for ps in by_kind.values() for p in ps[:a.limit]]
    path, threads = str(resolve_target(a.target)), default_threads()
    objs = {"llama_cpp.Llama": Llama(model_path=path, n_ctx=2048, n_threads=threads, verbose=False),
            "draws on": SpeculativeLlama(model_path=path, n_ctx=2048, n_threads=threads, draft="default"),
            "draws off": SpeculativeLlama(model_path=path, n_ctx=2048, n_threads=threads, draft="default")}
    real = policies.CostAware._by_draw
    learned = tempfile.mkdtemp(prefix="edgespec-draws-ab.")
    home = os.environ.get("EDGESPEC_CACHE")

    def call(name, prompt, seed, max_tokens):
        policies.CostAware._by_draw = real if name != "draws off" else (lambda self, s, acc, u: acc)
        if name != "llama_cpp.Llama":  # this drop-in's own policy state
            os.environ["EDGESPEC_CACHE"] = os.path.join(learned, name.replace(" ", "-"))
        t0 = time.perf_counter()
        out = objs[name].create_completion(prompt, max_tokens=max_tokens, seed=seed)
        sec = time.perf_counter() - t0
        spec = out.get("speculative") or {}
        return {"tokens": out["usage"]["completion_tokens"], "seconds": round(sec, 6),
                "verify_passes": spec.get("verify_passes")}

    for name in objs:  # the first call pages the file in
        call(name, "Warm-up: the quick brown fox", 0, 8)
    rows = {name: [] for name in objs}
    for i, p in enumerate(prompts):
        for name in objs:
            rows[name].append(call(name, p["prompt"], 1000 + i, a.max_tokens))
    policies.CostAware._by_draw = real
    if home is None:
        os.environ.pop("EDGESPEC_CACHE", None)
    else:
        os.environ["EDGESPEC_CACHE"] = home
    rate = lambda r: r["tokens"] / r["seconds"]  # noqa: E731
    ref = rows["llama_cpp.Llama"]
    summary = {}
    for name in ("draws on", "draws off"):
        ours = rows[name]
        summary[name] = {
            "speedup": round(statistics.median(rate(x) / rate(y) for x, y in zip(ours, ref)), 4),
            "speedup_total": round((sum(r["tokens"] for r in ours) / sum(r["seconds"] for r in ours))
                                   / (sum(r["tokens"] for r in ref) / sum(r["seconds"] for r in ref)), 4),
            "tokens_per_pass": round(sum(r["tokens"] for r in ours) / sum(r["verify_passes"] for r in ours), 3)}
        print(name, summary[name])
    doc = {"target": a.target, "call": "create_completion(prompt, max_tokens, seed) at library defaults",
           "prompts": len(prompts), "max_tokens": a.max_tokens, "summary": summary, "per_prompt": rows,
           "machine": machine_info(threads)}
    print("wrote", write_result(ROOT / "results", f"draws-ab-{a.target}", doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
