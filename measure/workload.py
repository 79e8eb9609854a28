"""`edgespec bench --workload defaults`: the drop-in against `llama_cpp.Llama`, called the way an
app calls it, on the same file with the same arguments.

Each row is one app call: `create_completion(prompt, **args)` or
`create_chat_completion(messages, **args)` with llama-cpp-python's own defaults for everything
not given (they sample: T=0.8 for completions, T=0.2 for chat, top_k 40, top_p 0.95, min_p
0.05). Both objects run each prompt in turn (A B, A B, ...), with the same seed per prompt; the
time is the whole call's wall time, prompt included, as the app sees it. Reported: tok/s of
each, the median of per-prompt ratios and the total-tokens ratio (edgespec over llama.cpp).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.io import progress


@dataclass
class Workload:
    name: str
    target: str
    call: str  # "completion" | "chat"
    args: dict = field(default_factory=dict)  # what the app passes besides the prompt
    kinds: tuple[str, ...] = ("code", "prose")  # the bench prompts it runs on
    # the drop-in runs a verify-friendly copy of the file re-quantized to this type (`edgespec
    # export target --quant`); llama_cpp.Llama runs the user's own file, and the copy too
    copy_quant: str | None = None
    # call "chat-cli": the flags `edgespec chat` is given besides --target (the reference is
    # create_chat_completion with the sampling values those flags resolve to)
    cli: tuple[str, ...] = ()


def copy_workloads(quant: str) -> list[Workload]:
    """The SmolLM2 chat rows of `defaults` with the drop-in on a `quant` copy of the file."""
    return [Workload(f"smollm2-135m chat, library defaults, {quant} copy", "smollm2-135m", "chat",
                     kinds=("chat",), copy_quant=quant),
            Workload(f"smollm2-135m chat, temperature 0.8, {quant} copy", "smollm2-135m", "chat",
                     {"temperature": 0.8}, kinds=("chat",), copy_quant=quant)]


WORKLOADS = {
    "defaults": [
        Workload("gemma3-270m completion, temperature 0", "gemma3-270m", "completion", {"temperature": 0}),
        Workload("gemma3-270m completion, library defaults", "gemma3-270m", "completion"),
        Workload("smollm2-135m chat, library defaults", "smollm2-135m", "chat", kinds=("chat",)),
        Workload("smollm2-135m chat, temperature 0.8", "smollm2-135m", "chat", {"temperature": 0.8},
                 kinds=("chat",)),
    ],
    # `edgespec chat` (its ChatSession, opened from the command's own parsed arguments) against
    # llama_cpp.Llama's create_chat_completion with the same sampling values: two turns a
    # conversation, each side continuing its own, as a person chatting in a terminal does
    "chat-cli": [
        Workload("smollm2-135m edgespec chat, its defaults", "smollm2-135m", "chat-cli", kinds=("chat",)),
        Workload("smollm2-135m edgespec chat --temperature 0.8", "smollm2-135m", "chat-cli",
                 kinds=("chat",), cli=("--temperature", "0.8")),
    ],
}

# the second turn of a chat-cli conversation
FOLLOW_UP = "Thanks. Now say that again in two sentences."
CLI_DRAFT = "cli"  # --draft for a chat-cli row: whatever `edgespec chat` drafts with by default


def chat_cli_args(w: Workload, draft: str, max_tokens: int, n_ctx: int, threads: int):
    """`edgespec chat`'s parsed arguments for a chat-cli row (its own parser: its defaults)."""
    from edgespec.cli import build_parser

    argv = ["chat", "--target", w.target, "--max-tokens", str(max_tokens), "--n-ctx", str(n_ctx),
            "--threads", str(threads), *w.cli, *([] if draft == CLI_DRAFT else ["--draft", draft])]
    return build_parser().parse_args(argv)


def run_chat_cli(w: Workload, prompts: list[dict], max_tokens: int, n_ctx: int,
                 threads: int | None, draft: str | list[str]) -> dict:
    """One chat-cli row: each conversation (a prompt, then FOLLOW_UP) runs on llama_cpp.Llama
    and on each `edgespec chat` session in turn, with the same seed; times are each reply's
    wall time, its prompt's prefill included."""
    import dataclasses

    from llama_cpp import Llama

    from edgespec.runtime.chat import open_chat
    from edgespec.runtime.llama_target import default_threads
    from edgespec.targets import resolve_target

    chosen = [p for p in prompts if p.get("kind") in w.kinds]
    if not chosen:
        raise EdgespecError(f"workload '{w.name}' needs prompts of kind {' or '.join(w.kinds)}")
    threads = threads or default_threads()
    drafts = [draft] if isinstance(draft, str) else list(draft)
    if not drafts or len(set(drafts)) < len(drafts):
        raise EdgespecError("--workload needs distinct --draft values")
    parsed = [chat_cli_args(w, d, max_tokens, n_ctx, threads) for d in drafts]
    a = parsed[0]
    ref_args = dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                    repeat_penalty=a.repeat_penalty)
    ref = Llama(model_path=str(resolve_target(w.target)), n_ctx=n_ctx, n_threads=threads, verbose=False)
    sessions = {}
    try:
        for i, (d, args) in enumerate(zip(drafts, parsed)):
            sessions[_label(d, i == 0)] = open_chat(args)
        names = ["llama_cpp.Llama", *sessions]
        rows = {name: [] for name in names}
        bar = progress(total=len(names) * len(chosen), desc=w.name[:24], unit="chat")
        for i, p in enumerate(chosen[:1] + chosen, -1):  # the first conversation twice: a warm-up
            seed = 1000 + max(i, 0)
            for name in names:
                turns = []
                if name == "llama_cpp.Llama":
                    messages = []
                    for text in (p["prompt"], FOLLOW_UP):
                        messages.append({"role": "user", "content": text})
                        t0 = time.perf_counter()
                        out = ref.create_chat_completion(messages=messages, max_tokens=max_tokens,
                                                         seed=seed, **ref_args)
                        sec = time.perf_counter() - t0
                        reply = (out["choices"][0]["message"]["content"] or "").strip()
                        messages.append({"role": "assistant", "content": reply})
                        turns.append({"tokens": out["usage"]["completion_tokens"], "seconds": round(sec, 6),
                                      "text": reply})
                else:
                    s = sessions[name]
                    s.reset()
                    s.sampling = dataclasses.replace(s.sampling, seed=seed)  # as `--seed` would
                    for text in (p["prompt"], FOLLOW_UP):
                        t0 = time.perf_counter()
                        gen = s.reply(text)
                        sec = time.perf_counter() - t0
                        st = gen.stats
                        turns.append({"tokens": st.tokens, "seconds": round(sec, 6), "text": gen.text.strip(),
                                      "speculative": {"verify_passes": st.verify_passes,
                                                      "drafted": st.drafted, "accepted": st.accepted}})
                if i >= 0:
                    rows[name].append({"kind": p.get("kind"), "turns": turns,
                                       "tokens": sum(t["tokens"] for t in turns),
                                       "seconds": round(sum(t["seconds"] for t in turns), 6)})
                    bar.update(1)
        bar.close()
    finally:
        ref.close()
        for s in sessions.values():
            s.engine.close()
    med, tot = _ratios(rows["edgespec"], rows["llama_cpp.Llama"])
    rate = lambda rs: round(sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs), 3)  # noqa: E731

    def same(x: str, y: str) -> float:  # share of replies (both turns) word for word the reference's
        pairs = [(t["text"], u["text"]) for a_, b_ in zip(rows[x], rows[y]) for t, u in zip(a_["turns"], b_["turns"])]
        return round(sum(t == u for t, u in pairs) / len(pairs), 4)

    out = {"name": w.name, "target": w.target, "call": w.call, "cli": list(w.cli),
           "args": ref_args, "draft": a.draft, "prompts": len(chosen), "turns": 2,
           "tokens_per_s": {k: rate(v) for k, v in rows.items()}, "speedup": med, "speedup_total": tot,
           "same_text_share": same("edgespec", "llama_cpp.Llama"), "per_prompt": rows}
    if len(drafts) > 1:
        out["others"] = {d: {"speedup": list(_ratios(rows[_label(d, False)], rows["llama_cpp.Llama"])),
                             "same_text_share": same(_label(d, False), "llama_cpp.Llama")}
                         for d in drafts[1:]}
    return out


def _call(llm, w: Workload, prompt: str, max_tokens: int, seed: int) -> tuple[int, float, str, dict | None]:
    """(completion tokens, wall seconds, text, edgespec's decoding report or None) of one app call."""
    t0 = time.perf_counter()
    if w.call == "chat":
        out = llm.create_chat_completion(messages=[{"role": "user", "content": prompt}],
                                         max_tokens=max_tokens, seed=seed, **w.args)
        text = out["choices"][0]["message"]["content"] or ""
    else:
        out = llm.create_completion(prompt, max_tokens=max_tokens, seed=seed, **w.args)
        text = out["choices"][0]["text"]
    sec = time.perf_counter() - t0
    spec = out.get("speculative")
    if spec is not None:  # how the drop-in decoded: passes, drafts and where they came from
        spec = {k: spec[k] for k in ("verify_passes", "drafted", "accepted", "hidden_passes", "prefill_s", "draft_s",
                                     "verify_s", "by_source") if k in spec}
    return out["usage"]["completion_tokens"], sec, text, spec


def _ratios(ours: list[dict], ref: list[dict]) -> tuple[float, float]:
    rate = lambda r: r["tokens"] / r["seconds"]  # noqa: E731
    med = statistics.median(rate(a) / rate(b) for a, b in zip(ours, ref))
    tot = (sum(r["tokens"] for r in ours) / sum(r["seconds"] for r in ours)) / \
        (sum(r["tokens"] for r in ref) / sum(r["seconds"] for r in ref))
    return round(med, 4), round(tot, 4)


def _label(draft: str, first: bool) -> str:
    """The name of the drop-in with this draft in a row's results ("edgespec" for the first)."""
    return "edgespec" if first else f"edgespec (draft {draft})"


def run_workload(w: Workload, prompts: list[dict], max_tokens: int, n_ctx: int,
                 threads: int | None, draft: str | list[str], copy: dict | None = None) -> dict:
    """draft: the drop-in's draft, or several: each is one more drop-in in the same interleaved
    run ("edgespec" is the first, the others "edgespec (draft X)"), so configurations compare
    with llama_cpp.Llama and with each other on the same machine state.
    copy: for a row with `copy_quant`, the export report of the copy (its "out" is the file
    the drop-in runs; llama_cpp.Llama runs it too, as "llama_cpp.Llama (copy)")."""
    from llama_cpp import Llama

    from edgespec.runtime.api import SpeculativeLlama
    from edgespec.runtime.llama_target import default_threads
    from edgespec.targets import resolve_target

    chosen = [p for p in prompts if p.get("kind") in w.kinds]
    if not chosen:
        raise EdgespecError(f"workload '{w.name}' needs prompts of kind {' or '.join(w.kinds)}")
    path = str(resolve_target(w.target))
    threads = threads or default_threads()
    mine = copy["out"] if copy else path
    drafts = [draft] if isinstance(draft, str) else list(draft)
    if not drafts or len(set(drafts)) < len(drafts):
        raise EdgespecError("--workload needs distinct --draft values")
    llms = {"llama_cpp.Llama": Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, verbose=False)}
    for i, d in enumerate(drafts):
        llms[_label(d, i == 0)] = SpeculativeLlama(model_path=mine, n_ctx=n_ctx, n_threads=threads,
                                                   draft=None if d == "none" else d)
    if copy:
        llms["llama_cpp.Llama (copy)"] = Llama(model_path=mine, n_ctx=n_ctx, n_threads=threads, verbose=False)
    try:
        for llm in llms.values():  # the first call pages the file in
            _call(llm, w, "Warm-up: the quick brown fox", 8, 0)
        rows = {name: [] for name in llms}
        bar = progress(total=len(llms) * len(chosen), desc=w.name[:24], unit="call")
        for i, p in enumerate(chosen):
            for name, llm in llms.items():
                n, sec, text, spec = _call(llm, w, p["prompt"], max_tokens, seed=1000 + i)
                rows[name].append({"kind": p.get("kind"), "tokens": n, "seconds": round(sec, 6),
                                   "text": text, **({"speculative": spec} if spec else {})})
                bar.update(1)
        bar.close()
    finally:
        for llm in llms.values():
            llm.close()
    med, tot = _ratios(rows["edgespec"], rows["llama_cpp.Llama"])
    rate = lambda rs: round(sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs), 3)  # noqa: E731
    same = lambda a, b: round(sum(x["text"] == y["text"] for x, y in zip(rows[a], rows[b])) / len(chosen), 4)  # noqa: E731
    out = {"name": w.name, "target": w.target, "call": w.call, "args": w.args, "draft": drafts[0],
           "prompts": len(chosen), "tokens_per_s": {k: rate(v) for k, v in rows.items()},
           "speedup": med, "speedup_total": tot, "same_text_share": same("edgespec", "llama_cpp.Llama"),
           "per_prompt": rows}
    if len(drafts) > 1:  # the other drafts, each against llama_cpp.Llama as the first is
        out["others"] = {d: {"speedup": list(_ratios(rows[_label(d, False)], rows["llama_cpp.Llama"])),
                             "same_text_share": same(_label(d, False), "llama_cpp.Llama")}
                         for d in drafts[1:]}
    if copy:  # the copy's own speed apart from speculation, and how far its text is the file's
        out["copy"] = {k: copy.get(k) for k in ("mode", "top1_agreement", "size_source", "size_out",
                                                 "verify_ms_source", "verify_ms_out")}
        out["speedup_vs_copy"] = _ratios(rows["edgespec"], rows["llama_cpp.Llama (copy)"])
        out["copy_vs_file"] = _ratios(rows["llama_cpp.Llama (copy)"], rows["llama_cpp.Llama"])
        out["same_text_share_copy_vs_file"] = same("llama_cpp.Llama (copy)", "llama_cpp.Llama")
    return out


def bench_workload(name: str, prompts: list[dict], max_tokens: int = 128, n_ctx: int = 2048,
                   threads: int | None = None, draft: str | list[str] = "default", copy_quant: str = "Q4_0",
                   only: str | None = None) -> dict:
    """Every row of workload `name` (see WORKLOADS; "verify-friendly": `copy_workloads` of
    `copy_quant`, the copy exported once into a temporary folder with its agreement report);
    only: just the rows whose name holds this text."""
    import tempfile

    from edgespec.measure.bench import machine_info
    from edgespec.runtime.llama_target import default_threads

    if name == "verify-friendly":
        from edgespec.exporters.target import QUANT_FTYPES, export_target

        if copy_quant not in QUANT_FTYPES:
            raise EdgespecError(f"unknown --copy-quant {copy_quant}; choose from {', '.join(QUANT_FTYPES)}")
        with tempfile.TemporaryDirectory() as td:
            rows = []
            for w in copy_workloads(copy_quant):
                copy = export_target(w.target, Path(td) / f"{w.target}-{copy_quant}.gguf", head_type=None,
                                     threads=threads, quant=copy_quant)
                rows.append(run_workload(w, prompts, max_tokens, n_ctx, threads, draft, copy))
    elif name in WORKLOADS:
        chosen = [w for w in WORKLOADS[name] if not only or only in w.name]
        if not chosen:
            raise EdgespecError(f"no row of workload '{name}' has '{only}' in its name; rows: "
                                + "; ".join(w.name for w in WORKLOADS[name]))
        rows = [(run_chat_cli if w.call == "chat-cli" else run_workload)(w, prompts, max_tokens, n_ctx,
                                                                        threads, draft) for w in chosen]
    else:
        raise EdgespecError(f"unknown workload '{name}'; choose from {', '.join([*WORKLOADS, 'verify-friendly'])}")
    return {"workload": name, "max_tokens": max_tokens, "n_ctx": n_ctx, "rows": rows,
            **({"only": only} if only else {}),
            "reference": "llama_cpp.Llama on the same file with the same call, arguments and seeds",
            "machine": machine_info(threads or default_threads())}


def _per_pass(row: dict) -> str:
    """Tokens the drop-in emitted per verify pass over the row's prompts ("-" where unknown)."""
    ours = row["per_prompt"]["edgespec"]
    ours = [t for r in ours for t in r.get("turns", [r])]  # chat-cli rows: every reply
    passes = sum(r.get("speculative", {}).get("verify_passes", 0) for r in ours)
    return f"{sum(r['tokens'] for r in ours) / passes:.2f}" if passes else "-"


def format_workload(report: dict) -> str:
    who = "`edgespec chat`" if report["workload"] == "chat-cli" else "edgespec's drop-in"
    lines = [f"workload {report['workload']}: {who} vs llama_cpp.Llama, the same call "
             f"(wall time incl. prompt, {report['max_tokens']} new tokens at most)",
             f"{'row':44s} {'llama.cpp tok/s':>15s} {'edgespec tok/s':>14s} {'median':>7s} "
             f"{'total':>7s} {'tok/pass':>8s}"]
    for r in report["rows"]:
        t = r["tokens_per_s"]
        lines.append(f"{r['name']:44s} {t['llama_cpp.Llama']:15.1f} {t['edgespec']:14.1f} "
                     f"{r['speedup']:6.2f}x {r['speedup_total']:6.2f}x {_per_pass(r):>8s}")
        for d, o in r.get("others", {}).items():
            m, tt = o["speedup"]
            lines.append(f"  draft {d}: {t[_label(d, False)]:.1f} tok/s, {m:.2f}x/{tt:.2f}x llama_cpp.Llama, "
                         f"same text {o['same_text_share']}")
        if "copy" in r:
            (m, tt), (cm, ct) = r["speedup_vs_copy"], r["copy_vs_file"]
            lines.append(f"  llama_cpp.Llama on the copy: {t['llama_cpp.Llama (copy)']:.1f} tok/s, "
                         f"{cm:.2f}x/{ct:.2f}x the file; edgespec {m:.2f}x/{tt:.2f}x it; top-1 agreement "
                         f"with the file {r['copy']['top1_agreement']}, same text {r['same_text_share_copy_vs_file']}")
    return "\n".join(lines)
