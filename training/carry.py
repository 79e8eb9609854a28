"""A training run's resumable state in files small enough for a repository (`train --carry DIR`).

A run that needs longer than a machine is kept writes, with every checkpoint, its latest state
to DIR: the head's trainable weights in float16, the optimizers' tensors in bfloat16 (second
moments span more range than float16 holds: a moment rounded to 0 would blow its update up),
each file under `MAX_FILE` bytes, and `carry.json`: the step, the schedule, the RNG state, the
training history, the checkpoint's metadata (draft vocabulary included) and the recipe (the
training config and what the features hold: target, dtype, layers, and a hash of every sample's
tokens). Committed with the repository, it lets a later run on a fresh machine that re-makes the
same data and features (both deterministic) continue where it stopped:

    edgespec train --target gemma3-270m --features FEAT --out RUN --resume --carry DIR [same flags]

The frozen LM head rows come from the target's embedding again. State from another recipe
(other features or flags) is refused. Files of a newer step are written before `carry.json`
points at them and the older ones go only after: a run killed mid-write leaves the last
state whole.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from edgespec.errors import EdgespecError, one_line
from edgespec.io import atomic_write, atomic_write_text

CARRY_FILE = "carry.json"
MAX_FILE = 18 * 2 ** 20  # bytes of tensors per file (the repository takes files < 20 MB)
# config fields a resumed run may change: they do not change what it computes
FREE_FIELDS = ("threads", "save_every", "init_from")


def recipe(feats, cfg) -> dict:
    """What a carried state is valid for: the training config and the features' content (their
    tokens, hashed, as extraction of the same data makes them on any machine)."""
    h = hashlib.sha256()
    for i in range(len(feats)):
        h.update(np.ascontiguousarray(feats.tokens[i], dtype=np.int32).tobytes())
    train = {k: v for k, v in asdict(cfg).items() if k not in FREE_FIELDS}
    return {"target_fingerprint": feats.fingerprint, "train": train,
            "features": {"dtype": feats.dtype, "layers": list(getattr(feats, "layers", ())),
                         "kv_layers": list(getattr(feats, "kv_layers", ())), "samples": len(feats),
                         "tokens": int(feats.n_tokens), "tokens_sha256": h.hexdigest()}}


def _tensors(state: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """train_state.pt's content -> (JSON-able skeleton, named tensors to store). Weights go to
    float16, optimizer tensors to bfloat16, the RNG state as bytes; the frozen LM head stays out."""
    out: dict[str, torch.Tensor] = {}
    head = {}
    for k, v in state["head"].items():
        if k != "lm_head":
            out[f"head/{k}"] = v.detach().to(torch.float16).contiguous()
            head[k] = list(v.shape)
    opts = []
    for i, sd in enumerate(state["optimizers"]):
        per = {}
        for pid, entries in sd["state"].items():
            kept = {}
            for name, v in entries.items():
                if name == "step" or not torch.is_tensor(v):  # AdamW's step count: a scalar
                    kept[name] = float(v) if torch.is_tensor(v) else v
                else:
                    out[f"opt{i}/{pid}/{name}"] = v.detach().to(torch.bfloat16).contiguous()
                    kept[name] = "tensor"
            per[str(pid)] = kept
        opts.append({"state": per, "param_groups": sd["param_groups"]})
    out["rng"] = state["torch_rng"].clone()
    skeleton = {"step": state["step"], "config": state["config"], "base_lrs": state["base_lrs"],
                "history": state["history"], "seconds": state["seconds"], "head": head,
                "optimizers": opts}
    return skeleton, out


def save_carry(folder: str | Path, state: dict, meta: dict, rec: dict) -> None:
    """Write the state of `train_state.pt` (and the checkpoint's `meta`) to `folder`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    skeleton, tensors = _tensors(state)
    files, part, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if part and size + nbytes > MAX_FILE:
            files.append(part)
            part, size = {}, 0
        part[name] = t
        size += nbytes
    files.append(part)
    names = []
    for j, part in enumerate(files):
        name = f"state-{state['step']:07d}-{j:02d}.safetensors"
        atomic_write(folder / name, lambda tmp, p=part: save_file(p, tmp))
        names.append(name)
    doc = {"format": "edgespec-carry", "version": 1, "files": names, "recipe": rec,
           "checkpoint": meta, "state": skeleton}
    atomic_write_text(folder / CARRY_FILE, json.dumps(doc, indent=1, default=str) + "\n")
    for p in folder.glob("state-*.safetensors"):  # older steps, and parts of a killed save
        if p.name not in names:
            p.unlink(missing_ok=True)


def has_carry(folder: str | Path | None) -> bool:
    return bool(folder) and (Path(folder) / CARRY_FILE).is_file()


def _differences(a: dict, b: dict, prefix: str = "", defaults: dict | None = None) -> list[str]:
    """Where two recipes differ; a training field one side lacks (an edgespec version that did
    not know it) counts as its default."""
    out = []
    for k in sorted(set(a) | set(b)):
        d = (defaults or {}).get(k) if prefix == "train." else None
        x, y = a.get(k, d), b.get(k, d)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{k}.", defaults)
        elif x != y:
            out.append(f"{prefix}{k} {x!r} (carried) vs {y!r}")
    return out


def load_carry(folder: str | Path, rec: dict, defaults: dict | None = None) -> tuple[dict, dict]:
    """(train_state.pt's content, the checkpoint's meta) from a carried state, with float32
    tensors; refuses one made for another recipe than `rec` (this run's features and flags;
    `defaults`: the training config's defaults, for fields one side lacks)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        doc = _read_doc(folder)
        skeleton, meta, carried = doc["state"], doc["checkpoint"], doc["recipe"]
        diff = _differences(carried, rec, defaults=defaults)
        if diff:
            raise EdgespecError(f"{folder} carries a run of another recipe: {'; '.join(diff[:3])}"
                                + (f" (+{len(diff) - 3} more)" if len(diff) > 3 else "")
                                + "; re-make the same features and pass the same flags")
        tensors = {}
        for name in doc["files"]:
            tensors.update(load_file(str(folder / name)))
        head = {k: tensors[f"head/{k}"].float() for k in skeleton["head"]}
        opts = []
        for i, sd in enumerate(skeleton["optimizers"]):
            state = {}
            for pid, entries in sd["state"].items():
                state[int(pid)] = {name: (tensors[f"opt{i}/{pid}/{name}"].float() if v == "tensor"
                                          else torch.tensor(v) if name == "step" else v)
                                   for name, v in entries.items()}
            opts.append({"state": state, "param_groups": sd["param_groups"]})
        rng = tensors["rng"]
    except EdgespecError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError) as e:
        raise EdgespecError(f"{folder}: unreadable carry state ({one_line(e)})") from None
    return ({"step": skeleton["step"], "config": skeleton["config"], "base_lrs": skeleton["base_lrs"],
             "optimizers": opts, "history": skeleton["history"], "seconds": skeleton["seconds"],
             "head": head, "torch_rng": rng}, meta)


def _read_doc(folder: Path) -> dict:
    doc = json.loads((folder / CARRY_FILE).read_text())
    if doc.get("format") != "edgespec-carry":
        raise ValueError("not an edgespec carry state")
    return doc


def carried_weights(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(the head's trainable weights in float32, the checkpoint's meta) of a carried
    state, whatever recipe it was carried for: what a new run with `--init-from DIR` starts
    from (its optimizer state and schedule stay behind, as for a checkpoint). The frozen LM
    head is not among the weights: it comes from the target's rows."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    folder = Path(folder)
    try:
        doc = _read_doc(folder)
        names = {f"head/{k}" for k in doc["state"]["head"]}
        head = {}
        for file in doc["files"]:
            with safe_open(str(folder / file), framework="pt") as f:
                for name in names.intersection(f.keys()):
                    head[name[len("head/"):]] = f.get_tensor(name).float()
        missing = sorted(names - {f"head/{k}" for k in head})
        if missing:
            raise ValueError(f"no tensor {missing[0]}")
        meta = doc["checkpoint"]
        meta["draft_vocab"]["ids"] = np.asarray(meta["draft_vocab"]["ids"], dtype=np.int64)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError) as e:
        raise EdgespecError(f"{folder}: unreadable carry state ({one_line(e)})") from None
    return head, meta
