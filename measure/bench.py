"""`edgespec bench`: target-only, prompt lookup and edgespec heads side by side, in one run.

Methods run interleaved per prompt (A B C, A B C, ...) after a warm-up, so machine drift hits all
alike. Reports tokens/s (decode only; prefill separately), speedup vs target-only as both the
median of per-prompt ratios and the total-tokens ratio, tokens per verify pass, acceptance per
draft position, ms per draft step and per verify pass, peak memory of each configuration in a
fresh process next to plain llama.cpp's, and for greedy runs how often the output equals
target-only output. Reports are append-only: `write_report` never overwrites a file.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.io import atomic_write_text, progress
from edgespec.runtime.policies import POLICIES, MemoryStore


@dataclass
class Method:
    name: str  # label in the report
    kind: str  # target | lookup | edgespec
    draft: str | None = None  # head folder for edgespec
    k: int | None = 4  # None: the engine's draft_k
    policy: str = "fixed"
    engine: str = "main"  # "plain": the target file with llama.cpp's full LM head;
    # "baseline": target-only on the --baseline target file

    @property
    def draft_name(self) -> str:
        """The drafter's command-line name (see make_drafter)."""
        return {"target": "none", "lookup": "lookup"}.get(self.kind, self.draft or "default")


@dataclass
class MethodResult:
    method: Method
    per_prompt: list[dict] = field(default_factory=list)


def parse_methods(spec: str, drafts: list[str], k: int | None, policy: str = "cost") -> list[Method]:
    """'target,lookup,lookup:fixed,edgespec' -> Methods; each edgespec entry takes the next
    --draft. A `:POLICY` suffix sets that entry's draft-length policy, otherwise `policy` applies
    (to lookup as well, so lookup and the head are compared under the same policy)."""
    methods, di = [], 0
    names = [Path(d[len("head:"):] if d.startswith("head:") else d).name for d in drafts]
    for item in [m.strip() for m in spec.split(",") if m.strip()]:
        name, _, pol = item.partition(":")
        if pol and pol not in POLICIES:
            raise EdgespecError(f"unknown draft policy '{pol}'; choose from {', '.join(POLICIES)}")
        if name == "target":
            if pol:
                raise EdgespecError(f"method '{item}': target-only decoding takes no policy")
            methods.append(Method("target", "target", k=0))
        elif name == "lookup":
            methods.append(Method(item, "lookup", k=k, policy=pol or policy))
        elif name == "edgespec":
            draft = drafts[min(di, len(drafts) - 1)] if drafts else "default"
            di += 1
            alone = "head:" if draft.startswith("head:") else ""  # a head alone, or mixed with lookup
            path = Path(draft[len(alone):])
            # two files of one name (heads exported to the same file name) are told apart by folder
            shown = path.name if names.count(path.name) <= 1 else f"{path.parent.name}/{path.name}"
            label = "edgespec" if len(drafts) <= 1 else f"edgespec[{alone}{shown}]"
            if pol:
                label += f":{pol}"
            methods.append(Method(label, "edgespec", draft=draft, k=k, policy=pol or policy))
        else:
            raise EdgespecError(f"unknown method '{item}'; choose from target, lookup, edgespec")
    seen: dict[str, int] = {}
    for m in methods:  # labels key the report: make repeats unique
        seen[m.name] = seen.get(m.name, 0) + 1
        if seen[m.name] > 1:
            m.name = f"{m.name}#{seen[m.name]}"
    if not any(m.kind == "target" for m in methods):
        methods.insert(0, Method("target", "target", k=0))
    return methods


def machine_info(threads: int) -> dict:
    from edgespec.runtime.policies import cpu_model

    cpu = cpu_model()
    versions = {}
    for mod in ("llama_cpp", "onnxruntime", "numpy"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            versions[mod] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": threads, "python": platform.python_version(),
            "platform": platform.platform(), "versions": versions}


def bench(target: str, prompts: list[dict], methods: list[Method], max_new_tokens: int = 128,
          threads: int | None = None, temperature: float = 0.0, seed: int = 0, n_ctx: int = 4096,
          device: dict | None = None, baseline: str | None = None, lm_head: str = "auto",
          memory: bool = True, background_load: int = 0, peers: tuple[str, ...] = (),
          peer_head: str | None = None) -> dict:
    """`lm_head`: the target engine's (see LlamaTarget). Where it is the batched head, or the
    low-rank head and the run is greedy, the method "target" (the reference for every speedup and
    for "same output as target") decodes the same file with llama.cpp's own full LM head, as plain
    llama.cpp would, and "target:batched" / "target:lowrank" is target-only decoding with it. `baseline`: a file of
    the same target (e.g. the shipped GGUF next to an export) decoded target-only with
    llama.cpp's full LM head in the same interleaved run; every method then also gets its
    speedup against it. `memory`: measure each configuration's peak RSS in a fresh process.
    `background_load`: that many CPU-hogging processes run from the end of the warm-up to the
    end of the timed runs (the cost policy must adapt within the run). `peers`: ("llama-server",)
    adds stock llama-server's plain decoding and its own speculation on the same prompt tokens
    (see `measure.peers`), one round before the interleaved runs and one after."""
    from edgespec.runtime.decoding import Generation
    from edgespec.runtime.drafters import drafter_for
    from edgespec.runtime.generate import open_target
    from edgespec.runtime.sampling import SamplingParams
    from edgespec.runtime.spec import SpecConfig

    sp = SamplingParams(temperature=temperature, seed=seed)
    unknown = [p for p in peers if p != "llama-server"]
    if unknown:
        raise EdgespecError(f"unknown peer '{unknown[0]}'; choose llama-server")
    if peers and background_load:
        raise EdgespecError("--peers and --background-load do not go together: the peers run unloaded")
    if peer_head and not peers:
        raise EdgespecError("--peer-eagle3 needs --peers llama-server")
    if peer_head and not Path(peer_head).is_file():
        raise EdgespecError(f"--peer-eagle3 {peer_head}: no such file")
    if peer_head:
        from edgespec.runtime.formats import read_eagle3_file
        from edgespec.runtime.llama_target import LAYER_INPUT_ARCHS
        from edgespec.targets import load_target_spec

        tspec, hfile = load_target_spec(target), read_eagle3_file(peer_head)
        if hfile.fingerprint != tspec.tokenizer_fingerprint:
            raise EdgespecError(f"--peer-eagle3 {peer_head} is a head for another target")
        if tspec.arch not in LAYER_INPUT_ARCHS:
            raise EdgespecError(f"--peer-eagle3: stock llama.cpp cannot run an EAGLE-3 head on a "
                                f"{tspec.arch} target (its graph does not hand out layer inputs)")
    if peers:
        from edgespec.measure.peers import find_tool

        find_tool("llama-server")  # before anything runs
    from edgespec.runtime.drafters import reads_hidden

    head = next((m.draft_name for m in methods if m.kind == "edgespec" and reads_hidden(m.draft_name)), None)
    engine = open_target(target, n_ctx=n_ctx, n_threads=threads, lm_head=lm_head, draft=head)
    if peers and engine.engine != "llama.cpp":
        raise EdgespecError("--peers llama-server needs a GGUF target (this one runs on onnxruntime)")
    for m in methods:
        if m.kind != "target":
            m.k = SpecConfig(k=m.k, policy=m.policy).draft_k(engine, sp.greedy)
    drafters = {m.name: drafter_for(m.draft_name, engine) for m in methods if m.kind != "target"}
    engines = {"main": engine}
    own_head = ("lowrank" if engine.lowrank and sp.greedy else
                "batched" if engine.batched_head is not None else None)
    if engine.engine == "llama.cpp" and own_head:
        engines["plain"] = open_target(target, n_ctx=n_ctx, n_threads=threads, lm_head="full")
        i = next(i for i, m in enumerate(methods) if m.kind == "target")
        methods = [*methods[:i], Method("target", "target", k=0, engine="plain"),
                   Method(f"target:{own_head}", "target", k=0), *methods[i + 1:]]
    if baseline:
        engines["baseline"] = open_target(baseline, n_ctx=n_ctx, n_threads=threads, lm_head="full")
        if engines["baseline"].spec.tokenizer_fingerprint != engine.spec.tokenizer_fingerprint:
            raise EdgespecError(f"--baseline {baseline} is not a file of target {engine.spec.name}")
        methods = [*methods, Method("baseline", "target", k=0, engine="baseline")]

    # each row learns its draft estimates on its own, from a fresh start, over its warm-up and
    # prompts: no row starts from what earlier runs on this machine or other rows learned
    stores = {m.name: MemoryStore() for m in methods}

    def run(m: Method, ids: list[int]):
        d = drafters.get(m.name)
        eng = engines[m.engine]
        policy = SpecConfig(k=m.k, policy=m.policy).make_policy(eng, sp.greedy, drafting=d is not None,
                                                                store=stores[m.name])
        g = Generation(eng, ids, sp, max_tokens=max_new_tokens, drafter=d, policy=policy)
        for _ in g:
            pass
        return g

    warm = engine.tokenize("Warm-up: the quick brown fox jumps over the lazy dog.")
    ids = prompt_ids(prompts, engine, max_new_tokens, n_ctx)
    server_rounds = []

    def server_round():
        from edgespec.measure.peers import server_configs, server_round as one_round

        server_rounds.append(one_round(engine.model_file, ids, server_configs(peer_head), engine.n_threads,
                                       n_ctx, max_new_tokens, temperature, seed, warm))

    if peers:
        server_round()
    # warm-up: page the model in, build kernels, fill caches
    for m in methods:
        run(m, warm)
    results = {m.name: MethodResult(m) for m in methods}
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(background_load)]
    turns: list[dict] = []
    try:
        _timed_runs(prompts, ids, methods, engine, run, results, max_new_tokens, n_ctx, turns)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    if peers:
        server_round()
    report = summarize(results, sp.greedy)
    if sp.greedy and "plain" in engines:
        why_texts_differ(report, results, ids, engines["plain"], getattr(engine, "lowrank_head", None))
    report["second_turn"] = summarize_turns(turns)
    if peers:
        report["peers"] = peer_report(server_rounds, results, sp.greedy)
    report["target"] = {"name": engine.spec.name, **_engine_file(engine, target),
                        "lm_head_type": engine.describe_lm_head(sp.greedy),
                        "fingerprint": engine.spec.tokenizer_fingerprint}
    report["settings"] = {"max_new_tokens": max_new_tokens, "temperature": temperature,
                          "prompts": len(prompts), "n_ctx": n_ctx, "background_load": background_load,
                          "methods": [m.__dict__ for m in methods],
                          "policy_state": "each row its own, from a fresh start"}
    if baseline:
        report["baseline"] = _engine_file(engines["baseline"], baseline)
    report["machine"] = machine_info(engine.n_threads)
    for eng in engines.values():
        eng.close()
    if memory:
        report["memory"] = memory_report(target, methods, lm_head, n_ctx, threads, baseline)
    if device:
        report["device"] = device
    return report


def why_texts_differ(report: dict, results: dict, ids: list[list[int]], plain, lowrank=None) -> None:
    """For each greedy method of edgespec's own engine, why its text leaves the reference's
    where it does (measure/divergence.py: batch numerics or the LM head, and with the engine's
    low-rank head what its search did there), on the plain engine."""
    from edgespec.measure.divergence import Diagnosis

    diag = Diagnosis(plain, lowrank)
    refs = [r["token_ids"] for r in results["target"].per_prompt]
    for name, res in results.items():
        if res.method.engine == "main":
            report["methods"][name]["divergence"] = diag.summary(
                ids, refs, [r["token_ids"] for r in res.per_prompt])


# A CPU hog that spins only while the bench that started it lives: a bench killed before its
# clean-up must not leave it running (one did, and loaded the next runs).
HOG = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass"

FOLLOW_UP = "\n\nNow say the same again, more briefly:\n"


def second_turn(engine, ids: list[int], reply: list[int], sp) -> dict:
    """The prefill of a follow-up prompt (this prompt, its reply, a new request) with the cache
    the reply left (only the new tokens are decoded) and from an empty cache, in that order."""
    from edgespec.runtime.decoding import Generation

    follow = ids + reply + engine.tokenize(FOLLOW_UP, add_bos=False)
    out = {"prompt_tokens": len(follow)}
    for name, reuse in (("reused", True), ("fresh", False)):
        g = Generation(engine, follow, sp, max_tokens=1, reuse_prefix=reuse)
        for _ in g:
            pass
        out[f"prefill_{name}_s"] = round(g.stats.prefill_s, 5)
        out[f"{name}_tokens"] = g.stats.prompt_reused
    return out


def summarize_turns(turns: list[dict]) -> dict:
    if not turns:
        return {}
    med = statistics.median
    return {"prompts": len(turns), "median_prompt_tokens": med(t["prompt_tokens"] for t in turns),
            "median_tokens_reused": med(t["reused_tokens"] for t in turns),
            "median_prefill_reused_ms": round(1000 * med(t["prefill_reused_s"] for t in turns), 2),
            "median_prefill_fresh_ms": round(1000 * med(t["prefill_fresh_s"] for t in turns), 2),
            "median_prefill_speedup": round(med(t["prefill_fresh_s"] / max(t["prefill_reused_s"], 1e-9)
                                                for t in turns), 2),
            "per_prompt": turns}


def prompt_ids(prompts: list[dict], engine, max_new_tokens: int, n_ctx: int) -> list[list[int]]:
    """Each prompt's tokens as every method gets them (chat prompts in the target's template)."""
    from edgespec.runtime.chat import render_chat

    out = []
    for p in prompts:
        text = p["prompt"]
        if engine.spec.chat_template and isinstance(p.get("messages"), list):
            text = render_chat(engine.spec, p["messages"])
        ids = engine.tokenize(text)
        if len(ids) + max_new_tokens + 16 > n_ctx:
            raise EdgespecError(f"prompt '{p['prompt'][:30]}...' is too long for n_ctx={n_ctx}")
        out.append(ids)
    return out


def peer_report(server_rounds: list[dict], results: dict, greedy: bool) -> dict:
    """Stock llama-server's configurations against its own plain decoding and edgespec's rows;
    each edgespec method against the fastest stock speculative configuration."""
    from edgespec.measure.peers import find_tool, llama_version, speed_ratios, summarize_server

    target_rows = results["target"].per_prompt
    configs = summarize_server(server_rounds, target_rows, greedy)
    spec = {n: c for n, c in configs.items() if n != "none"}
    best = max(spec, key=lambda n: spec[n]["tokens_per_s"]) if spec else "none"
    vs_best = {}
    for name, res in results.items():
        # the server's rows pool two rounds: speeds are compared, not token totals
        med, tot = speed_ratios(res.per_prompt, configs[best]["per_prompt"])
        vs_best[name] = {"speedup": med, "speedup_total": tot}
    return {"llama-server": {"binary": str(find_tool("llama-server")), "llama_cpp_python": llama_version(),
                             "rounds": len(server_rounds), "configs": configs,
                             "best_speculative": best, "methods_vs_best": vs_best}}


def _timed_runs(prompts, ids_per_prompt, methods, engine, run, results, max_new_tokens, n_ctx,
                turns: list[dict]) -> None:
    """Every method on every prompt, interleaved (A B C, A B C, ...); then, on the main engine,
    the prefill of a follow-up turn after its last method's reply (`second_turn`)."""
    bar = progress(total=len(prompts) * len(methods), desc="bench", unit="run")
    for p, ids in zip(prompts, ids_per_prompt):
        for m in methods:
            g = run(m, ids)
            s = g.stats
            results[m.name].per_prompt.append({
                "labels": {k: v for k, v in p.items() if k != "prompt"},
                "tokens": s.tokens, "decode_s": s.decode_s, "prefill_s": s.prefill_s,
                "verify_passes": s.verify_passes, "drafted": s.drafted, "accepted": s.accepted,
                "draft_steps": s.draft_steps,
                "accepted_at": s.accepted_at, "drafted_at": s.drafted_at, "draft_s": s.draft_s,
                "verify_s": s.verify_s, "token_ids": g.token_ids,
                "by_source": {k: list(v) for k, v in s.by_source.items()},
            })
            bar.update(1)
        if len(ids) + 2 * max_new_tokens + 32 < n_ctx and g.target is engine:
            turns.append(second_turn(engine, ids, g.token_ids, g.sampling))
    bar.close()


def memory_report(target: str, methods: list[Method], lm_head: str, n_ctx: int,
                  threads: int | None, baseline: str | None = None) -> dict:
    """Peak RSS of each configuration in a fresh process, against plain llama.cpp target-only
    decoding (full LM head, no drafter) of the target file, or of `baseline` where given (the
    GGUF next to an ONNX target)."""
    from edgespec.measure.memory import peak_rss_mb

    ref = peak_rss_mb(baseline or target, "full", "none", n_ctx, threads)
    by_draft: dict[str, float] = {}  # lookup under two policies is one configuration
    rows = {}
    for m in methods:
        if m.engine != "main":
            continue
        if m.draft_name not in by_draft:
            by_draft[m.draft_name] = peak_rss_mb(target, lm_head, m.draft_name, n_ctx, threads)
        v = by_draft[m.draft_name]
        rows[m.name] = {"peak_rss_mb": v, "vs_plain_llama_cpp": round(v / ref - 1, 4)}
    return {"reference": f"target-only on {baseline or target} (full LM head, no drafter), fresh process",
            "plain_llama_cpp_peak_rss_mb": ref, "methods": rows}


def _engine_file(engine, given) -> dict:
    """Which engine ran and on what: the ONNX folder as given, or the GGUF file's name."""
    if engine.engine == "onnxruntime":
        return {"engine": engine.engine, "file": str(given)}
    return {"engine": engine.engine, "file": Path(engine.spec.path).name}


def _agg(rows: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    dec = sum(r["decode_s"] for r in rows)
    passes = sum(r["verify_passes"] for r in rows)
    width = max((len(r["drafted_at"]) for r in rows), default=0)
    acc_at = [sum(r["accepted_at"][i] for r in rows if i < len(r["accepted_at"])) for i in range(width)]
    dr_at = [sum(r["drafted_at"][i] for r in rows if i < len(r["drafted_at"])) for i in range(width)]
    drafted = sum(r["drafted"] for r in rows)
    steps = sum(r.get("draft_steps", r["drafted"]) for r in rows)
    return {
        "tokens": tokens, "decode_s": round(dec, 4),
        "prefill_s": round(sum(r["prefill_s"] for r in rows), 4),
        "tokens_per_s": round(tokens / dec, 3) if dec else 0.0,
        "mean_accepted": round(tokens / passes, 4) if passes else 0.0,
        "acceptance_by_position": [round(a / d, 4) if d else 0.0 for a, d in zip(acc_at, dr_at)],
        "ms_per_draft_step": round(1000 * sum(r["draft_s"] for r in rows) / steps, 3) if steps else 0.0,
        "ms_per_verify": round(1000 * sum(r["verify_s"] for r in rows) / passes, 3) if passes else 0.0,
        "verify_passes": passes, "drafted": drafted, "draft_steps": steps,
        "accepted": sum(r["accepted"] for r in rows),
        "by_source": _by_source(rows),
    }


def _by_source(rows: list[dict]) -> dict:
    """Verify passes, drafted and accepted tokens by the source of each pass's draft ("none":
    passes that verified no draft), summed over prompts."""
    out: dict[str, dict] = {}
    for r in rows:
        for src, (n, d, a) in sorted(r.get("by_source", {}).items()):
            o = out.setdefault(src, {"passes": 0, "drafted": 0, "accepted": 0})
            o["passes"], o["drafted"], o["accepted"] = o["passes"] + n, o["drafted"] + d, o["accepted"] + a
    return out


def _ratios(rows: list[dict], base: list[dict]) -> list[float]:
    """Per-prompt decode speed of rows over base."""
    return [(r["tokens"] / r["decode_s"]) / (b["tokens"] / b["decode_s"])
            for r, b in zip(rows, base) if r["decode_s"] > 0 and b["decode_s"] > 0]


def _speedups(rows: list[dict], base: list[dict]) -> tuple[float, float]:
    """(median of per-prompt ratios, total-tokens ratio: all tokens over all decode time)."""
    ratios = _ratios(rows, base)
    a, b = _agg(rows)["tokens_per_s"], _agg(base)["tokens_per_s"]
    return (round(statistics.median(ratios), 4) if ratios else 0.0), (round(a / b, 4) if b else 0.0)


def summarize(results: dict[str, MethodResult], greedy: bool) -> dict:
    base = results["target"].per_prompt
    methods = {}
    for name, res in results.items():
        rows = res.per_prompt
        agg = _agg(rows)
        agg["speedup"], agg["speedup_total"] = _speedups(rows, base)
        if "baseline" in results:
            agg["speedup_vs_baseline"], agg["speedup_total_vs_baseline"] = _speedups(
                rows, results["baseline"].per_prompt)
        if greedy:
            same, prefix = 0, []
            for r, b in zip(rows, base):
                a, c = r["token_ids"], b["token_ids"]
                n = next((i for i, (x, y) in enumerate(zip(a, c)) if x != y), min(len(a), len(c)))
                prefix.append(n)
                same += int(a == c)
            agg["same_as_target_share"] = round(same / len(rows), 4)
            agg["mean_matching_prefix"] = round(sum(prefix) / len(prefix), 2)
        kinds = sorted({str(r["labels"].get("kind", "all")) for r in rows})
        agg["by_kind"] = {}
        for kind in kinds:
            sel = [i for i, r in enumerate(rows) if str(r["labels"].get("kind", "all")) == kind]
            ka = _agg([rows[i] for i in sel])
            med, tot = _speedups([rows[i] for i in sel], [base[i] for i in sel])
            agg["by_kind"][kind] = {"prompts": len(sel), "tokens_per_s": ka["tokens_per_s"],
                                    "speedup": med, "speedup_total": tot,
                                    "mean_accepted": ka["mean_accepted"]}
        # the raw figures every ratio above comes from, so a reader can recompute them
        agg["per_prompt"] = [{"kind": str(r["labels"].get("kind", "all")), "tokens": r["tokens"],
                              "decode_s": round(r["decode_s"], 6)} for r in rows]
        methods[name] = agg
    return {"methods": methods}


def format_table(report: dict) -> str:
    rows = [("method", "tok/s", "speedup median", "speedup total", "tok/pass", "accept by position",
             "ms/draft step", "ms/verify", "same as target")]
    for name, m in report["methods"].items():
        rows.append((name, f"{m['tokens_per_s']:.1f}", f"{m['speedup']:.2f}x", f"{m['speedup_total']:.2f}x",
                     f"{m['mean_accepted']:.2f}",
                     " ".join(f"{a:.2f}" for a in m["acceptance_by_position"][:6]) or "-",
                     f"{m['ms_per_draft_step']:.2f}", f"{m['ms_per_verify']:.2f}",
                     f"{m.get('same_as_target_share', float('nan')):.2f}"))
    if "baseline" in report:
        rows[0] = (*rows[0], "vs baseline (median/total)")
        rows[1:] = [(*r, f"{m['speedup_vs_baseline']:.2f}x/{m['speedup_total_vs_baseline']:.2f}x")
                    for r, m in zip(rows[1:], report["methods"].values())]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    kinds = sorted({k for m in report["methods"].values() for k in m["by_kind"]})
    if len(kinds) > 1:
        lines.append("")
        lines.append("speedup by kind (median): " + "; ".join(
            f"{name}: " + ", ".join(f"{k} {m['by_kind'][k]['speedup']:.2f}x" for k in kinds if k in m["by_kind"])
            for name, m in report["methods"].items() if name != "target"))
    why = [(name, m["divergence"]) for name, m in report["methods"].items() if "divergence" in m]
    if why:
        lines.append("why text differs from target (prompts): " + "; ".join(
            f"{name}: " + ", ".join(f"{k} {v}" for k, v in d["counts"].items())
            + (f", median margin {d['median_margin']:.3f}" if d["median_margin"] is not None else "")
            + (" (lm head: " + ", ".join(f"{k} {v}" for k, v in d["lm_head_search"].items()) + ")"
               if d.get("lm_head_search") else "")
            for name, d in why))
    src = [(name, m["by_source"]) for name, m in report["methods"].items()
           if len(m.get("by_source", {})) > 1]
    if src:
        lines.append("verify passes by draft source (passes: drafted/accepted): " + "; ".join(
            f"{name}: " + ", ".join(f"{k} {v['passes']}: {v['drafted']}/{v['accepted']}"
                                    for k, v in by.items())
            for name, by in src))
    mem = report.get("memory")
    if mem:
        lines.append(f"peak RSS, fresh process each: plain llama.cpp {mem['plain_llama_cpp_peak_rss_mb']:.0f} MB; "
                     + ", ".join(f"{n} {r['peak_rss_mb']:.0f} MB ({100 * r['vs_plain_llama_cpp']:+.0f}%)"
                                 for n, r in mem["methods"].items()))
    turn = report.get("second_turn")
    if turn:
        lines.append(f"second turn prefill (median of {turn['prompts']} prompts, "
                     f"{turn['median_prompt_tokens']:.0f} tokens): {turn['median_prefill_reused_ms']:.1f} ms "
                     f"keeping the cache ({turn['median_tokens_reused']:.0f} tokens reused), "
                     f"{turn['median_prefill_fresh_ms']:.1f} ms from scratch")
    srv = report.get("peers", {}).get("llama-server")
    if srv:
        lines.append("")
        rows = [("stock llama-server", "tok/s", "vs its plain (median/total)",
                 "vs edgespec target (median/total)", "draft acceptance", "same as its plain")]
        for name, c in srv["configs"].items():
            rows.append((name, f"{c['tokens_per_s']:.1f}",
                         f"{c['speedup_vs_server_plain']:.2f}x/{c['speedup_total_vs_server_plain']:.2f}x",
                         f"{c['speedup_vs_edgespec_target']:.2f}x/{c['speedup_total_vs_edgespec_target']:.2f}x",
                         f"{c['draft_acceptance']:.2f}" if c["draft_n"] else "-",
                         f"{c.get('same_as_server_plain_share', float('nan')):.2f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        lines.append(f"against the fastest stock speculation ({srv['best_speculative']}), median/total: "
                     + ", ".join(f"{n} {v['speedup']:.2f}x/{v['speedup_total']:.2f}x"
                                 for n, v in srv["methods_vs_best"].items()))
    lines.append(f"machine: {report['machine']['cpu']}, {report['machine']['threads']} threads")
    return "\n".join(lines)


def ensure_new(out: str | Path) -> Path:
    """Results are append-only: a report never replaces an earlier one."""
    out = Path(out)
    if out.exists():
        raise EdgespecError(f"{out} exists; bench reports are never overwritten: choose a new name")
    return out


def write_report(report: dict, out: str | Path) -> None:
    atomic_write_text(ensure_new(out), json.dumps(report, indent=1))


def plot(report: dict, out: str | Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EdgespecError("--plot needs matplotlib: pip install 'edgespec[plot]'") from None
    names = list(report["methods"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(names, [report["methods"][n]["tokens_per_s"] for n in names])
    a.set_ylabel("tokens/s")
    a.set_title(report["target"]["name"])
    for n in names:
        acc = report["methods"][n]["acceptance_by_position"]
        if acc:
            b.plot(range(1, len(acc) + 1), acc, marker="o", label=n)
    b.set_xlabel("draft position")
    b.set_ylabel("acceptance")
    b.legend()
    fig.tight_layout()
    fig.savefig(out)
    print(f"plot written to {out}", file=sys.stderr)
