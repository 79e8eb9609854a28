"""The app's call with llama_cpp imported before edgespec, and after: the drop-in against
llama_cpp.Llama in each case, with `lm_head="auto"` choosing its LM head by measurement
(runtime/llama_target.py, `_batched_pays_here`) and with the batched head taken regardless
(the choice before that measurement).

    .venv/bin/python scripts/import_order_ab.py [--target gemma3-270m] [--max-tokens 128]

An app that imports llama_cpp first loads libgomp before edgespec can shorten its spin, so
llama.cpp's OpenMP threads spin on while onnxruntime's LM heads run after each decode. Each order
runs in a fresh process of its own: three objects on the same file (llama_cpp.Llama, the drop-in
with the measured choice, the drop-in with the batched head forced), each prompt in turn, the
drop-ins in alternating order, the same seed per prompt, wall time of the whole call, at
llama-cpp-python's defaults (sampled) and at temperature 0. The prompts are scripts/peek_ab.py's
development prompts (not the bench's held-out set). Reported per order and mode: the median of
per-prompt ratios and the total-tokens ratio against llama_cpp.Llama. Writes
results/import-order-TARGET.json (append-only).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
first, target, max_tokens, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
if first == "llama_cpp":
    from llama_cpp import Llama
import edgespec
from llama_cpp import Llama
from edgespec.runtime import llama_target
from edgespec.runtime.api import SpeculativeLlama
from edgespec.targets import resolve_target
path, threads = str(resolve_target(target)), llama_target.default_threads()
measured = llama_target.LlamaTarget._batched_pays_here
objs = {"llama_cpp.Llama": Llama(model_path=path, n_ctx=2048, n_threads=threads, verbose=False)}
objs["measured choice"] = SpeculativeLlama(model_path=path, n_ctx=2048, n_threads=threads, draft="default")
llama_target.LlamaTarget._batched_pays_here = lambda self: True
objs["batched forced"] = SpeculativeLlama(model_path=path, n_ctx=2048, n_threads=threads, draft="default")
llama_target.LlamaTarget._batched_pays_here = measured
heads = {n: (o.engine.batched_head is not None) for n, o in objs.items() if n != "llama_cpp.Llama"}
def call(name, prompt, seed, n, kw):
    t0 = time.perf_counter()
    out = objs[name].create_completion(prompt, max_tokens=n, seed=seed, **kw)
    return {"tokens": out["usage"]["completion_tokens"], "seconds": round(time.perf_counter() - t0, 6)}
for name in objs:
    call(name, "Warm-up: the quick brown fox", 0, 8, {})
rows = {}
for mode, kw in (("library defaults", {}), ("temperature 0", {"temperature": 0.0})):
    rows[mode] = {name: [] for name in objs}
    for i, p in enumerate(prompts):
        arms = ["measured choice", "batched forced"]
        for name in ["llama_cpp.Llama", *(arms if i % 2 == 0 else arms[::-1])]:
            rows[mode][name].append(call(name, p, 4000 + i, max_tokens, kw))
print("RESULT " + json.dumps({"gomp": edgespec.GOMP_AT_IMPORT, "batched_head": heads, "rows": rows}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="gemma3-270m")
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    if a.max_tokens < 1:
        ap.error("--max-tokens must be positive")
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    from peek_ab import PROMPTS

    from edgespec.io import write_result
    from edgespec.measure.bench import machine_info
    from edgespec.runtime.llama_target import default_threads

    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    env["EDGESPEC_CACHE"] = tempfile.mkdtemp(prefix="edgespec-import-order.")  # measured afresh
    for sub in ("batched-head", "lowrank"):  # built once already: only linked in
        src = Path(os.environ.get("EDGESPEC_CACHE") or Path.home() / ".cache" / "edgespec") / sub
        if src.is_dir():
            os.symlink(src, Path(env["EDGESPEC_CACHE"]) / sub)
    doc = {"target": a.target, "call": "create_completion(prompt, max_tokens, seed, **mode)",
           "prompts": len(PROMPTS), "max_tokens": a.max_tokens, "orders": {},
           "machine": machine_info(default_threads())}
    for first in ("edgespec", "llama_cpp"):
        out = subprocess.run([sys.executable, "-c", CHILD, first, a.target, str(a.max_tokens),
                              json.dumps(PROMPTS)], capture_output=True, text=True, env=env,
                             cwd=ROOT)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if out.returncode != 0 or line is None:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        got = json.loads(line[len("RESULT "):])
        got["summary"] = {mode: summarise(rows) for mode, rows in got["rows"].items()}
        doc["orders"][f"{first} imported first"] = got
        for mode, s in got["summary"].items():
            print(f"{first} first", got["gomp"], got["batched_head"], mode, s, flush=True)
    print("wrote", write_result(ROOT / "results", f"import-order-{a.target}", doc))
    return 0


def summarise(rows: dict) -> dict:
    rate = lambda r: r["tokens"] / r["seconds"]  # noqa: E731
    ref = rows["llama_cpp.Llama"]
    tot = lambda rs: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)  # noqa: E731
    return {name: {"speedup": round(statistics.median(rate(x) / rate(y) for x, y in zip(rs, ref)), 4),
                   "speedup_total": round(tot(rs) / tot(ref), 4)}
            for name, rs in rows.items() if name != "llama_cpp.Llama"}


if __name__ == "__main__":
    sys.exit(main())
