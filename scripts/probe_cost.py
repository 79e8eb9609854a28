"""What the hidden-state probe (LlamaTarget's eval callback) costs a decode, with and without
the C gate in front of it (runtime/probe_gate.py): one interleaved run in one process.

    scripts/probe_cost.py --rounds 5 --json results/probe-cost-NAME.json

Per target (Gemma 3 270M, SmolLM2-135M), three engines on the same file: no probe; the probe
answering every tensor in Python (the gate turned off); the probe behind the gate. Each round
times, per engine in turn, `--decodes` one-token decodes after a short prompt in two modes:
"plain" (nothing read: llama.cpp's own LM head, what a sampled or full-head pass does) and
"grab" (the final hidden states read and the graph stopped there: what a greedy low-rank pass
does; not on the engine without the probe). Reported: per engine and mode, the median over
rounds of ms per decode, and the gate's saving against the Python probe.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

PROMPT = "The history of the river valley is long, and the towns along it grew slowly. " * 2


def _time(engine, ids: list[int], decodes: int, grab: bool) -> float:
    engine.reset()
    engine.prefill(ids)
    t0 = time.perf_counter()
    for i in range(decodes):
        tok = [ids[i % len(ids)]]
        if grab:
            engine._decode_grab(tok, [True])
        else:
            engine.decode(tok, all_logits=False)
    return 1000 * (time.perf_counter() - t0) / decodes


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", nargs="+", default=["gemma3-270m", "smollm2-135m"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decodes", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.json and Path(args.json).exists():
        print(f"{args.json} exists: results are never overwritten", file=sys.stderr)
        return 2

    from edgespec.measure.bench import machine_info
    from edgespec.runtime import probe_gate
    from edgespec.runtime.llama_target import LlamaTarget, default_threads

    if probe_gate.gate_library() is None:
        print("the probe gate could not be built here (no C compiler?)", file=sys.stderr)
        return 1
    report = {"rounds": args.rounds, "decodes": args.decodes, "targets": {},
              "machine": machine_info(default_threads())}
    for name in args.targets:
        engines = {"no probe": LlamaTarget(name, n_ctx=512, lm_head="full")}
        real = probe_gate.gate_library
        probe_gate.gate_library = lambda: None  # this engine's probe answers every tensor itself
        try:
            engines["probe, Python only"] = LlamaTarget(name, n_ctx=512, lm_head="full", probe=True)
        finally:
            probe_gate.gate_library = real
        engines["probe behind the gate"] = LlamaTarget(name, n_ctx=512, lm_head="full", probe=True)
        ids = engines["no probe"].tokenize(PROMPT)
        times: dict[str, dict[str, list[float]]] = {e: {"plain": [], "grab": []} for e in engines}
        try:
            for r in range(args.rounds + 1):  # round 0 warms up
                order = list(engines) if r % 2 else list(reversed(engines))
                for e in order:
                    for mode in ("plain", "grab"):
                        if mode == "grab" and e == "no probe":
                            continue
                        ms = _time(engines[e], ids, args.decodes, mode == "grab")
                        if r:
                            times[e][mode].append(ms)
        finally:
            for eng in engines.values():
                eng.close()
        med = {e: {m: round(statistics.median(v), 4) for m, v in t.items() if v} for e, t in times.items()}
        py, gate = med["probe, Python only"], med["probe behind the gate"]
        report["targets"][name] = {
            "ms_per_decode": med,
            "gate_saves_ms": {m: round(py[m] - gate[m], 4) for m in ("plain", "grab")},
            "plain_probe_over_none": {"python": round(py["plain"] / med["no probe"]["plain"], 4),
                                      "gate": round(gate["plain"] / med["no probe"]["plain"], 4)}}
        print(name, json.dumps(report["targets"][name]))
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
