"""EAGLE-3 heads as a checkpoint folder in the format of vLLM's `speculators` library.

    edgespec export speculators runs/smol/eagle3 --out smol-eagle3/
    vllm serve HuggingFaceTB/SmolLM2-135M-Instruct \\
        --speculative-config '{"model": "smol-eagle3", "num_speculative_tokens": 3, "method": "eagle3"}'

The folder is what `speculators` 0.9.0 saves for its `eagle3` model type: `config.json`
(`speculators_model_type` "eagle3", the decoder layer as a Llama `transformer_layer_config`,
the target layers whose inputs are fused as `eagle_aux_hidden_state_layer_ids`, the draft
vocabulary size, `norm_before_fc`, and `speculators_config` naming the algorithm, a greedy
proposal method and the verifier) and `model.safetensors`: `fc`, `input_norm` (the norm over
the fused features), `layers.0.*` (input_layernorm on the token embedding, hidden_norm on the
fused state, q/k/v/o in Hugging Face's rotate-half RoPE layout, which is the one edgespec
trains in, post_attention_layernorm, SwiGLU), `norm`, `lm_head` over the draft vocabulary,
`d2t` (int64: target id minus draft id, the library's offsets) and `t2d` (bool over the target
vocabulary). There is no `embed_tokens`: engines take the verifier's, as the head was trained
with the target's rows. llama.cpp's `convert_hf_to_gguf.py --target-model-dir` turns the folder
into the same GGUF `edgespec export llama-cpp` writes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.runtime.formats import Eagle3Config

SPECULATORS_VERSION = "0.9.0"  # the library version whose schema this writes (and the tests load)
# edgespec's checkpoint names -> the library's
TENSORS = {"fc.weight": "fc.weight", "enc_norm.weight": "input_norm.weight",
           "attn_norm.weight": "layers.0.input_layernorm.weight",
           "hidden_norm.weight": "layers.0.hidden_norm.weight",
           "q.weight": "layers.0.self_attn.q_proj.weight",
           "k.weight": "layers.0.self_attn.k_proj.weight",
           "v.weight": "layers.0.self_attn.v_proj.weight",
           "o.weight": "layers.0.self_attn.o_proj.weight",
           "ffn_norm.weight": "layers.0.post_attention_layernorm.weight",
           "gate.weight": "layers.0.mlp.gate_proj.weight", "up.weight": "layers.0.mlp.up_proj.weight",
           "down.weight": "layers.0.mlp.down_proj.weight", "out_norm.weight": "norm.weight",
           "lm_head": "lm_head.weight"}
# Hugging Face class of each target architecture (the verifier vLLM loads)
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM"}
DTYPES = {"float32": np.float32, "float16": np.float16}


# The Hugging Face repositories of the targets edgespec ships
KNOWN_VERIFIERS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
                   "gemma3-270m": "google/gemma-3-270m"}


def verifier_name(spec) -> str:
    """The target's Hugging Face repository: known for the shipped targets, else the one its
    GGUF says it was made from, else its name."""
    from gguf import GGUFReader

    if spec.name in KNOWN_VERIFIERS:
        return KNOWN_VERIFIERS[spec.name]
    r = GGUFReader(spec.path)
    for key in ("general.base_model.0.repo_url", "general.source.url"):
        f = r.fields.get(key)
        if f is not None:
            url = str(f.contents())
            if "huggingface.co/" in url:
                return url.split("huggingface.co/", 1)[1].strip("/")
    f = r.fields.get("general.name")
    return str(f.contents()) if f is not None else spec.name


def speculators_config(c: Eagle3Config, n_vocab: int, verifier: str, architecture: str,
                       dtype: str, draft_tokens: int = 3) -> dict:
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": c.n_embd,
             "num_hidden_layers": 1, "num_attention_heads": c.n_head,
             "num_key_value_heads": c.n_head_kv, "head_dim": c.head_dim,
             "intermediate_size": c.n_ff, "vocab_size": n_vocab, "rms_norm_eps": c.rms_eps,
             "hidden_act": "silu", "max_position_embeddings": c.context_length,
             "rope_theta": c.rope_base,
             "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_base},
             "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
             "dtype": dtype}
    return {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer,
            "draft_vocab_size": c.n_draft_vocab, "norm_before_residual": False,
            "norm_before_fc": bool(c.norm_before_fc), "fc_norm": False, "norm_output": False,
            "embed_requires_grad": False, "target_hidden_size": c.n_embd,
            "eagle_aux_hidden_state_layer_ids": [int(i) for i in c.target_layers],
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": draft_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": verifier, "architectures": [architecture]}},
            "dtype": dtype}


def speculators_weights(c: Eagle3Config, weights: dict[str, np.ndarray], ids: np.ndarray,
                        n_vocab: int, dtype=np.float32) -> dict[str, np.ndarray]:
    out = {theirs: np.ascontiguousarray(weights[ours], dtype=dtype)
           for ours, theirs in TENSORS.items() if ours in weights}
    if c.norm_before_fc and "input_norm.weight" not in out:
        raise EdgespecError("the checkpoint has no norm before fc although its config asks for one")
    out["d2t"] = (ids - np.arange(len(ids))).astype(np.int64)
    t2d = np.zeros(n_vocab, dtype=bool)
    t2d[ids] = True
    out["t2d"] = t2d
    return out


def write_speculators(ckpt: str | Path, out: str | Path, verifier: str | None = None,
                      dtype: str = "float32") -> dict:
    """Write the folder (atomically: built beside `out`, then swapped in); a summary."""
    from safetensors.numpy import save_file

    from edgespec.exporters.eagle3_gguf import read_eagle3_checkpoint

    if dtype not in DTYPES:
        raise EdgespecError(f"unknown --dtype {dtype} for speculators; choose from {', '.join(DTYPES)}")
    meta, c, spec, weights, ids = read_eagle3_checkpoint(
        ckpt, "the speculators format has no model type for edgespec's MTP heads")
    arch = HF_ARCHITECTURES.get(spec.arch)
    if arch is None:
        raise EdgespecError(f"no Hugging Face architecture known for a {spec.arch} target")
    verifier = verifier or verifier_name(spec)
    config = speculators_config(c, spec.n_vocab, verifier, arch, dtype)
    tensors = speculators_weights(c, weights, ids, spec.n_vocab, DTYPES[dtype])
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise EdgespecError(f"{out} exists and is not a folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise EdgespecError(f"{out}: could not write the folder ({e.strerror or e})") from None
    return {"out": str(out), "verifier": verifier, "architecture": arch, "tensors": len(tensors),
            "bytes": sum(p.stat().st_size for p in out.iterdir()), "dtype": dtype}


# Run by the `speculators` package's own Python (its pins differ from edgespec's: `make
# speculators` puts it in a venv of its own): load the folder as the library does, with the
# embeddings handed in (no verifier download), and run its forward for one draft step.
_LIBRARY_CHECK = r"""
import json, sys
import numpy as np, torch
from safetensors.torch import load_file
from speculators import SpeculatorModel, SpeculatorModelConfig
from speculators.models.eagle3.core import Eagle3DraftModel

# the verifier's embeddings are handed in below: no download of the verifier
Eagle3DraftModel.load_verifier_weights = lambda self: None
folder, inputs, out = sys.argv[1:4]
cfg = SpeculatorModelConfig.from_pretrained(folder)
cfg.speculators_config.verifier.name_or_path = None
model = SpeculatorModel.from_pretrained(folder, config=cfg).eval()
saved, sd = load_file(folder + "/model.safetensors"), model.state_dict()
d = np.load(inputs)
logits = {}
with torch.no_grad():
    model.embed_tokens.weight.copy_(torch.from_numpy(d["embed"]))
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.setdefault("x", o))
    for j in range(int(d["n"])):
        logits.clear()
        hid, ids = torch.from_numpy(d[f"hidden{j}"])[None], torch.from_numpy(d[f"ids{j}"])[None]
        model(hidden_states=hid, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=1)
        np.save(f"{out}.{j}.npy", logits["x"][0].float().numpy())
json.dump({"config_class": type(cfg).__name__, "model_class": type(model).__name__,
           "model_type": cfg.speculators_model_type,
           "tensors_equal": {k: bool(torch.equal(sd[k].float(), v.float())) for k, v in saved.items() if k in sd},
           "tensors_not_in_model": sorted(set(saved) - set(sd))}, open(out, "w"))
"""


def speculators_python() -> str:
    import os

    py = os.environ.get("EDGESPEC_SPECULATORS_PYTHON")
    if not py or not Path(py).is_file():
        raise EdgespecError("the check runs the speculators package from a venv of its own: "
                            "`make speculators`, then set EDGESPEC_SPECULATORS_PYTHON to its python")
    return py


def check_speculators_export(ckpt: str | Path, folder: str | Path, features: str | Path,
                             max_samples: int = 8, python: str | None = None) -> dict:
    """The `speculators` library (0.9.0, its own venv) loads the folder: its config class, its
    model class, every tensor as written; its forward on held-out features against the trained
    head's first draft step (logits over the draft vocabulary, top-1 agreement)."""
    import subprocess

    import torch

    from edgespec.exporters.eagle3_gguf import heldout_features
    from edgespec.training.train import load_checkpoint

    py = python or speculators_python()
    head, meta = load_checkpoint(ckpt)
    feats, idx, rows = heldout_features(head, meta, features, max_samples)
    embed = np.asarray(rows[0:rows.n_rows], dtype=np.float32)
    e, arrays, ours = head.c.n_embd, {"embed": embed}, []
    with torch.no_grad():
        for i in idx:
            toks = feats.tokens[i].astype(np.int64)
            hid = feats.hidden(i)
            T = len(toks) - 1
            emb = torch.from_numpy(embed[toks])[None, 1:]
            a = head.forward_chain(emb, torch.from_numpy(hid)[None, :T], 1)
            ours.append(head.logits(a[0][0]).numpy())
            arrays[f"hidden{len(ours) - 1}"] = np.ascontiguousarray(hid[:T, e:], dtype=np.float32)
            arrays[f"ids{len(ours) - 1}"] = toks[1:T + 1]
    arrays["n"] = np.array(len(ours))
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(Path(tmp) / "inputs.npz", **arrays)
        out = Path(tmp) / "out.json"
        r = subprocess.run([py, "-c", _LIBRARY_CHECK, str(folder), str(Path(tmp) / "inputs.npz"),
                            str(out)], capture_output=True, text=True)
        if r.returncode != 0:
            tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise EdgespecError(f"the speculators package could not load {folder}: {tail}")
        lib = json.loads(out.read_text())
        theirs = [np.load(f"{out}.{j}.npy") for j in range(len(ours))]
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ours, theirs))
    n = sum(len(a) for a in ours)
    return {**lib, "compared": n, "top1_agreement": round(agree / max(n, 1), 4),
            "max_logit_error": round(max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs)), 5)}


def write_target_hf_dir(spec, out: str | Path) -> Path:
    """A Hugging Face folder for the target (config and tokenizer, no weights), written by
    transformers from the target's GGUF: what `convert_hf_to_gguf.py --target-model-dir`
    reads for an EAGLE-3 head."""
    from transformers import AutoConfig, AutoTokenizer

    p, out = Path(spec.path), Path(out)
    cfg = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
    cfg.architectures = [HF_ARCHITECTURES.get(spec.arch, "LlamaForCausalLM")]
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    return out
