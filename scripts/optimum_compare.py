"""optimum-onnx's export of Gemma 3 270M beside edgespec's ONNX target, in one run.

    .venv/bin/python scripts/optimum_compare.py save-hf DIR          # the target as a HF folder
    .venv/bin/python scripts/optimum_compare.py fix-config DIR       # its config for transformers 4.57
    .venv-optimum/bin/optimum-cli export onnx --model DIR --task text-generation-with-past OUT
    .venv/bin/python scripts/optimum_compare.py nbits SRC_DIR DST_DIR    # int8 weight-only
    .venv/bin/python scripts/optimum_compare.py graft SRC_DIR DST_DIR    # + hidden, n_logits
    .venv/bin/python scripts/optimum_compare.py \
        --variant optimum-fp32=optimum:DIR --variant edgespec-int8=edgespec:DIR ... \
        --gguf PATH --optimum-python .venv-optimum/bin/python --commands FILE --out results/X.json

A variant is NAME=KIND:DIR. KIND `optimum`: a folder from `optimum-cli export onnx --task
text-generation-with-past` (inputs input_ids, attention_mask, past_key_values.*; outputs logits
for every position and present.*), or one of its quantized copies. KIND `edgespec`: a folder from
`edgespec export onnx-target`; it is measured twice, as the plain graph asked for every logit
(`NAME/full-head`) and through edgespec's runtime with the low-rank LM head, greedy top-only
(`NAME/lowrank`), where the export has one.

`save-hf` writes the target as transformers loads it from the GGUF (weights dequantized to fp32;
transformers marks such a model as quantized and refuses to save it, so the mark is dropped
first) with its tokenizer, for optimum to export. `fix-config` rewrites that config.json for the
transformers optimum-onnx pins (< 4.58): transformers 5 writes the RoPE settings as
`rope_parameters` per layer type, 4.57's Gemma3TextConfig reads `rope_theta` (global layers),
`rope_local_base_freq` (sliding layers) and `rope_scaling`; nothing else changes. `nbits`
quantizes an optimum export the way edgespec quantizes its own target: onnxruntime's
MatMulNBits, 8 bits, block 32, symmetric, accuracy level 4, every MatMul with a constant weight.
`graft` copies an optimum export with two of the things edgespec's runtime needs added by graph
surgery: an `n_logits` input (the LM head reads only the last n_logits positions) and a `hidden`
output (the final hidden states after the output norm, what the draft head reads). It shows
what adding them on top of optimum takes; measured like any optimum variant.

Measured for each, with interleaved repetitions (every variant takes its turn within each
repetition, in a rotating order) on `--threads` onnxruntime threads:
  c(k), k = 1..8   median wall time of one decode call feeding k new tokens on top of the same
                   cached context (the KV cache as inputs), returning logits for all k rows
                   (what checking k drafted tokens costs); token embedding lookup included
  prefill          median wall time of one call over the context itself (no cache)
  size             bytes of the ONNX files, and of the parts of them that are the token
                   embedding table (optimum) or the low-rank LM head (edgespec)
  greedy           32 greedy tokens on each prompt beside llama.cpp on the same GGUF file:
                   mean matching prefix, share of identical continuations
  sliding window   teacher-forced top-1 over a text longer than the sliding window, against
                   llama.cpp, before and past the window; for each --pair A,B of plain graphs,
                   run in lockstep, the largest fp32 logit difference and top-1 agreement
                   in each part
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Generic openings written for this comparison (not from any benchmark or shipped prompt set).
PROMPTS = [
    "The old lighthouse keeper climbed the stairs every evening, and",
    "def parse_config(path):\n    \"\"\"Read a file of key=value lines into a dict.\"\"\"\n",
    "In the spring of that year, the town council finally decided to",
    "#include <stdio.h>\n\nint main(void) {\n",
    "A good cup of coffee starts long before the water boils:",
    "class Stack:\n    def __init__(self):\n",
]
CONTEXT = ("Our small team spent the winter rebuilding the old garden shed behind the house. We "
           "replaced the rotten floor boards, fixed the leaking roof, painted the door a deep green, "
           "and on the first warm day")
LONG_PROMPT = "Chapter one. The train was late again, so Maria"
GREEDY_TOKENS = 32
K_MAX = 8


def cpu_info() -> dict:
    model = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "cores": os.cpu_count()}


def shown_path(p: str) -> str:
    """A path as the result file shows it: relative inside the working directory (the repo),
    else its last part only (scratch folders are not part of the record)."""
    rel = os.path.relpath(p)
    return rel if not rel.startswith("..") else Path(p).name


def versions_here() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": shown_path(sys.executable)}
    for p in ("onnxruntime", "onnx", "transformers", "torch", "optimum", "optimum-onnx",
              "llama_cpp_python"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


def versions_of(python: str) -> dict:
    code = ("import json, sys\nfrom importlib.metadata import version, PackageNotFoundError\n"
            "d = {'python': sys.executable}\n"
            "for p in ('onnxruntime', 'onnx', 'transformers', 'torch', 'optimum', 'optimum-onnx'):\n"
            "    try: d[p] = version(p)\n"
            "    except PackageNotFoundError: d[p] = None\n"
            "print(json.dumps(d))")
    d = json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True,
                                  check=True).stdout)
    d["python"] = shown_path(d["python"])
    return d


def onnx_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in (".onnx", ".data"))


def model_file(folder: Path) -> Path:
    files = [p for p in onnx_files(folder) if p.suffix == ".onnx"]
    if len(files) != 1:
        raise SystemExit(f"{folder}: expected one .onnx file, found {[p.name for p in files]}")
    return files[0]


def size_report(folder: Path) -> dict:
    """Bytes on disk, and those of the initializers that are the embedding table or the
    low-rank LM head (by name: the exporters' parameter names)."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    m = onnx.load(str(model_file(folder)), load_external_data=False)
    parts = {"embedding_table": 0, "lowrank_lm_head": 0}
    for t in m.graph.initializer:
        if uses_external_data(t):
            n = int({e.key: e.value for e in t.external_data}.get("length", 0))
        else:
            n = len(t.raw_data) or t.ByteSize()
        if "embed_tokens" in t.name:
            parts["embedding_table"] += n
        elif t.name.startswith(("basis", "scores")):
            parts["lowrank_lm_head"] += n
    return {"bytes": sum(p.stat().st_size for p in onnx_files(folder)), **parts,
            "files": [p.name for p in onnx_files(folder)]}


def save_hf(out: Path, target: str = "gemma3-270m") -> None:
    from transformers import AutoTokenizer

    from edgespec.targets import load_target_spec
    from edgespec.training.torch_target import load_torch_target

    spec = load_target_spec(target)
    model = load_torch_target(target)
    model.hf_quantizer = None  # weights are already dequantized: save them as plain fp32
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.save_pretrained(out)
    gguf = Path(spec.path)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    print(f"{target} -> {out} ({model.config.model_type})")


def fix_config(folder: Path) -> None:
    p = folder / "config.json"
    c = json.loads(p.read_text())
    if "rope_parameters" not in c:
        raise SystemExit(f"{p}: no rope_parameters (already fixed?)")
    rp = c.pop("rope_parameters")
    if {rp[t].get("rope_type") for t in ("full_attention", "sliding_attention")} != {"default"}:
        raise SystemExit(f"{p}: only default RoPE is handled, got {rp}")
    c["rope_theta"] = rp["full_attention"]["rope_theta"]
    c["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
    c["rope_scaling"] = None
    p.write_text(json.dumps(c, indent=2) + "\n")
    print(f"{p}: rope_parameters {rp} -> rope_theta {c['rope_theta']}, "
          f"rope_local_base_freq {c['rope_local_base_freq']}, rope_scaling null")


def nbits(src: Path, dst: Path) -> None:
    import onnx

    from edgespec.exporters.onnx_head import nbits_quantize, quiet_quantizers

    with quiet_quantizers():
        m = nbits_quantize(onnx.load(str(model_file(src))), 8)
    dst.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(dst / "model.onnx"), save_as_external_data=True, location="model.onnx.data",
              size_threshold=1024)
    print(f"{src} -> {dst}: {sum(n.op_type == 'MatMulNBits' for n in m.graph.node)} MatMulNBits")


def graft(src: Path, dst: Path) -> None:
    """optimum's graph + `n_logits` input + `hidden` output (see the module docstring)."""
    import onnx
    from onnx import TensorProto, helper

    m = onnx.load(str(model_file(src)))
    g = m.graph
    head = [n for n in g.node if "logits" in n.output]
    if len(head) != 1:
        raise SystemExit(f"{src}: no single node writes `logits`")
    head = head[0]
    h = head.input[0]  # final hidden states after the output norm, [batch, seq, E]
    one = helper.make_tensor("graft_one", TensorProto.INT64, [1], [1])
    g.initializer.append(one)
    g.input.append(helper.make_tensor_value_info("n_logits", TensorProto.INT64, []))
    head.input[0] = "graft_last"
    nodes = list(g.node)
    at = nodes.index(head)  # the new nodes go just before the LM head (topological order)
    nodes[at:at] = [
        helper.make_node("Shape", [h], ["graft_shape"], name="graft_shape"),
        helper.make_node("Gather", ["graft_shape", "graft_one"], ["graft_seq"], axis=0, name="graft_seq"),
        helper.make_node("Unsqueeze", ["n_logits", "graft_zero_axes"], ["graft_n"], name="graft_n"),
        helper.make_node("Sub", ["graft_seq", "graft_n"], ["graft_start"], name="graft_start"),
        helper.make_node("Slice", [h, "graft_start", "graft_seq", "graft_one"], ["graft_last"],
                         name="graft_last"),
        helper.make_node("Identity", [h], ["hidden"], name="graft_hidden"),
    ]
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.append(helper.make_tensor("graft_zero_axes", TensorProto.INT64, [1], [0]))
    if [n.input[0] for n in g.node if "logits" in n.output] != ["graft_last"]:
        raise SystemExit("internal: the LM head was not rewired")
    g.output.append(helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch_size", "sequence_length", None]))
    dst.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(dst / "model.onnx"), save_as_external_data=True, location="model.onnx.data",
              size_threshold=1024)
    onnx.checker.check_model(str(dst / "model.onnx"))
    print(f"grafted {src} -> {dst}: n_logits input, hidden output")


class Raw:
    """One ONNX graph driven directly (no edgespec runtime): a decode call with the KV cache as
    inputs and logits for every new row. Caches are kept whole (no trimming)."""

    def __init__(self, name, kind, folder: Path, threads: int, spec):
        from edgespec.runtime.formats import cache_names
        from edgespec.runtime.onnx_session import open_session

        self.name, self.kind, self.folder = name, kind, folder
        self.sess = open_session(model_file(folder), threads)
        ins = {i.name: i for i in self.sess.get_inputs()}
        self.past_names = [n for n in ins if n.startswith("past_key_values.")]
        self.n_layer = len(self.past_names) // 2
        self.past_names, present = cache_names(self.n_layer)
        self.kv_heads, self.head_dim = spec.n_head_kv, spec.head_dim
        if kind == "optimum":
            self.grafted = "n_logits" in ins
            self.out_names = ["logits", "hidden", *present] if self.grafted else ["logits", *present]
        else:
            from edgespec.runtime.formats import read_target_meta
            from edgespec.targets import embedding_rows

            self.meta = read_target_meta(folder)
            self.embed = embedding_rows(spec)
            self.scale = np.float32(self.meta["embed_scale"])
            self.lowrank = "n_candidates" in ins
            self.out_names = ["logits", "hidden", *present]
        self.inputs = sorted(ins)
        self.outputs = [o.name for o in self.sess.get_outputs()]

    def empty(self):
        z = np.zeros((1, self.kv_heads, 0, self.head_dim), np.float32)
        return [z] * (2 * self.n_layer)

    def run(self, tokens, past, n_logits=None):
        """(logits [rows, V], present list). n_logits: rows of logits, default every new row
        (a plain optimum graph ignores it: it always computes every row)."""
        n = len(tokens)
        p = past[0].shape[2]
        if self.kind == "optimum":
            feed = {"input_ids": np.asarray([tokens], np.int64),
                    "attention_mask": np.ones((1, p + n), np.int64)}
            if self.grafted:
                feed["n_logits"] = np.array(n if n_logits is None else n_logits, np.int64)
        else:
            emb = self.embed[np.asarray(tokens)] * self.scale
            feed = {"inputs_embeds": np.ascontiguousarray(emb, np.float32),
                    "position": np.array(p, np.int64),
                    "n_logits": np.array(n if n_logits is None else n_logits, np.int64)}
            if self.lowrank:
                feed["n_candidates"] = np.array(0, np.int64)
        feed.update(zip(self.past_names, past))
        res = self.sess.run(self.out_names, feed)
        logits = res[0][0] if self.kind == "optimum" else res[0]
        skip = 2 if self.out_names[1] == "hidden" else 1
        return logits, res[skip:]


class Runtime:
    """edgespec's own engine on an export with the low-rank LM head, greedy top-only."""

    def __init__(self, name, folder: Path, threads: int):
        from edgespec.runtime.ort_target import OrtTarget

        self.name, self.kind, self.folder = name, "edgespec-runtime", folder
        self.eng = OrtTarget(folder, n_ctx=2048, n_threads=threads)


def time_call(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - t0)


def measure_costs(variants, ctx_ids, cont_ids, reps: int) -> dict:
    """Interleaved: per repetition, each variant in a rotating order does the prefill of the
    context and the decodes of k = 1..K_MAX on top of it."""
    ps = {}
    for v in variants:
        if isinstance(v, Raw):
            _, ps[v.name] = v.run(ctx_ids, v.empty(), n_logits=0)
        else:
            v.eng.reset()
            v.eng.prefill(ctx_ids)
            ps[v.name] = len(v.eng.tokens)

    def call(v, k):
        if k == 0:  # prefill of the context from an empty cache
            if isinstance(v, Raw):
                return lambda: v.run(ctx_ids, v.empty(), n_logits=0)
            return None
        toks = cont_ids[:k]
        if isinstance(v, Raw):
            return lambda: v.run(toks, ps[v.name])
        return lambda: v.eng.decode(toks, hidden=True, copy=False, top_only=True)

    def after(v):
        if not isinstance(v, Raw):
            v.eng.truncate(ps[v.name])

    times = {v.name: {k: [] for k in range(K_MAX + 1)} for v in variants}
    for r in range(reps + 1):  # repetition 0 warms up
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for k in range(K_MAX + 1):
            for v in order:
                fn = call(v, k)
                if fn is None:
                    continue
                t = time_call(fn)
                after(v)
                if r:
                    times[v.name][k].append(t)
    out = {}
    for v in variants:
        t = times[v.name]
        out[v.name] = {"c_ms": [round(statistics.median(t[k]), 2) for k in range(1, K_MAX + 1)],
                       "prefill_ms": round(statistics.median(t[0]), 2) if t[0] else None}
        c = out[v.name]["c_ms"]
        out[v.name]["c_over_c1"] = [round(x / c[0], 3) for x in c]
    return out


def last_logits(llm) -> np.ndarray:
    """llama.cpp's logits of the last token evaluated (llama-cpp-python fills `scores` only
    with logits_all)."""
    import llama_cpp

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def llama_greedy(llm, ids, n):
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        t = int(np.argmax(last_logits(llm)))
        out.append(t)
        llm.eval([t])
    return out


def onnx_greedy(v, ids, n):
    out = []
    if isinstance(v, Raw):
        logits, past = v.run(ids, v.empty(), n_logits=1)
        for _ in range(n):
            t = int(np.argmax(logits[-1]))
            out.append(t)
            logits, past = v.run([t], past)
        return out
    eng = v.eng
    eng.reset()
    eng.prefill(ids[:-1])
    logits, _ = eng.decode([ids[-1]], top_only=True)
    for _ in range(n):
        t = int(np.argmax(logits[-1]))
        out.append(t)
        logits, _ = eng.decode([t], top_only=True)
    return out


def prefix_len(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def sample_long_text(llm, n_tokens: int, seed: int = 0) -> list[int]:
    """A text longer than the sliding window, written by llama.cpp from LONG_PROMPT: softmax
    sampling (temperature 1, top 40) with a fixed seed, so it neither loops nor comes from a
    data set."""
    rng = np.random.default_rng(seed)
    ids = llm.tokenize(LONG_PROMPT.encode(), add_bos=True, special=True)
    llm.reset()
    llm.eval(ids)
    while len(ids) < n_tokens:
        lg = last_logits(llm).astype(np.float64)
        top = np.argpartition(lg, -40)[-40:]
        p = np.exp(lg[top] - lg[top].max())
        t = int(top[rng.choice(40, p=p / p.sum())])
        ids.append(t)
        llm.eval([t])
    return ids


def teacher_forced(v, ids, chunk=64):
    """Top-1 at every position of ids (each predicting the next), chunk by chunk with the cache."""
    tops = []
    if isinstance(v, Raw):
        past = v.empty()
        for s in range(0, len(ids), chunk):
            logits, past = v.run(ids[s:s + chunk], past)
            tops.append(logits.argmax(1))
    else:
        v.eng.reset()
        for s in range(0, len(ids), chunk):
            logits, _ = v.eng.decode(ids[s:s + chunk], top_only=True)
            tops.append(logits.argmax(1).copy())
    return np.concatenate(tops)


def pair_diff(x: Raw, y: Raw, ids, chunk=64):
    """Two graphs in lockstep over ids, chunk by chunk with their caches: per position the
    largest |logit difference| (fp32) and whether their top-1 tokens agree."""
    px, py, diff, same = x.empty(), y.empty(), [], []
    for s in range(0, len(ids), chunk):
        lx, px = x.run(ids[s:s + chunk], px)
        ly, py = y.run(ids[s:s + chunk], py)
        diff.append(np.abs(lx - ly).max(1))
        same.append(lx.argmax(1) == ly.argmax(1))
    return np.concatenate(diff), np.concatenate(same)


def main():
    steps = {"save-hf": (save_hf, 1), "fix-config": (fix_config, 1), "nbits": (nbits, 2), "graft": (graft, 2)}
    if sys.argv[1:2] and sys.argv[1] in steps:
        fn, n = steps[sys.argv[1]]
        if len(sys.argv) != 2 + n:
            raise SystemExit(f"usage: optimum_compare.py {sys.argv[1]} {'DIR' if n == 1 else 'SRC_DIR DST_DIR'}")
        return fn(*map(Path, sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, help="NAME=optimum:DIR or NAME=edgespec:DIR")
    ap.add_argument("--gguf", required=True, help="the target's GGUF file (llama.cpp's reference)")
    ap.add_argument("--target", default="gemma3-270m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--long-tokens", type=int, default=768)
    ap.add_argument("--optimum-python", help="python of the optimum venv (for its versions)")
    ap.add_argument("--commands", help="text file: the commands that made the exports and this run")
    ap.add_argument("--notes", help="JSON file merged into the result as `notes`")
    ap.add_argument("--pair", action="append", default=[],
                    help="A,B: two plain-graph variants compared logit by logit over the long text")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from llama_cpp import Llama

    from edgespec.targets import load_target_spec

    out = Path(a.out)
    if out.exists():
        raise SystemExit(f"{out} exists: results are append-only, pick a -runN name")
    spec = load_target_spec(a.target)
    t_start = time.time()
    load_before = os.getloadavg()

    variants, sizes, graphs = [], {}, {}
    for item in a.variant:
        name, rest = item.split("=", 1)
        kind, folder = rest.split(":", 1)
        folder = Path(folder)
        sizes[name] = size_report(folder)
        raw = Raw(f"{name}/full-head" if kind == "edgespec" else name, kind, folder, a.threads, spec)
        graphs[name] = {"kind": kind, "folder": folder.name, "inputs": raw.inputs, "outputs": raw.outputs,
                        "has": {"hidden_output": "hidden" in raw.outputs,
                                "n_logits_input": "n_logits" in raw.inputs,
                                "candidates_output": "candidates" in raw.outputs,
                                "position_input": "position" in raw.inputs,
                                "token_embedding_in_graph": "input_ids" in raw.inputs}}
        variants.append(raw)
        if kind == "edgespec" and raw.lowrank:
            variants.append(Runtime(f"{name}/lowrank", folder, a.threads))
    print("variants:", [v.name for v in variants], flush=True)

    llm = Llama(model_path=a.gguf, n_ctx=1024, n_threads=a.threads, n_threads_batch=a.threads,
                verbose=False)
    tok = lambda s: llm.tokenize(s.encode(), add_bos=True, special=True)  # noqa: E731
    ctx_ids = tok(CONTEXT)
    cont_ids = llama_greedy(llm, ctx_ids, K_MAX)  # the k tokens fed on top of the context

    print("c(k) ...", flush=True)
    costs = measure_costs(variants, ctx_ids, cont_ids, a.reps)

    print("greedy agreement ...", flush=True)
    prompts = [tok(p) for p in PROMPTS]
    ref = [llama_greedy(llm, ids, GREEDY_TOKENS) for ids in prompts]
    greedy = {}
    for v in variants:
        outs = [onnx_greedy(v, ids, GREEDY_TOKENS) for ids in prompts]
        pre = [prefix_len(x, y) for x, y in zip(ref, outs)]
        greedy[v.name] = {"mean_matching_prefix": round(sum(pre) / len(pre), 2),
                          "same_continuation_share": round(sum(x == y for x, y in zip(ref, outs)) / len(ref), 3),
                          "matching_prefix_per_prompt": pre}

    print("sliding window ...", flush=True)
    long_ids = sample_long_text(llm, a.long_tokens)
    del llm
    ref_llm = Llama(model_path=a.gguf, n_ctx=a.long_tokens + 8, n_threads=a.threads,
                    n_threads_batch=a.threads, logits_all=True, verbose=False)
    ref_llm.eval(long_ids)
    ref_top = np.asarray(ref_llm.scores[:len(long_ids)]).argmax(1)
    del ref_llm
    window = spec.sliding_window
    # position i predicts token i+1 and sees keys 0..i: past the window once i >= window
    before, past_w = np.arange(len(long_ids)) < window, np.arange(len(long_ids)) >= window
    sliding = {"tokens": len(long_ids), "sliding_window": window,
               "positions_before_window": int(before.sum()), "positions_past_window": int(past_w.sum()),
               "top1_agreement_with_llama_cpp": {}}
    for v in variants:
        top = teacher_forced(v, long_ids)
        sliding["top1_agreement_with_llama_cpp"][v.name] = {
            "before_window": round(float((top[before] == ref_top[before]).mean()), 4),
            "past_window": round(float((top[past_w] == ref_top[past_w]).mean()), 4)}
    by_name = {v.name: v for v in variants}
    sliding["pairs"] = []
    for pair in a.pair:
        n1, n2 = pair.split(",")
        d, same = pair_diff(by_name[n1], by_name[n2], long_ids)
        sliding["pairs"].append({
            "pair": [n1, n2],
            "max_abs_logit_diff": {"before_window": float(d[before].max()), "past_window": float(d[past_w].max())},
            "top1_agreement": {"before_window": round(float(same[before].mean()), 4),
                               "past_window": round(float(same[past_w].mean()), 4)}})

    result = {
        "what": "optimum-onnx's Gemma 3 270M export (gemma3_text, text-generation-with-past) beside "
                "edgespec's ONNX target, one run, interleaved repetitions",
        "machine": {**cpu_info(), "threads": a.threads, "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()],
                    "main_venv": versions_here(),
                    "optimum_venv": versions_of(a.optimum_python) if a.optimum_python else None},
        "target": {"name": spec.name, "gguf": Path(a.gguf).name, "gguf_bytes": Path(a.gguf).stat().st_size,
                   "n_vocab": spec.n_vocab, "n_embd": spec.n_embd, "sliding_window": window},
        "method": {
            "c_k": f"median of {a.reps} interleaved repetitions (after one warm-up) of one decode "
                   f"call feeding k new tokens on top of the same {len(ctx_ids)}-token cached "
                   "context, logits for all k rows, every output fetched; edgespec's token "
                   "embedding lookup from the GGUF rows is inside the timing; `/lowrank` is "
                   "edgespec's runtime decode(top_only=True): low-rank candidates rescored exactly",
            "prefill": f"one call over the {len(ctx_ids)}-token context from an empty cache "
                       "(optimum computes logits for every position, edgespec none: n_logits=0)",
            "greedy": f"{len(PROMPTS)} prompts written for this run, {GREEDY_TOKENS} greedy tokens, "
                      "token ids from llama.cpp's tokenizer of the same GGUF fed to every engine; "
                      "reference llama-cpp-python on the GGUF",
            "sliding_window": "teacher-forced top-1 over a llama.cpp-sampled text (seed 0) in "
                              "chunks of 64 tokens with the cache, against llama.cpp's own top-1 "
                              "at every position",
            "threads": a.threads},
        "prompts": PROMPTS, "context": CONTEXT,
        "graphs": graphs, "size": sizes, "cost": costs, "greedy": greedy, "sliding_window": sliding,
        "run_s": round(time.time() - t_start, 1),
    }
    if a.commands:
        result["commands"] = Path(a.commands).read_text().strip().splitlines()
    if a.notes:
        result["notes"] = json.loads(Path(a.notes).read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("size", "cost", "greedy", "sliding_window")}, indent=1))


if __name__ == "__main__":
    main()
