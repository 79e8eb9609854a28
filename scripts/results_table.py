"""Regenerate the measured figures from the committed JSON in results/: the headline table of
README.md and the Results block of results/README.md. Every measured figure in the docs comes
from here. Results files are append-only (a new run gets a new file).

Run: .venv/bin/python scripts/results_table.py          (rewrites the blocks between the markers)
     .venv/bin/python scripts/results_table.py --check  (exit 1 if a file is not what it writes)
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
HEAD_BEGIN, HEAD_END = "<!-- headline:begin -->", "<!-- headline:end -->"
# the bench the README's headline quotes: the latest default-configuration run with stock
# llama.cpp's own speculation in it
HEADLINE = "bench-gemma3-270m-session20.json"
# and the app's view beside it: the drop-in against llama_cpp.Llama (`bench --workload defaults`)
HEADLINE_APP = "workload-defaults-session24.json"
# and how long the README's first command takes on a fresh clone
HEADLINE_DEMO = "demo-time.json"


def table(intro: str, header: list[str], rows: list[list]) -> str:
    """A paragraph, then a markdown table."""
    line = lambda cells: "| " + " | ".join(str(c) for c in cells) + " |"  # noqa: E731
    return "\n".join([intro, "", line(header), "|" + "---|" * len(header), *map(line, rows)])


def _total(m: dict, ref: dict | None, stored: str = "speedup_total") -> float:
    """Total-tokens ratio (all tokens over all decode time) against `ref`, as the report stored
    it under `stored` ("speedup_total": against the target row, "speedup_total_vs_baseline":
    against the baseline row); reports written before the bench stored it are computed from
    their own tokens/s, the same quantity."""
    if ref is None:
        return 0.0
    return m.get(stored) or m["tokens_per_s"] / ref["tokens_per_s"]


def bench_table(path: Path) -> str:
    r = json.loads(path.read_text())
    m0 = r["machine"]
    base = r.get("baseline")
    ref, bref = r["methods"]["target"], r["methods"].get("baseline")
    k = {m["k"] for m in r["settings"]["methods"] if m["kind"] != "target"}
    lines = [f"`{path.relative_to(ROOT)}`: target `{r['target']['file']}` on "
             f"{r['target'].get('engine', 'llama.cpp')} (LM head "
             f"{r['target']['lm_head_type']}), {r['settings']['prompts']} prompts, "
             f"{r['settings']['max_new_tokens']} new tokens, "
             + (f"{r['settings']['background_load']} CPU hog(s) during the timed runs, "
                if r["settings"].get("background_load") else "") + "temperature "
             f"{r['settings'].get('temperature', 0.0)}, k <= {max(k)}, {m0['cpu']}, "
             f"{m0['threads']} threads"
             + (f"; baseline: target-only on `{base['file']}` ({base['engine']}) in the same run"
                if base else ""),
             "",
             "| method | policy | tok/s | speedup vs target-only (median / total) | "
             + ("vs baseline (median / total) | " if base else "")
             + "tokens/pass | acceptance by position | "
             "ms/draft step | ms/verify | same output as target | code | prose | chat |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if base else "")]
    policies = {m["name"]: (m["policy"] if m["kind"] != "target" else "-") for m in r["settings"]["methods"]}
    for name, m in r["methods"].items():
        kinds = {k: f"{v['speedup']:.2f}x" for k, v in m["by_kind"].items()}
        acc = " ".join(f"{a:.2f}" for a in m["acceptance_by_position"]) or "-"
        vs = (f"{m['speedup_vs_baseline']:.2f}x / {_total(m, bref, 'speedup_total_vs_baseline'):.2f}x | "
              if base else "")
        lines.append(f"| {name} | {policies.get(name, '-')} | {m['tokens_per_s']:.1f} | "
                     f"{m['speedup']:.2f}x / {_total(m, ref):.2f}x | {vs}"
                     f"{m['mean_accepted']:.2f} | {acc} | {m['ms_per_draft_step']:.2f} | "
                     f"{m['ms_per_verify']:.2f} | {m.get('same_as_target_share', 0):.2f} | "
                     f"{kinds.get('code', '-')} | {kinds.get('prose', '-')} | {kinds.get('chat', '-')} |")
    mem = r.get("memory")
    lines.append("")
    if mem is None:
        lines.append("Memory not measured in this run (`--no-memory`)"
                     + (f"; {r['settings']['background_load']} CPU-hogging process(es) ran during the timed runs."
                        if r["settings"].get("background_load") else "."))
    elif "plain_llama_cpp_peak_rss_mb" in mem:
        lines.append(f"Peak RSS, each configuration in a fresh process: {mem['reference']} "
                     f"{mem['plain_llama_cpp_peak_rss_mb']:.0f} MB; "
                     + ", ".join(f"{n} {v['peak_rss_mb']:.0f} MB ({100 * v['vs_plain_llama_cpp']:+.0f}%)"
                                 for n, v in mem["methods"].items()) + ".")
    else:
        lines.append(f"RSS (one process, measured before the bench compared against plain llama.cpp): "
                     f"after loading the target engine {mem['rss_after_target_mb']:.0f} MB, after the "
                     f"drafters {mem['rss_after_drafters_mb']:.0f} MB "
                     f"(+{100 * mem['drafters_share_of_target']:.0f}%), peak {mem['peak_rss_mb']:.0f} MB.")
    srv = r.get("peers", {}).get("llama-server")
    if srv:
        lines += ["", f"Stock llama-server (llama-cpp-python {srv['llama_cpp_python']}'s llama.cpp, "
                  f"{srv['rounds']} rounds: one before the interleaved runs, one after) on the same "
                  "prompt tokens:", "",
                  "| llama-server | tok/s | vs its plain decoding (median / total) | vs edgespec's "
                  "target row (median / total) | draft acceptance | drafts per verify step | same "
                  "text as its plain decoding |", "|---|---|---|---|---|---|---|"]
        for name, c in srv["configs"].items():
            steps = c.get("verify_steps_with_drafts", 0)
            lines.append(f"| {name} | {c['tokens_per_s']:.1f} | {c['speedup_vs_server_plain']:.2f}x / "
                         f"{c['speedup_total_vs_server_plain']:.2f}x | {c['speedup_vs_edgespec_target']:.2f}x / "
                         f"{c['speedup_total_vs_edgespec_target']:.2f}x | "
                         + (f"{c['draft_acceptance']:.2f} | {c['draft_n'] / steps:.1f} | " if c["draft_n"] and steps
                            else "- | - | ")
                         + f"{c.get('same_as_server_plain_share', 0):.2f} |")
        lines += ["", f"Each edgespec row against the fastest stock speculative configuration "
                  f"(`{srv['best_speculative']}`), median / total: "
                  + ", ".join(f"{n} {v['speedup']:.2f}x / {v['speedup_total']:.2f}x"
                              for n, v in srv["methods_vs_best"].items()) + "."]
    turn = r.get("second_turn")
    if turn:
        lines.append("")
        lines.append(f"Second turn (each prompt, its reply and a follow-up request; median of "
                     f"{turn['prompts']} prompts, {turn['median_prompt_tokens']:.0f} tokens): prefill "
                     f"{turn['median_prefill_reused_ms']:.1f} ms keeping the cache "
                     f"({turn['median_tokens_reused']:.0f} tokens reused), "
                     f"{turn['median_prefill_fresh_ms']:.1f} ms from an empty cache "
                     f"(median ratio {turn['median_prefill_speedup']:.1f}x).")
    return "\n".join(lines)


def serve_table(path: Path) -> str:
    r = json.loads(path.read_text())
    st, m0 = r["settings"], r["machine"]
    ref = {p["clients"]: p["total_tok_s"] for p in r["servers"].get("llama-server", [])}
    rows = [[name, p["clients"], p["requests"], f"{p['total_tok_s']:.1f}",
             f"{p['total_tok_s'] / ref[p['clients']]:.2f}x" if ref.get(p["clients"]) else "-",
             f"{p['ttft_p50_ms']:.0f}", f"{p['ttft_p95_ms']:.0f}", f"{p['request_tok_s_median']:.1f}"]
            for name, phases in r["servers"].items() for p in phases]
    slots = f"; every server with {st['slots']} slots" if "slots" in st else ""
    return table(f"`{path.relative_to(ROOT)}` (`edgespec bench-serve`): target `{r['target']['file']}`, "
                 f"greedy, {st['max_tokens']} new tokens per request, {st['requests_per_client']} "
                 f"requests per client, streamed{slots}; {m0['cpu']}, {m0['threads']} threads.",
                 ["server", "clients", "requests", "total tok/s", "vs llama-server", "TTFT p50 ms",
                  "TTFT p95 ms", "request tok/s (median)"], rows)


def parallel_agreement_table(path: Path) -> str:
    r = json.loads(path.read_text())
    m0 = r["machine"]
    rows = [[d, f"{x['identical']} of {x['of']}",
             "-" if x["first_difference_median"] is None else x["first_difference_median"],
             f"{x['target_argmax_share_mean']:.4f}", f"{x['target_argmax_share_min']:.4f}",
             f"{x['rows_per_batch']:.2f}"] for d, x in r["drafts"].items()]
    return table(f"`{path.relative_to(ROOT)}` (`scripts/parallel_agreement.py`): {r['target']}, the "
                 f"first {r['prompts']} bench prompts, greedy, {r['max_tokens']} new tokens, alone and "
                 f"then {r['slots']} at a time on `--parallel {r['slots']}` slots; {m0['cpu']}, "
                 f"{m0['threads']} threads.",
                 ["drafter", "replies identical to alone", "first difference (median token)",
                  "target argmax share, mean", "target argmax share, lowest reply", "rows per batch"],
                 rows)


def llama_lib_cost_table(path: Path) -> str:
    r = json.loads(path.read_text())
    m0 = r["machine"]
    rows = []
    for name, c in r["configs"].items():
        st, inv, vs = c["stock"], c["invariant"], c["invariant_vs_stock"]
        rows.append([name, f"{st['tok_s_median']:.1f}", f"{inv['tok_s_median']:.1f}",
                     f"{vs['median']:.2f}x / {vs['total']:.2f}x",
                     f"{st['same_as_llama_cpp']} / {inv['same_as_llama_cpp']} of {inv['prompts']}",
                     f"{st['same_as_plain']} / {inv['same_as_plain']} of {inv['prompts']}",
                     f"{st['exact_runs']} / {inv['exact_runs']}"])
    reuse = []
    for lib, per in r["prefix_reuse"].items():
        for name, t in per.items():
            reuse.append(f"{name} on the {lib} library {1000 * t['kept']['seconds_to_first_token']:.0f} ms "
                         f"with the first turn kept vs {1000 * t['empty']['seconds_to_first_token']:.0f} ms "
                         f"from an empty cache ({t['kept']['prompt_tokens']} prompt tokens)")
    return (table(f"`{path.relative_to(ROOT)}` (`scripts/llama_lib_cost.py`): {r['target']}, "
                  f"{r['prompts']} bench prompts, greedy, {r['max_tokens']} new tokens, whole calls timed "
                  f"(prompt included), the stock and the batch-invariant llama.cpp library in alternating "
                  f"fresh processes, {r['rounds']} rounds; {m0['cpu']}, {m0['threads']} threads.",
                  ["configuration", "stock tok/s (median)", "invariant tok/s (median)",
                   "invariant vs stock (median / total)", "same text as llama_cpp.Llama (stock / invariant)",
                   "same text as edgespec plain (stock / invariant)", "runs marked exact (stock / invariant)"],
                  rows)
            + "\n\nA chat's second turn, time to its first token: " + "; ".join(reuse) + ".")


def speculators_export_table(path: Path) -> str:
    r = json.loads(path.read_text())
    c = r["check"]
    equal = sum(c["tensors_equal"].values())
    return table(f"`{path.relative_to(ROOT)}` (`edgespec export speculators --check`): the folder "
                 f"loaded by the speculators package ({c['config_class']}, {c['model_class']}) and "
                 f"run for one draft step on held-out features beside the trained head.",
                 ["verifier", "dtype", "MB", "tensors loaded as written", "positions",
                  "top-1 agreement", "max logit error"],
                 [[r["verifier"], r["dtype"], f"{r['bytes'] / 2**20:.1f}",
                   f"{equal} of {len(c['tensors_equal'])}", c["compared"],
                   f"{c['top1_agreement']:.4f}", f"{c['max_logit_error']:.4f}"]])


def eagle3_export_table(path: Path) -> str:
    r = json.loads(path.read_text())
    c, t, e = r["check"], r["train"], r["eval_head"]
    acc = e["acceptance_by_position"]
    return table(f"`{path.relative_to(ROOT)}`: EAGLE-3 head for {r['target']} (layers "
                 f"{', '.join(map(str, r['target_layers']))}), {t['trainable_parameters'] / 1e6:.2f}M "
                 f"trainable parameters, {t['steps']} steps of batch {t['batch']} on {t['train_tokens']} "
                 f"training tokens ({t['features_dtype']} features) in {t['seconds'] / 60:.0f} min; "
                 f"`{Path(r['out']).name}` {r['quant']}, {r['bytes'] / 2**20:.1f} MB. Offline acceptance "
                 f"on held-out features ({e['positions']} chain starts) and the file read back against "
                 f"the trained head ({c['compared']} positions, max logit error {c['max_logit_error']:.2f}).",
                 ["draft step", *range(1, len(c["top1_agreement_by_step"]) + 1)],
                 [["acceptance (trained head)", *(f"{a:.3f}" for a in acc[:len(c["top1_agreement_by_step"])])],
                  ["top-1 agreement, file vs trained", *(f"{a:.4f}" for a in c["top1_agreement_by_step"])]])


def _speeds(p: dict) -> list[str]:
    """A prompt's plain and draft-eagle3 tok/s; "-" where it generated nothing (the first
    check's JSON recorded a speed there: tokens over a zero decode time)."""
    if not p["tokens"]:
        return ["-", "-"]
    return [f"{p['tok_s_plain']:.1f}", f"{p['tok_s_eagle3']:.1f}"]


def eagle3_check_table(path: Path) -> str:
    r = json.loads(path.read_text())
    m = r["machine"]
    rows = [[i + 1, p["prompt_tokens"], p["tokens"], p["llama_drafted"],
             f"{p['llama_acceptance']:.3f}", f"{p['edgespec_acceptance']:.3f}",
             "yes" if p["same_text_as_plain"] else "no", *_speeds(p)]
            for i, p in enumerate(r["per_prompt"])]
    rows.append(["all", "", "", "", f"{r['llama_acceptance']:.3f}", f"{r['edgespec_acceptance']:.3f}",
                 f"{r['same_text_as_plain_share']:.2f}", f"{r['tok_s_plain']:.1f}", f"{r['tok_s_eagle3']:.1f}"])
    return table(f"`{path.relative_to(ROOT)}` (`scripts/eagle3_check.py`): the EAGLE-3 head "
                 f"`{Path(r['head']).name}` inside stock llama-server (`{' '.join(r['server_args'][2:])}`, "
                 f"its default 3 drafts per step), greedy, {r['n_predict']} new tokens per prompt: "
                 "llama.cpp's own acceptance (its /metrics) against edgespec's replay of the same draft "
                 "loop with the file's weights on the same text; whether the text equals llama-server's "
                 f"plain greedy text; both speeds from its timings. {m['cpu']}, {m['threads']} threads.",
                 ["prompt", "prompt tokens", "new tokens", "drafted", "llama.cpp acceptance",
                  "edgespec replay", "same text as plain", "plain tok/s", "draft-eagle3 tok/s"], rows)


def assistant_check_table(path: Path) -> str:
    r = json.loads(path.read_text())
    m = r["machine"]
    rows = [[i + 1, p["prompt_tokens"], p["tokens"], p["llama_drafted"],
             f"{p['llama_acceptance']:.3f}", f"{p['edgespec_acceptance']:.3f}",
             "yes" if p["same_text_as_plain"] else "no", p["tok_s_plain"], p["tok_s_mtp"]]
            for i, p in enumerate(r["per_prompt"])]
    rows.append(["all", "", "", "", f"{r['llama_acceptance']:.3f}", f"{r['edgespec_acceptance']:.3f}",
                 f"{r['same_text_as_plain_share']:.2f}", f"{r['tok_s_plain']:.1f}", f"{r['tok_s_mtp']:.1f}"])
    return table(f"`{path.relative_to(ROOT)}` (`scripts/assistant_check.py`): the shared-KV head's "
                 f"gemma4-assistant export `{Path(r['head']).name}` in `{r['server']}` "
                 f"(`{' '.join(r['server_args'][2:])}`, llama.cpp's default 3 drafts per step), greedy, "
                 f"{r['n_predict']} new tokens per prompt: llama.cpp's own acceptance (its /metrics) against "
                 "edgespec's replay of the same draft loop with the file's tensors on the same text; "
                 f"whether the text equals the server's plain greedy text; both speeds from its timings. "
                 f"{m['cpu']}, {m['threads']} threads.",
                 ["prompt", "prompt tokens", "new tokens", "drafted", "llama.cpp acceptance",
                  "edgespec replay", "same text as plain", "plain tok/s", "draft-mtp tok/s"], rows)


def summary_table(paths: list[Path]) -> str:
    """One row per drafting method of every bench report: the figures to compare at a glance."""
    rows = []
    for path in paths:
        r = json.loads(path.read_text())
        ref = r["methods"]["target"]
        engine = r["target"].get("engine", "llama.cpp")
        lm = r["target"]["lm_head_type"]
        head = "low-rank (greedy)" if "rank-" in lm else "batched" if "onnxruntime pass" in lm else "full"
        # since the bench added "target:lowrank" / "target:batched", its "target" row is plain llama.cpp
        own_head = "target:lowrank" in r["methods"] or "target:batched" in r["methods"]
        target_row = "plain llama.cpp" if own_head else f"{engine}, {head} head"
        st = r["settings"]
        cond = ", ".join([f"T={st.get('temperature', 0.0)}"]
                         + ([f"{st['background_load']} CPU hog(s)"] if st.get("background_load") else []))
        for name, m in r["methods"].items():
            if name in ("target", "baseline"):
                continue
            rows.append([f"`{path.stem}`", cond, engine, head, target_row, name,
                         f"{ref['tokens_per_s']:.1f}", f"{m['tokens_per_s']:.1f}",
                         f"{m['speedup']:.2f}x", f"{_total(m, ref):.2f}x", f"{m['mean_accepted']:.2f}"])
    return table("Every bench run at a glance: speedups are against the `target` row of the same "
                 "run (target-only decoding, on the engine named), as the median of per-prompt "
                 "ratios and as the total-tokens ratio.",
                 ["report", "conditions", "engine", "LM head", "target row", "method", "target tok/s", "tok/s",
                  "median", "total", "tokens/pass"], rows)


def feature_error_table(path: Path) -> str:
    r = json.loads(path.read_text())
    rows = [[x["dtype"], x["group_size"], x["transform"], f"{x['kl_to_fp16']:.5f}",
             f"{x['top1_agreement']:.4f}", f"{x['relative_error']:.4f}"] for x in r["rows"]]
    return table(f"Stored hidden states against fp16 (`{path.relative_to(ROOT)}`, "
                 f"`scripts/feature_quant_error.py`): the teacher distribution over the draft "
                 f"vocabulary ({r['draft_vocab']} tokens) at {r['tokens']} held-out tokens; {r['note']}.",
                 ["dtype", "group", "transform", "KL to fp16", "top-1 agreement", "relative error"], rows)


def cost_table(intro: str, curves: dict[str, list[float]]) -> str:
    """A paragraph, then c(k) for k = 1.. per labelled row."""
    ks = range(1, len(next(iter(curves.values()))) + 1)
    return table(intro, ["k (tokens checked in one decode)", *ks],
                 [[f"c(k) ms, {label}", *(f"{x:.1f}" for x in c)] for label, c in curves.items()])


def export_table(path: Path) -> str:
    r = json.loads(path.read_text())
    return cost_table(
        f"`{path.relative_to(ROOT)}`: LM head {r['source_head_type']} -> {r['head_type']} "
        f"({r['mode']}), top-1 agreement with the original {r['top1_agreement']:.3f} on held-out "
        f"text, size {r['size_source'] / 2**20:.0f} -> {r['size_out'] / 2**20:.0f} MB, {r['threads']} threads",
        {"shipped file": r["verify_ms_source"],
         (f"{r['mode'][6:]} trunk" if r["mode"].startswith("quant ") else f"{r['head_type']} head"):
         r["verify_ms_out"]})


def onnx_target_table(path: Path) -> str:
    r = json.loads(path.read_text())
    c = r["check"]
    return cost_table(
        f"`{path.relative_to(ROOT)}`: ONNX target, {r['quant']}, LM head {r['lm_head']}, "
        f"{r['bytes'] / 2**20:.0f} MB, exported in {r['export_s'] / 60:.1f} min. Greedy top token "
        f"against the exact logits (the GGUF's LM head in fp32) at {c['positions']} held-out "
        f"positions: low-rank search {c['lowrank_top1_agreement_with_exact']:.4f}, full ONNX int8 "
        f"LM head {c['full_head_top1_agreement_with_exact']:.4f}. Greedy {c['max_tokens']}-token "
        f"continuations of {c['prompts']} prompts equal to llama.cpp's: "
        f"{c['same_continuation_share']:.2f} (mean matching prefix {c['mean_matching_prefix']}); "
        f"target-only {c['tokens_per_s_onnxruntime']} tok/s vs llama.cpp {c['tokens_per_s_llama_cpp']}.",
        {"shipped file on llama.cpp": c["verify_ms_llama_cpp"],
         "ONNX target (low-rank LM head)": c["verify_ms_onnxruntime"]})


def lowrank_basis_table(path: Path) -> str:
    r = json.loads(path.read_text())
    c = r["check"]
    kinds = ", ".join(f"{k} {v:.4f}" for k, v in c["by_kind"].items())
    return cost_table(
        f"`{path.relative_to(ROOT)}`: low-rank LM head basis for {r['target']} on llama.cpp, rank "
        f"{r['rank']} from {r['calibration_tokens']} calibration tokens ({r['calibration_s']:.0f} s). "
        f"Greedy top token equal to llama.cpp's full LM head at {c['positions']} positions of "
        f"greedy continuations of the bench prompts, in 8-token batches: "
        f"{c['top1_agreement_with_llama_cpp']:.4f} ({kinds}).",
        {"llama.cpp, full LM head": c["ms_full"], "llama.cpp, low-rank LM head": c["ms_lowrank"]})


def chain_rule(e: dict) -> str:
    """Which chain rule an eval-head JSON was scored with (older JSONs keep the earlier rule)."""
    if "text_is_target_choice" in e:
        return (f"chains followed only while the text is the target's greedy choice, as at run time "
                f"(the text's next token was that choice at {e['text_is_target_choice']:.3f} of positions)")
    return ("earlier rule: every draft, the first included, also counted as missed where the text's "
            "next token was not the target's greedy choice")


def scaling_table(path: Path) -> str:
    r = json.loads(path.read_text())
    pool = ", ".join(f"`{Path(f['folder']).name}` ({f['tokens']} tokens, {f['dtype']}, extracted at "
                     f"{f['extract_tokens_per_s']:.0f} tok/s)" for f in r["pool"])
    rows = []
    for x in r["rows"]:
        e = x["eval"]
        rows.append([x["label"], x["train_tokens"], x["train_samples"], x["steps"],
                     f"{x['train_seconds'] / 60:.0f}", f"{x['draft_vocab_coverage']:.3f}",
                     " ".join(f"{a:.3f}" for a in e["acceptance_by_position"][:4]),
                     f"{e['expected_accepted']['1']:.3f}", f"{e['expected_accepted']['4']:.3f}"])
    m = r["machine"]
    return table(f"Data scaling for {r['target']} (`{path.relative_to(ROOT)}`, `scripts/scaling_curve.py`): "
                 + (f"the same recipe ({r['steps']} steps) on growing random subsets of one pool, {pool}; "
                    if all(x["steps"] == r["steps"] for x in r["rows"]) else
                    f"the same recipe at each row's steps on one pool, {pool}; ")
                 + f"every head scored on the held-out samples of `{Path(r['eval_features']).name}` "
                 f"({r['rows'][0]['eval']['samples']} samples, {r['rows'][0]['eval']['positions']} chain "
                 f"starts; {chain_rule(r['rows'][0]['eval'])}); {m['cpu']}, {m['cores']} cores, "
                 f"torch {m['versions'].get('torch')}.",
                 ["point", "training tokens", "samples", "steps", "train min", "draft vocab coverage",
                  "acceptance by position 1-4", "expected accepted, k=1", "k=4"], rows)


def _stored(f: dict) -> str:
    """What a features folder holds besides the final hidden states."""
    parts = [f"layers {f['layers']}"] if f.get("layers") else []
    if f.get("kv_layers"):
        parts.append(f"the keys and values of layers {f['kv_layers']} ({f['bytes_per_token']:.0f} bytes a token)")
    return " and ".join(parts) or "nothing"


def head_ablation_table(path: Path) -> str:
    r = json.loads(path.read_text())
    f, e0 = r["features"], next(iter(r["rows"].values()))["eval"]
    rows = [[name, x["arch"], x["draft_vocab"], f"{x['draft_vocab_coverage']:.3f}",
             f"{x['topk_weight']:g}" if x["topk_weight"] else "", x.get("seed", 0),
             f"{x['trainable_parameters'] / 1e6:.2f}",
             " ".join(f"{a:.3f}" for a in x["acceptance_by_position"][:4]),
             *(f"{x['expected_accepted'][k]:.3f}" for k in "148"), f"{x['seconds'] / 60:.0f}"]
            for name, x in r["rows"].items()]
    return table(f"Head ablation for {r['target']} (`{path.relative_to(ROOT)}`, `scripts/head_ablation.sh`): "
                 f"one {f['dtype']} folder of {f['tokens']} tokens ({r['data']}; {_stored(f)} stored "
                 f"too), {r['steps']} steps each; scored on its {e0['samples']} held-out samples "
                 f"({e0['positions']} chain starts; {chain_rule(e0)}); {r['machine']}.",
                 ["head", "arch", "draft vocab", "coverage", "top-K weight", "seed", "trainable M",
                  "acceptance by position 1-4", "expected accepted, k=1", "k=4", "k=8", "train min"], rows)


def data_speed_table(path: Path) -> str:
    r = json.loads(path.read_text())
    rows = [[p, f"{x['median_new_tokens_per_s']:.1f}", f"{x['vs_first']:.2f}x",
             " ".join(f"{y['new_tokens_per_s']:.1f}" for y in x["runs"])] for p, x in r["rows"].items()]
    m = r["machine"]
    return table(f"Target-written data for {r['target']} (`{path.relative_to(ROOT)}`, `scripts/data_speed.py`): "
                 f"{r['prompts']} {r['source']} prompts, {r['recipe']}{', chat template' if r['chat'] else ''}; "
                 f"settings alternated over {r['rounds']} rounds; {m['cpu']}, {m['cores']} cores.",
                 ["continuations per decode (--parallel)", "new tokens/s (median)", "vs the first row",
                  "each round"], rows)


def verify_cost_table(path: Path) -> str:
    r = json.loads(path.read_text())
    m0 = r["machine"]
    labels = {"full_last_row": "llama.cpp LM head, logits at the last row",
              "full_every_row": "llama.cpp LM head, logits at every row",
              "lowrank_trunk": "low-rank: trunk to the final norm",
              "lowrank_candidates": "low-rank: candidate search",
              "lowrank_rescore": "low-rank: exact rescoring",
              "lowrank_decode": "low-rank: whole verify decode",
              "batched_decode": "batched LM head: whole verify decode, every row's logits"}
    ks = [row["rows"] for row in r["rows"]]
    rows = [[label, *(f"{row['ms_median'][p]:.1f}" for row in r["rows"])] for p, label in labels.items()
            if p in r["rows"][0]["ms_median"]]
    return table(f"Where a verify decode's time goes (`{path.relative_to(ROOT)}`, `scripts/verify_cost.py`): "
                 f"{r['target']} ({r['file']}), {r['lowrank']}, one context of {r['context_tokens']} "
                 f"tokens, median ms over {r['reps']} interleaved repetitions; {m0['cpu']}, "
                 f"{m0['threads']} threads.", ["part, ms, by rows checked in one decode", *ks], rows)


def sampler_cost_table(path: Path) -> str:
    r = json.loads(path.read_text())
    m0 = r["machine"]
    rows = [[name, ", ".join(f"{k} {v}" for k, v in c["params"].items()),
             f"{c['ms_per_row_median']['edgespec']:.3f}", f"{c['ms_per_row_median']['llama.cpp']:.3f}",
             f"{c['edgespec_over_llama_cpp']:.2f}", c["support_median"]] for name, c in r["chains"].items()]
    return table(f"What one sampled row costs (`{path.relative_to(ROOT)}`, `scripts/sampler_cost.py`): "
                 f"{r['target']} ({r['file']}, {r['n_vocab']} tokens), {r['rows']} rows of real logits, "
                 f"median of {r['reps']} timings a row; llama.cpp's chain through `llama_sampler_sample` "
                 f"on the context; {m0['cpu']}, {m0['threads']} threads.",
                 ["chain", "settings", "edgespec ms/row", "llama.cpp ms/row", "edgespec / llama.cpp",
                  "tokens kept (median)"], rows)


def head_step_cost_table(path: Path) -> str:
    r = json.loads(path.read_text())
    m0 = r["machine"]
    files = [f["head"] for f in r["rows"][0]["files"]]
    rows = [[x["context"], *[f"{f['ms_median']:.3f} ({f['ms_q1']:.3f}-{f['ms_q3']:.3f})" for f in x["files"]],
             f"{max(f['max_logit_diff_vs_first'] for f in x['files']):.5f}"] for x in r["rows"]]
    return table(f"One shared-KV draft step by context length (`{path.relative_to(ROOT)}`, "
                 f"`{r['command']}`): ms per step, median (quartiles) of {r['reps']} interleaved "
                 f"timings, onnxruntime on one thread"
                 f"{', caches evicted before each step' if r.get('cold') else ''}; {m0['cpu']}.",
                 ["keys attended", *[f"`{f}`" for f in files], "largest logit gap to the first file"], rows)


def certificate_table(path: Path) -> str:
    r = json.loads(path.read_text())
    m0 = r["machine"]
    rows = []
    for b in r["bases"]:
        for c in b["by_candidates"]:
            rows.append([b["basis"], b["h_perp_share_median"], c["candidates"],
                         f"{c['top1']['certified']} / {c['top1']['true_top_among_candidates']}",
                         f"{c['top40']['certified']} / {c['top40']['true_top_among_candidates']}"])
    return table(f"Can the low-rank search be certified? (`{path.relative_to(ROOT)}`, "
                 f"`scripts/lowrank_certificate.py`): {r['target']}, {r['rows']} rows the target sampled "
                 f"itself; a row is certified when every other token's low-rank score plus "
                 f"||w_perp|| ||h_perp|| stays {r['margin_for_int8_scores']} below the K-th candidate's "
                 f"exact logit; fitted bases from {r['fit_tokens']} other tokens; {m0['cpu']}.",
                 ["basis", "||h_perp|| / ||h|| (median)", "candidates",
                  "top 1: certified / truly among candidates", "top 40: certified / truly among"], rows)


def certificate_bounds_table(path: Path) -> str:
    r = json.loads(path.read_text())
    m0 = r["machine"]
    rows = []
    for b in r["bounds"]:
        for c in b["by_candidates"]:
            rows.append([b["bound"], c["candidates"], f"{c['greedy_certified']} / {r['rows']}",
                         f"{c['sampled_defaults_certified']} / {r['rows']}", c["greedy_miss_median"],
                         c["largest_logit_over_bound"], b["numpy_seconds"]])
    ch = r["sampled_chain"]
    return table(f"Tighter bounds for the candidate search (`{path.relative_to(ROOT)}`, "
                 f"`scripts/certificate_bounds.py`): {r['target']}, {r['rows']} rows the target sampled "
                 f"itself, bases fitted on {r['fit_tokens']} other tokens; candidates are the tokens of "
                 f"the highest upper bounds, a row is certified when the best bound left out plus "
                 f"{r['margin_for_int8_scores']} is under the best logit (greedy) or under the default "
                 f"chain's cut (top-k {ch['top_k']}, top-p {ch['top_p']}, min-p {ch['min_p']}); "
                 f"{m0['cpu']}, {m0['threads']} threads.",
                 ["bound", "candidates", "greedy certified", "sampled defaults certified",
                  "greedy miss (median, nats)", "largest logit over its bound", "numpy s"], rows)


def render() -> str:
    """The Results block, markers included."""
    benches = sorted((ROOT / "results").glob("bench-*.json"))
    parts = [summary_table(benches)]
    for pattern, render_one in (("export-target-*.json", export_table),
                                ("lowrank-basis-*.json", lowrank_basis_table),
                                ("export-onnx-target-*.json", onnx_target_table),
                                ("bench-*.json", bench_table), ("serve-*.json", serve_table),
                                ("parallel-agreement-*.json", parallel_agreement_table),
                                ("llama-lib-cost-*.json", llama_lib_cost_table),
                                ("export-eagle3-*.json", eagle3_export_table),
                                ("export-speculators-*.json", speculators_export_table),
                                ("eagle3-check-*.json", eagle3_check_table),
                                ("assistant-check-*.json", assistant_check_table),
                                ("scaling-*.json", scaling_table),
                                ("data-speed-*.json", data_speed_table),
                                ("verify-cost-*.json", verify_cost_table),
                                ("sampler-cost-*.json", sampler_cost_table),
                                ("head-step-cost-*.json", head_step_cost_table),
                                ("lowrank-certificate-*.json", certificate_table),
                                ("certificate-bounds-*.json", certificate_bounds_table),
                                ("workload-*.json", workload_table)):
        parts += [render_one(p) for p in sorted((ROOT / "results").glob(pattern))]
    for p in sorted((ROOT / "results").glob("eval-head-*.json")):
        r = json.loads(p.read_text())
        parts.append(f"`{p.relative_to(ROOT)}` (offline, held-out features; {chain_rule(r)}): acceptance by position "
                     + " ".join(f"{a:.3f}" for a in r["acceptance_by_position"])
                     + "; expected accepted drafts for k = 1..8: "
                     + " ".join(f"{v:.2f}" for v in r["expected_accepted"].values()))
    for fq in sorted((ROOT / "results").glob("feature-quant-error*.json")):
        parts.append(feature_error_table(fq))
    for abl in sorted((ROOT / "results").glob("ablation-storage*.json")):
        r = json.loads(abl.read_text())
        base = r["rows"]["fp16"]
        rows = []
        for d, row in r["rows"].items():
            e = row["expected_accepted"]
            rows.append([d, row.get("transform", "none"), f"{row['bytes_per_token']:.0f}",
                         f"{base['bytes_per_token'] / row['bytes_per_token']:.2f}x smaller",
                         *(f"{e[k]:.3f}" for k in "1248"),
                         f"{e['4'] / base['expected_accepted']['4'] - 1:+.1%}"])
        parts.append(table(f"Storage ablation (`{abl.relative_to(ROOT)}`, `scripts/storage_ablation.sh`): "
                           f"same data, {r['steps']} training steps each, evaluated on the same held-out fp16 "
                           "features.", ["hidden states", "transform", "bytes/token", "vs fp16",
                                         "expected accepted, k=1", "k=2", "k=4", "k=8", "k=4 vs fp16"], rows))
    for opt in sorted((ROOT / "results").glob("ablation-optimizer*.json")):
        r = json.loads(opt.read_text())
        rows = []
        for o, row in r["rows"].items():
            e = row["expected_accepted"]
            rows.append([o, row["lr"], f"{row['final_loss']:.3f}", *(f"{e[k]:.3f}" for k in "1248"),
                         " ".join(f"{a:.2f}" for a in row["acceptance_by_position"][:4]), f"{row['seconds']:.0f}"])
        parts.append(table(f"Optimizer ablation (`{opt.relative_to(ROOT)}`, `scripts/optimizer_ablation.sh`): "
                           f"same int4 features, seed and {r['steps']} steps, evaluated on held-out fp16 features.",
                           ["optimizer", "lr", "final loss", "expected accepted, k=1", "k=2", "k=4", "k=8",
                            "acceptance by position 1-4", "train s"], rows))
    for win in sorted((ROOT / "results").glob("ablation-window*.json")):
        r = json.loads(win.read_text())
        rows = []
        for row in r["rows"].values():
            a, w = row["all_starts"], row["past_window"]
            rows.append([", ".join(row["layer_types"]), a["positions"],
                         *(f"{a['expected_accepted'][k]:.3f}" for k in "124"), w["positions"],
                         *(f"{w['expected_accepted'][k]:.3f}" for k in "124"), f"{row['seconds']:.0f}"])
        parts.append(table(f"Sliding vs global head attention (`{win.relative_to(ROOT)}`, "
                           f"`scripts/window_ablation.sh`): {r['note']}; {r['steps']} steps, batch {r['batch']} x "
                           f"{r['seq_len']} positions, same seed.",
                           ["head layers", "chain starts", "expected accepted, k=1", "k=2", "k=4",
                            "starts past the window", "k=1", "k=2", "k=4", "train s"], rows))
    for p in sorted((ROOT / "results").glob("ablation-head-*.json")) + sorted(
            (ROOT / "results").glob("ablation-shared-kv-*.json")):
        parts.append(head_ablation_table(p))
    for p in sorted((ROOT / "results").glob("export-head-*.json")):
        r = json.loads(p.read_text())
        rows = [[Path(e["out"]).name, e["check"]["runtime"], f"{e['bytes'] / 2**20:.1f}",
                 f"{e['check']['top1_agreement']:.3f}", f"{e['check']['max_logit_error']:.3f}",
                 f"{e['check']['ms_per_draft_step']:.2f}", "yes" if e["shipped"] else ""] for e in r["exports"]]
        made = r.get("made_by", "scripts/ship_head.sh")
        what = f" of the {r['head']}" if r.get("head") else ""
        parts.append(table(f"Head exports{what} for {r['target']} (`{p.relative_to(ROOT)}`, `{made}`), "
                           "each checked against the trained torch head on held-out hidden states:",
                           ["file", "runtime", "MB", "top-1 agreement", "max logit error", "ms/draft step",
                            "shipped"], rows))
    return BEGIN + "\n" + "\n\n".join(parts) + "\n" + END


def headline_table(path: Path) -> str:
    """README's headline: plain llama.cpp, stock llama.cpp's fastest speculation, prompt lookup
    and edgespec's default, from one interleaved bench run."""
    r = json.loads(path.read_text())
    st, m0, ms = r["settings"], r["machine"], r["methods"]
    ref = ms["target"]
    rows = [["plain llama.cpp (the reference)", f"{ref['tokens_per_s']:.1f}", "1.00x / 1.00x", "1.00", "-"]]
    srv = r.get("peers", {}).get("llama-server")
    if srv:
        best = srv["best_speculative"]
        c = srv["configs"][best]
        rows.append([f"stock llama.cpp speculation (llama-server `{best}`, its fastest)",
                     f"{c['tokens_per_s']:.1f}",
                     f"{c['speedup_vs_server_plain']:.2f}x / {c['speedup_total_vs_server_plain']:.2f}x "
                     "(vs its own plain decoding)", "-", "-"])
    labels = {"target:lowrank": "edgespec, no drafting (low-rank LM head)",
              "target:batched": "edgespec, no drafting (batched LM head)",
              "lookup": "edgespec prompt lookup (cost policy)",
              "edgespec": "edgespec default (shipped head + lookup)"}
    for name, label in labels.items():
        if name in ms:
            m = ms[name]
            rows.append([label, f"{m['tokens_per_s']:.1f}",
                         f"{m['speedup']:.2f}x / {_total(m, ref):.2f}x", f"{m['mean_accepted']:.2f}",
                         f"{m.get('same_as_target_share', 0):.2f}"])
    return table(f"Gemma 3 270M Q4_K_M, greedy, {st['prompts']} of the shipped bench prompts (code and prose, kept out of training), "
                 f"{st['max_new_tokens']} new tokens each, every method interleaved per prompt in one "
                 f"run; {m0['cpu']}, {m0['threads']} threads (`results/{path.name}`).",
                 ["method", "tok/s", "vs plain llama.cpp (median of per-prompt ratios / total)",
                  "tokens per target pass", "same text as plain"], rows)


def workload_table(path: Path) -> str:
    """`bench --workload`: the drop-in against llama_cpp.Llama, one row per app call."""
    r = json.loads(path.read_text())
    m0 = r["machine"]
    copies = any("copy" in x for x in r["rows"])
    rows = []
    for x in r["rows"]:
        row = [x["name"], x["prompts"], f"{x['tokens_per_s']['llama_cpp.Llama']:.1f}",
               f"{x['tokens_per_s']['edgespec']:.1f}", f"{x['speedup']:.2f}x / {x['speedup_total']:.2f}x",
               f"{x['same_text_share']:.2f}"]
        if copies:  # llama_cpp.Llama on the copy: the copy's own speed, apart from speculation
            c, (m, t), (cm, ct) = x["copy"], x["speedup_vs_copy"], x["copy_vs_file"]
            row += [f"{x['tokens_per_s']['llama_cpp.Llama (copy)']:.1f}", f"{cm:.2f}x / {ct:.2f}x",
                    f"{m:.2f}x / {t:.2f}x", f"{c['top1_agreement']:.3f}", f"{x['same_text_share_copy_vs_file']:.2f}"]
        rows.append(row)
        for d, o in x.get("others", {}).items():  # the drop-in with other drafts, same run
            m, t = o["speedup"]
            rows.append([f"{x['name']}, draft {d}", x["prompts"], "",
                         f"{x['tokens_per_s'][f'edgespec (draft {d})']:.1f}", f"{m:.2f}x / {t:.2f}x",
                         f"{o['same_text_share']:.2f}"] + [""] * (5 if copies else 0))
    rows_end = (" Rows ending in `draft X`: the drop-in with that draft instead, in the same "
                "interleaved run, against the same llama_cpp.Llama calls."
                if any(x.get("others") for x in r["rows"]) else "")
    if r["workload"] == "chat-cli":
        cli = r["rows"][0]
        return table(f"The chat command's view (`results/{path.name}`, `edgespec bench --workload chat-cli`): "
                     f"`edgespec chat` (its own parser's defaults, draft {cli['draft']} unless the row "
                     "names another) and `llama_cpp.Llama.create_chat_completion` with the sampling "
                     "values the chat's flags resolve to, on the same file with the same seeds; "
                     f"{cli['turns']} turns a conversation, each side continuing its own; wall time of "
                     f"every reply including its prompt, at most {r['max_tokens']} new tokens a reply; "
                     f"{m0['cpu']}, {m0['threads']} threads." + rows_end.replace("the drop-in", "the chat"),
                     ["chat", "conversations", "llama_cpp.Llama tok/s", "edgespec chat tok/s",
                      "edgespec chat vs llama_cpp.Llama (median / total)", "same replies"], rows)
    where = ("edgespec's drop-in on a copy of the file re-quantized by `edgespec export target "
             "--quant` (llama_cpp.Llama on the user's file, and on the copy)" if copies else
             "on the same file")
    return table(f"The app's view (`results/{path.name}`, `edgespec bench --workload {r['workload']}`): "
                 f"`llama_cpp.Llama` and edgespec's drop-in (shipped head + lookup) making the same call, "
                 f"{where}, with the same seeds, llama-cpp-python's defaults for every argument "
                 f"not named; wall time including the prompt, at most {r['max_tokens']} new tokens; "
                 f"{m0['cpu']}, {m0['threads']} threads." + rows_end,
                 ["call", "prompts", "llama_cpp.Llama tok/s", "edgespec tok/s",
                  "edgespec vs llama_cpp.Llama (median / total)", "same text"]
                 + (["llama_cpp.Llama on the copy tok/s", "copy vs file", "edgespec vs the copy",
                     "copy's top-1 agreement with the file", "same text, copy vs file"] if copies else []), rows)


def demo_line(path: Path) -> str:
    r = json.loads(path.read_text())
    m0 = r["machine"]
    built = "compiling llama-cpp-python included" if r["compiled_llama_cpp_python"] else \
        "llama-cpp-python's wheel already in pip's cache"
    return (f"A fresh clone's `make demo` took {r['wall_s'] / 60:.1f} minutes ({built}; "
            f"`results/{path.name}`, `scripts/demo_time.py`, commit {r['commit']}; {m0['cpu']}, "
            f"{m0['cores']} cores).")


def _splice(text: str, begin: str, end: str, block: str) -> str:
    return text[:text.index(begin)] + block + text[text.index(end) + len(end):]


def main(argv: list[str]) -> int:
    files = {ROOT / "results" / "README.md": (BEGIN, END, render()),
             ROOT / "README.md": (HEAD_BEGIN, HEAD_END, HEAD_BEGIN + "\n"
                                  + headline_table(ROOT / "results" / HEADLINE) + "\n\n"
                                  + workload_table(ROOT / "results" / HEADLINE_APP) + "\n\n"
                                  + demo_line(ROOT / "results" / HEADLINE_DEMO) + "\n" + HEAD_END)}
    stale = []
    for path, (begin, end, block) in files.items():
        text = path.read_text()
        if begin not in text or end not in text:
            print(f"{path}: no {begin} ... {end} block", file=sys.stderr)
            return 2
        new = _splice(text, begin, end, block)
        if new != text:
            stale.append(path)
            if "--check" not in argv:
                path.write_text(new)
    if stale and "--check" in argv:
        print(f"{', '.join(str(p.relative_to(ROOT)) for p in stale)}: not what "
              "scripts/results_table.py writes; run it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
