"""Stage 1, training text: the target writes it itself, continuing prompts from real text.

    edgespec data --target gemma3-270m --out runs/gemma/data                 # default source
    edgespec data --target gemma3-270m --prompts my.jsonl notes.txt --out DIR

Prompt sources: JSONL files with a `prompt` field, plain text files (split into passages), or
the built-in `stdlib` source: docstrings (prose) and function bodies (code) parsed with `ast`
from Python's own standard library, which every machine with Python has. Files are split into
train and held-out by a hash of their path; `held_out_passages` gives the held-out side, which
the bench prompts come from, so training never sees benchmark text.

Output: `samples-NNNNN.jsonl` shards (token ids, prompt length, mode, provenance) written
atomically, and `manifest.json`. A killed run resumes where it stopped.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.io import atomic_write_text, progress, read_json, read_prompt_lines

STDLIB = "stdlib"


@dataclass
class DataConfig:
    n_prompts: int = 400  # passages turned into prompts
    prompt_tokens: int = 48  # tokens of each passage kept as the prompt
    new_tokens: int = 128  # tokens the target writes per prompt
    sample_share: float = 0.5  # share of prompts continued with sampling (rest greedy)
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    shard_size: int = 50  # samples per shard file
    chat: bool = False  # wrap prompts in the target's chat template (chat models)


def split_of(path: str) -> str:
    return "heldout" if int(hashlib.sha256(path.encode()).hexdigest(), 16) % 10 == 0 else "train"


def stdlib_passages(split: str = "train", min_chars: int = 200) -> list[dict]:
    """Docstrings and function bodies from the Python standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(list(root.glob("*.py")) + [p for p in root.glob("*/*.py")
                                              if "test" not in p.parts and "idlelib" not in p.parts])
    out = []
    for p in files:
        rel = str(p.relative_to(root))
        if split_of(rel) != split:
            continue
        try:
            src = p.read_text(encoding="utf-8")
            tree = ast.parse(src)
            lines = src.splitlines()
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    out.append({"text": doc, "kind": "prose", "source": f"stdlib:{rel}"})
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno >= 6:
                code = "\n".join(lines[node.lineno - 1:node.end_lineno])
                if len(code) >= min_chars:
                    out.append({"text": code, "kind": "code", "source": f"stdlib:{rel}:{node.name}"})
    return out


def held_out_passages() -> list[dict]:
    return stdlib_passages("heldout")


def read_prompt_source(src: str) -> list[dict]:
    """Passages from one source: `stdlib`, a .jsonl file with `prompt`, or a plain text file."""
    if src == STDLIB:
        return stdlib_passages("train")
    path = Path(src)
    if not path.is_file():
        raise EdgespecError(f"{src}: no such prompt file (give .jsonl, .txt, or 'stdlib')")
    if path.suffix == ".jsonl":
        return [{"text": obj["prompt"], "kind": str(obj.get("kind", "text")),
                 "source": f"{path.name}:{i}"} for i, obj in read_prompt_lines(path)]
    text = path.read_text(encoding="utf-8", errors="replace")
    paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) >= 80]
    return [{"text": p, "kind": "text", "source": f"{path.name}:{j}"} for j, p in enumerate(paras)]


def _shard_name(i: int) -> str:
    return f"samples-{i:05d}.jsonl"


def make_data(target, prompts: list[str], out: str | Path, cfg: DataConfig | None = None,
              engine=None) -> dict:
    """Have the target continue prompts; write shards + manifest under `out`. Resumable."""
    from edgespec.runtime.decoding import Generation
    from edgespec.runtime.llama_target import LlamaTarget
    from edgespec.runtime.sampling import SamplingParams

    cfg = cfg or DataConfig()
    out = Path(out)
    passages = [p for src in (prompts or [STDLIB]) for p in read_prompt_source(src)]
    if not passages:
        raise EdgespecError("no prompts found in the given sources")
    random.Random(cfg.seed).shuffle(passages)
    passages = passages[: cfg.n_prompts]
    # the target's own greedy tokens, not the low-rank head's (they differ at a near-tie or two)
    engine = engine or LlamaTarget(target, n_ctx=cfg.prompt_tokens + cfg.new_tokens + 64, lm_head="full")
    spec = engine.spec
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EdgespecError(f"{out}: cannot create output folder ({e.strerror})") from None
    man_path = out / "manifest.json"
    manifest = read_json(man_path) if man_path.exists() else None
    if manifest and manifest.get("target_fingerprint") != spec.tokenizer_fingerprint:
        raise EdgespecError(f"{out} holds data for another target; use a new --out folder")
    if manifest and manifest.get("config") != asdict(cfg):
        raise EdgespecError(f"{out} was made with other settings; use a new --out folder")
    manifest = manifest or {"target": spec.name, "target_fingerprint": spec.tokenizer_fingerprint,
                            "config": asdict(cfg), "shards": [], "complete": False}
    done = sum(s["samples"] for s in manifest["shards"])
    rng = random.Random(cfg.seed + 1)
    modes = ["sample" if rng.random() < cfg.sample_share else "greedy" for _ in passages]
    bar = progress(total=len(passages), initial=done, desc="data", unit="prompt")
    buf: list[dict] = []
    for i in range(done, len(passages)):
        p = passages[i]
        text = p["text"]
        if cfg.chat and spec.chat_template:
            from edgespec.runtime.chat import render_chat

            # the first 600 characters as the user turn, cut further if the rendered prompt
            # would not leave room for the new tokens in the context
            content, budget = text[:600], engine.n_ctx - cfg.new_tokens - 8
            ids = engine.tokenize(render_chat(spec, [{"role": "user", "content": content}]))
            while len(ids) > budget and len(content) > 1:
                ctoks = engine.tokenize(content, add_bos=False, special=False)
                shorter = engine.detokenize(ctoks[:max(1, len(ctoks) - (len(ids) - budget))])
                content = shorter[:len(content) - 1]  # always shrinks: the loop ends
                ids = engine.tokenize(render_chat(spec, [{"role": "user", "content": content}]))
        else:
            ids = engine.tokenize(text)[: cfg.prompt_tokens]
        sp = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed + i) \
            if modes[i] == "sample" else SamplingParams()
        gen = Generation(engine, ids, sp, max_tokens=cfg.new_tokens)
        for _ in gen:
            pass
        buf.append({"index": i, "kind": p["kind"], "source": p["source"], "mode": modes[i],
                    "prompt_len": len(ids), "tokens": ids + gen.token_ids})
        bar.update(1)
        if len(buf) == cfg.shard_size or i == len(passages) - 1:
            name = _shard_name(len(manifest["shards"]))
            atomic_write_text(out / name, "".join(json.dumps(s) + "\n" for s in buf))
            manifest["shards"].append({"file": name, "samples": len(buf),
                                       "tokens": sum(len(s["tokens"]) for s in buf)})
            atomic_write_text(man_path, json.dumps(manifest, indent=1))
            buf = []
    bar.close()
    manifest["complete"] = True
    manifest["samples"] = sum(s["samples"] for s in manifest["shards"])
    manifest["tokens"] = sum(s["tokens"] for s in manifest["shards"])
    atomic_write_text(man_path, json.dumps(manifest, indent=1))
    return manifest


def read_data(folder: str | Path) -> tuple[dict, list[dict]]:
    """Load a data folder's manifest and samples; errors name what is wrong."""
    folder = Path(folder)
    man_path = folder / "manifest.json"
    if not man_path.exists():
        raise EdgespecError(f"{folder}: no manifest.json; run `edgespec data` first")
    manifest = read_json(man_path)
    if not manifest.get("complete"):
        raise EdgespecError(f"{folder}: data run is incomplete; run `edgespec data` again to resume")
    samples = []
    for s in manifest["shards"]:
        path = folder / s["file"]
        if not path.exists():
            raise EdgespecError(f"{path}: shard listed in the manifest is missing")
        for line in path.read_text(encoding="utf-8").splitlines():
            samples.append(json.loads(line))
    if not samples:
        raise EdgespecError(f"{folder}: no samples")
    return manifest, samples
