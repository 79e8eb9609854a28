"""edgespec's file formats, reader side: the head config, metadata keys, and the readers the
runtime needs (numpy only). Writers (training, exporters) import the same names from here, so a
key is spelled once.

    checkpoint folder   config.json (training meta + `head`) + model.safetensors (+ draft_ids)
    head GGUF           architecture `edgespec-mtp`, keys `edgespec-mtp.*`, tensors by name
    head ONNX           model metadata `edgespec.*`
    ONNX target folder  model.onnx (+ .data) + edgespec-target.json
    low-rank basis      .npz with `basis` [E, r] and `target_fingerprint`
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError, one_line

# -- the head's hyperparameters ---------------------------------------------------------------


def _config_from(cls, d: dict, what: str, counts: tuple[str, ...]):
    """A config dataclass from a file's dict: unknown keys ignored, a missing required key or a
    count out of range a clear error."""
    names = {f.name for f in fields(cls)}
    try:
        c = cls(**{k: v for k, v in d.items() if k in names})
    except TypeError as e:
        raise EdgespecError(f"{what} is incomplete ({e})") from None
    for name in counts:
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 1 << 24:
            raise EdgespecError(f"{what} has an invalid {name} ({v!r})")
    return c


@dataclass
class HeadConfig:
    n_embd: int  # the target's hidden width (inputs and outputs live in its space)
    n_draft_vocab: int  # rows of the draft LM head
    n_head: int = 4
    n_head_kv: int = 1
    head_dim: int = 64
    n_ff: int = 1024
    layer_types: list[str] = field(default_factory=lambda: ["sliding", "global"])
    sliding_window: int = 512  # the target's window; bounds the head's own KV cache too
    rope_base_local: float = 10000.0
    rope_base_global: float = 1000000.0
    rms_eps: float = 1e-6
    embed_scale: float = 1.0  # target token embeddings are multiplied by this (Gemma: sqrt(d))
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        """Unknown keys are ignored; a missing required key, a value of the wrong type or range
        is a clear error (the dict comes from a file)."""
        if not isinstance(d, dict):
            raise EdgespecError(f"head config is not a mapping ({type(d).__name__})")
        if d.get("arch", "mtp") != "mtp":
            raise EdgespecError(f"this is a {d.get('arch')} head config, not an MTP head's")
        c = _config_from(cls, d, "head config", ("n_embd", "n_draft_vocab", "n_head", "n_head_kv",
                                                 "head_dim", "n_ff", "sliding_window"))
        for name in ("rope_base_local", "rope_base_global", "rms_eps", "embed_scale", "attn_scale"):
            v = getattr(c, name)
            if v is None and name == "attn_scale":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise EdgespecError(f"head config has an invalid {name} ({v!r})")
        if c.n_head % c.n_head_kv:
            raise EdgespecError(f"head config: {c.n_head} heads do not share {c.n_head_kv} KV heads evenly")
        if (not isinstance(c.layer_types, list) or not c.layer_types or len(c.layer_types) > 64
                or any(t not in ("sliding", "global") for t in c.layer_types)):
            raise EdgespecError(f"head config has invalid layer types ({c.layer_types!r})")
        return c

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def n_layer(self) -> int:
        return len(self.layer_types)

    @property
    def scale(self) -> float:
        return self.attn_scale or 1.0 / float(np.sqrt(self.head_dim))


@dataclass
class Eagle3Config:
    """An EAGLE-3 head, the graph llama.cpp's `eagle3` architecture runs: `fc` fuses the inputs
    of three target layers (optionally RMS-normed first) into one width-E vector g; one Llama
    decoder layer reads [norm(token embedding), norm(g)] (2E wide) at each position, SwiGLU FFN,
    residual from g; its pre-norm output is the next step's g; output norm, LM head over the
    draft vocabulary (mapped to target ids by `d2t`). Token embeddings are the target's."""

    n_embd: int  # the target's hidden width (llama.cpp reads the target's token embeddings)
    n_draft_vocab: int
    target_layers: list[int]  # the three target layers whose inputs are the features
    n_head: int = 8
    n_head_kv: int = 2
    head_dim: int = 64
    n_ff: int = 1536
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    norm_before_fc: bool = True  # RMSNorm over the 3E features before fc (llama.cpp: norm_before_fc)
    context_length: int = 8192
    arch: str = "eagle3"

    @classmethod
    def from_dict(cls, d: dict) -> "Eagle3Config":
        if not isinstance(d, dict) or d.get("arch") != "eagle3":
            raise EdgespecError("not an EAGLE-3 head config")
        c = _config_from(cls, d, "EAGLE-3 head config", ("n_embd", "n_draft_vocab", "n_head",
                                                         "n_head_kv", "head_dim", "n_ff", "context_length"))
        if (not isinstance(c.target_layers, list) or len(c.target_layers) != 3
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 1 for i in c.target_layers)):
            raise EdgespecError(f"EAGLE-3 head config: target_layers must be 3 layer ids >= 1 "
                                f"({c.target_layers!r})")
        if c.n_head % c.n_head_kv:
            raise EdgespecError(f"EAGLE-3 head config: {c.n_head} heads do not share "
                                f"{c.n_head_kv} KV heads evenly")
        return c

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SharedKVConfig:
    """A shared-KV MTP head (the shape of llama.cpp's `gemma4-assistant` drafts): no keys or
    values of its own; each layer's queries attend the target's KV cache of one target layer
    (`kv_layers`, one per head layer: a sliding layer reads a sliding target layer within the
    target's window). Its input is pre_proj(concat(token embedding x embed_scale, h)), h the
    target's final hidden state at the first step and its own post_proj output after; every
    draft of a chain sits at the position after the target's last one. Output: out_norm, then
    post_proj back to the target's width, then the draft LM head (the target's embedding rows
    for the draft vocabulary, frozen). Head width `d_model` may differ from the target's."""

    n_embd: int  # the target's hidden width
    n_draft_vocab: int
    kv_layers: list[int]  # the target layer each head layer attends
    layer_types: list[str]  # "sliding" / "global", the target's type of each kv layer
    n_head: int  # query heads; the keys' heads are the target's (n_head_kv x head_dim)
    n_head_kv: int
    head_dim: int
    d_model: int = 640
    n_ff: int = 1024
    sliding_window: int = 512
    rope_base_local: float = 10000.0
    rope_base_global: float = 1000000.0
    rms_eps: float = 1e-6
    embed_scale: float = 1.0
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)
    # RMS-norm the token embedding and the hidden state before pre_proj, as the MTP head does
    # (llama.cpp's Gemma 4 assistant has no such norms: off by default)
    input_norms: bool = False
    arch: str = "shared-kv"

    @classmethod
    def from_dict(cls, d: dict) -> "SharedKVConfig":
        if not isinstance(d, dict) or d.get("arch") != "shared-kv":
            raise EdgespecError("not a shared-KV head config")
        c = _config_from(cls, d, "shared-KV head config", ("n_embd", "n_draft_vocab", "n_head",
                                                           "n_head_kv", "head_dim", "d_model", "n_ff",
                                                           "sliding_window"))
        if (not isinstance(c.kv_layers, list) or not c.kv_layers or not isinstance(c.layer_types, list)
                or len(c.layer_types) != len(c.kv_layers)
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in c.kv_layers)
                or any(t not in ("sliding", "global") for t in c.layer_types)):
            raise EdgespecError(f"shared-KV head config: kv_layers {c.kv_layers!r} and layer_types "
                                f"{c.layer_types!r} must be one layer id and type per head layer")
        if c.n_head % c.n_head_kv:
            raise EdgespecError(f"shared-KV head config: {c.n_head} heads do not share "
                                f"{c.n_head_kv} KV heads evenly")
        return c

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def n_layer(self) -> int:
        return len(self.kv_layers)

    @property
    def kv_width(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale or 1.0 / float(np.sqrt(self.head_dim))


HEAD_ARCHS = ("mtp", "eagle3", "shared-kv")


def head_arch(head_config: dict) -> str:
    """"eagle3", "shared-kv" or "mtp" (edgespec's own head) for a checkpoint's `head` entry."""
    arch = head_config.get("arch") if isinstance(head_config, dict) else None
    return arch if arch in ("eagle3", "shared-kv") else "mtp"


# Sliding-window KV caches (the head's own, the ONNX target's) keep the window plus this many
# positions, so a rollback of up to MARGIN tokens never has to re-decode.
KV_MARGIN = 64


def kept_positions(window: int) -> int:
    """Positions a sliding-window cache keeps: the window bounds every key a query can see."""
    return window + KV_MARGIN


# -- checkpoint folders (`edgespec train`) ------------------------------------------------------
CKPT_CONFIG, CKPT_WEIGHTS, CKPT_STATE = "config.json", "model.safetensors", "train_state.pt"
# The config also rides in the weights file's metadata, so one atomic write saves a whole
# checkpoint: config.json is a readable copy, and a save killed between the two files leaves
# weights whose own config still describes them.
CKPT_META_CONFIG = "edgespec.config"
DRAFT_IDS = "draft_ids"  # the draft vocabulary's target ids, stored beside the weights

# -- head GGUF (`edgespec export gguf`) ---------------------------------------------------------
GGUF_ARCH = "edgespec-mtp"
GGUF_SHARED_KV_ARCH = "edgespec-shared-kv"  # a shared-KV head's file: the same keys under its name
GGUF_HEAD_CONFIG = f"{GGUF_ARCH}.head_config"
GGUF_TARGET = f"{GGUF_ARCH}.target"
GGUF_FINGERPRINT = f"{GGUF_ARCH}.target_fingerprint"
GGUF_TRAIN_META = f"{GGUF_ARCH}.train_meta"
GGUF_DRAFT_VOCAB = f"{GGUF_ARCH}.draft_vocab"

# -- head ONNX (`edgespec export onnx`) ---------------------------------------------------------
ONNX_FORMAT, ONNX_HEAD_FORMAT, ONNX_TARGET_FORMAT = "edgespec.format", "edgespec-mtp-onnx", "edgespec-target-onnx"
ONNX_HEAD_CONFIG = "edgespec.head_config"
ONNX_TARGET = "edgespec.target"
ONNX_FINGERPRINT = "edgespec.target_fingerprint"
ONNX_DRAFT_VOCAB = "edgespec.draft_vocab"
ONNX_QUANT = "edgespec.quant"

# -- ONNX target folder (`edgespec export onnx-target`) -----------------------------------------
TARGET_META = "edgespec-target.json"
TARGET_META_KEYS = ("target", "target_fingerprint", "n_vocab", "n_embd", "n_layer", "layer_types",
                    "n_head_kv", "head_dim", "embed_scale")

# -- low-rank LM head basis (`edgespec export lowrank-basis`) -----------------------------------
BASIS_NAME = "lowrank-basis.npz"  # the shipped file's name under runtime/heads/<target>/


def cache_names(n_layer: int) -> tuple[list[str], list[str]]:
    """(past_key_values.{i}.key/value inputs, present.{i}.key/value outputs), layer by layer."""
    past = [f"past_key_values.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(n_layer) for kv in ("key", "value")]
    return past, present


@dataclass
class HeadFile:
    """What a head file or checkpoint says about itself; `weights` only where numpy runs it."""

    path: Path
    config: HeadConfig
    target: str | None
    fingerprint: str | None
    draft_ids: np.ndarray  # int64 target ids of the draft vocabulary
    weights: dict[str, np.ndarray] | None = None


def read_checkpoint_config(ckpt: str | Path) -> dict:
    """A checkpoint's config: the copy inside its weights file, else (older checkpoints)
    config.json."""
    from safetensors import safe_open

    ckpt = Path(ckpt)
    if not (ckpt / CKPT_WEIGHTS).exists():
        raise EdgespecError(f"{ckpt}: not a head checkpoint (missing {CKPT_WEIGHTS})")
    try:
        with safe_open(str(ckpt / CKPT_WEIGHTS), framework="np") as f:
            inner = (f.metadata() or {}).get(CKPT_META_CONFIG)
        if inner is None and not (ckpt / CKPT_CONFIG).exists():
            raise EdgespecError(f"{ckpt}: not a head checkpoint (missing {CKPT_CONFIG})")
        meta = json.loads(inner if inner is not None else (ckpt / CKPT_CONFIG).read_text())
    except EdgespecError:
        raise
    except Exception as e:
        raise EdgespecError(f"{ckpt}: unreadable checkpoint ({one_line(e)})") from None
    if not isinstance(meta, dict):
        raise EdgespecError(f"{ckpt}: checkpoint config is not a JSON object")
    return meta


def read_checkpoint(ckpt: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """A training checkpoint folder -> (meta, numpy weights incl. `draft_ids`)."""
    from safetensors.numpy import load_file

    ckpt = Path(ckpt)
    meta = read_checkpoint_config(ckpt)
    try:
        weights = load_file(str(ckpt / CKPT_WEIGHTS))
    except Exception as e:
        raise EdgespecError(f"{ckpt}: unreadable checkpoint ({one_line(e)})") from None
    if "head" not in meta or DRAFT_IDS not in weights:
        raise EdgespecError(f"{ckpt}: checkpoint lacks its head config or draft vocabulary")
    for key in ("target", "target_fingerprint"):
        if not isinstance(meta.get(key), str):
            raise EdgespecError(f"{ckpt}: checkpoint config has no valid {key}")
    return meta, weights


def require_mtp_head(head_config: dict, ckpt: str | Path, asked: str = "") -> None:
    """Where edgespec's own MTP head is needed, an EAGLE-3 checkpoint is a clear error naming
    the exports it has (`asked`: what was asked of it, for the message)."""
    if head_arch(head_config) == "eagle3":
        raise EdgespecError(f"{ckpt} is an EAGLE-3 head{asked}: export it for llama.cpp with "
                            "`edgespec export llama-cpp` (or for vLLM with `edgespec export speculators`)")
    if head_arch(head_config) == "shared-kv":
        raise EdgespecError(f"{ckpt} is a shared-KV head{asked}: it reads the target's KV cache; "
                            "draft with its checkpoint folder (`--draft FOLDER`) or evaluate it "
                            "with `edgespec eval-head`")


def read_checkpoint_head(ckpt: str | Path, shared_kv: bool = False) -> HeadFile:
    """A checkpoint's MTP head (or, with `shared_kv`, a shared-KV head too) with its weights."""
    meta, w = read_checkpoint(ckpt)
    kv = shared_kv and head_arch(meta["head"]) == "shared-kv"
    if not kv:
        require_mtp_head(meta["head"], ckpt)
    ids = w.pop(DRAFT_IDS).astype(np.int64)
    config = (SharedKVConfig if kv else HeadConfig).from_dict(meta["head"])
    check_head_weights(ckpt, config, w, ids)
    return HeadFile(Path(ckpt), config, meta["target"], meta["target_fingerprint"], ids, w)


def shared_kv_weight_shapes(c: SharedKVConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a shared-KV head of this config has (training/shared_kv.py's names)."""
    e, d, hd = c.n_embd, c.d_model, c.head_dim
    want = {"pre_proj.weight": (d, 2 * e), "out_norm.weight": (d,), "post_proj.weight": (e, d),
            "lm_head": (c.n_draft_vocab, e)}
    if c.input_norms:
        want.update({"emb_norm.weight": (e,), "hid_norm.weight": (e,)})
    for i in range(c.n_layer):
        p = f"blocks.{i}."
        want.update({p + "input_norm.weight": (d,), p + "q.weight": (c.n_head * hd, d),
                     p + "q_norm.weight": (hd,), p + "o.weight": (d, c.n_head * hd),
                     p + "post_attn_norm.weight": (d,), p + "pre_ffn_norm.weight": (d,),
                     p + "gate.weight": (c.n_ff, d), p + "up.weight": (c.n_ff, d),
                     p + "down.weight": (d, c.n_ff), p + "post_ffn_norm.weight": (d,)})
    return want


def head_weight_shapes(c: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a head of this config has, with its shape (torch Linear layout)."""
    e, hd = c.n_embd, c.head_dim
    want = {"emb_norm.weight": (e,), "hid_norm.weight": (e,), "fc.weight": (e, 2 * e),
            "out_norm.weight": (e,), "lm_head": (c.n_draft_vocab, e)}
    for i in range(c.n_layer):
        p = f"blocks.{i}."
        want.update({p + "input_norm.weight": (e,), p + "q.weight": (c.n_head * hd, e),
                     p + "k.weight": (c.n_head_kv * hd, e), p + "v.weight": (c.n_head_kv * hd, e),
                     p + "o.weight": (e, c.n_head * hd), p + "q_norm.weight": (hd,),
                     p + "k_norm.weight": (hd,), p + "post_attn_norm.weight": (e,),
                     p + "pre_ffn_norm.weight": (e,), p + "gate.weight": (c.n_ff, e),
                     p + "up.weight": (c.n_ff, e), p + "down.weight": (e, c.n_ff),
                     p + "post_ffn_norm.weight": (e,)})
    return want


def check_head_weights(path, c: HeadConfig | SharedKVConfig, w: dict[str, np.ndarray], ids: np.ndarray) -> None:
    """The weights a head config calls for, in its shapes (a file may say one thing, hold another)."""
    want = shared_kv_weight_shapes(c) if isinstance(c, SharedKVConfig) else head_weight_shapes(c)
    for name, shape in want.items():
        got = w.get(name)
        if got is None or tuple(got.shape) != shape:
            raise EdgespecError(f"{path}: head weight {name} is "
                                f"{'missing' if got is None else tuple(got.shape)}, its config needs {shape}")
    if ids.ndim != 1 or len(ids) != c.n_draft_vocab or (ids < 0).any():
        raise EdgespecError(f"{path}: the draft vocabulary does not fit the head config")


def read_head_gguf(path: str | Path, weights: bool = True) -> HeadFile:
    """A head GGUF -> its config, target, draft vocabulary and (float32) weights."""
    from edgespec.gguf_meta import TensorRows, read_header

    header = read_header(path)
    md = header.metadata
    arch = md.get("general.architecture")
    if arch not in (GGUF_ARCH, GGUF_SHARED_KV_ARCH):
        raise EdgespecError(f"{path}: not an edgespec head (architecture {arch})")
    key = lambda name: name.replace(GGUF_ARCH, arch, 1)  # noqa: E731
    try:
        kind = SharedKVConfig if arch == GGUF_SHARED_KV_ARCH else HeadConfig
        config = kind.from_dict(json.loads(md[key(GGUF_HEAD_CONFIG)]))
        info = (md.get(key(GGUF_TARGET)), md[key(GGUF_FINGERPRINT)],
                np.asarray(md[key(GGUF_DRAFT_VOCAB)], dtype=np.int64))
    except (KeyError, TypeError, ValueError) as e:
        raise EdgespecError(f"{path}: edgespec head metadata is incomplete ({e})") from None
    if not isinstance(info[1], str):
        raise EdgespecError(f"{path}: edgespec head metadata is incomplete (target fingerprint)")
    w = None
    if weights:
        w = {}
        for name, t in header.tensors.items():
            arr = TensorRows(header, name)[:]
            w[name] = arr.reshape(tuple(reversed(t.shape))) if len(t.shape) > 1 else arr.reshape(-1)
        check_head_weights(path, config, w, info[2])
    return HeadFile(Path(path), config, *info, weights=w)


def read_onnx_head_meta(path: str | Path, md: dict[str, str]) -> HeadFile:
    """The metadata of a head ONNX file (`md`: onnxruntime's custom metadata map)."""
    if md.get(ONNX_FORMAT) != ONNX_HEAD_FORMAT:
        raise EdgespecError(f"{path}: not an edgespec head (no edgespec metadata)")
    try:
        raw = json.loads(md[ONNX_HEAD_CONFIG])
        config = (SharedKVConfig if head_arch(raw) == "shared-kv" else HeadConfig).from_dict(raw)
        ids = np.asarray(json.loads(md[ONNX_DRAFT_VOCAB]), dtype=np.int64)
        return HeadFile(Path(path), config, md.get(ONNX_TARGET), md[ONNX_FINGERPRINT], ids)
    except (KeyError, TypeError, ValueError) as e:
        raise EdgespecError(f"{path}: edgespec head metadata is incomplete ({e})") from None


def read_target_meta(folder: Path) -> dict:
    """An ONNX target folder's `edgespec-target.json`, every field the engine reads present."""
    meta_path = folder / TARGET_META
    if not meta_path.is_file() or not (folder / "model.onnx").is_file():
        raise EdgespecError(f"{folder}: not an ONNX target folder (made by `edgespec export "
                            "onnx-target`)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise EdgespecError(f"{meta_path}: unreadable ({e})") from None
    missing = [k for k in TARGET_META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise EdgespecError(f"{meta_path}: incomplete metadata (missing {', '.join(missing)}); "
                            "export the target again")
    return meta


# -- EAGLE-3 head GGUF (`edgespec export llama-cpp`: llama.cpp's own `eagle3` architecture) ------
EAGLE3_ARCH = "eagle3"
EAGLE3_CONFIG = "edgespec.head_config"  # edgespec's keys in the file (llama.cpp ignores them)
EAGLE3_TARGET = "edgespec.target"
EAGLE3_FINGERPRINT = "edgespec.target_fingerprint"


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """[n_head * D, in] rows in llama.cpp's interleaved RoPE order (2i, 2i + 1) -> the
    rotate-half order (i, i + D/2) training uses."""
    out, d_in = w.shape
    d = out // n_head
    return w.reshape(n_head, d // 2, 2, d_in).swapaxes(1, 2).reshape(out, d_in)


# llama.cpp tensor name -> the checkpoint's (torch) name
EAGLE3_TENSORS = {"fc.weight": "fc.weight", "enc.output_norm.weight": "enc_norm.weight",
                  "blk.0.attn_norm.weight": "attn_norm.weight",
                  "blk.0.attn_norm_2.weight": "hidden_norm.weight",
                  "blk.0.attn_q.weight": "q.weight", "blk.0.attn_k.weight": "k.weight",
                  "blk.0.attn_v.weight": "v.weight", "blk.0.attn_output.weight": "o.weight",
                  "blk.0.ffn_norm.weight": "ffn_norm.weight", "blk.0.ffn_gate.weight": "gate.weight",
                  "blk.0.ffn_up.weight": "up.weight", "blk.0.ffn_down.weight": "down.weight",
                  "output_norm.weight": "out_norm.weight", "output.weight": "lm_head"}


def eagle3_weight_shapes(c: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every weight of an EAGLE-3 head, torch layout ([out, in] for matrices)."""
    e, hd = c.n_embd, c.head_dim
    want = {"fc.weight": (e, 3 * e), "attn_norm.weight": (e,), "hidden_norm.weight": (e,),
            "q.weight": (c.n_head * hd, 2 * e), "k.weight": (c.n_head_kv * hd, 2 * e),
            "v.weight": (c.n_head_kv * hd, 2 * e), "o.weight": (e, c.n_head * hd),
            "ffn_norm.weight": (e,), "gate.weight": (c.n_ff, e), "up.weight": (c.n_ff, e),
            "down.weight": (e, c.n_ff), "out_norm.weight": (e,), "lm_head": (c.n_draft_vocab, e)}
    if c.norm_before_fc:
        want["enc_norm.weight"] = (3 * e,)
    return want


def gguf_architecture(path: str | Path) -> str | None:
    """The `general.architecture` of a GGUF file (None where it has none)."""
    from edgespec.gguf_meta import read_header

    arch = read_header(path).metadata.get("general.architecture")
    return arch if isinstance(arch, str) else None


def read_eagle3_file(path: str | Path) -> HeadFile:
    """An EAGLE-3 head GGUF written by `edgespec export llama-cpp` -> its config, target, draft
    vocabulary (from `d2t`) and float32 weights under the checkpoint's names (q/k rows back in
    rotate-half order)."""
    import gguf
    from gguf.quants import dequantize

    path = Path(path)
    try:
        r = gguf.GGUFReader(str(path))
        fields = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.")}
    except Exception as e:
        raise EdgespecError(f"{path}: not a readable GGUF file ({one_line(e)})") from None
    if fields.get("general.architecture") != EAGLE3_ARCH or EAGLE3_CONFIG not in fields:
        raise EdgespecError(f"{path}: not an EAGLE-3 head exported by edgespec")
    try:
        c = Eagle3Config.from_dict(json.loads(fields[EAGLE3_CONFIG]))
        w, ids = {}, None
        for x in r.tensors:
            a = np.asarray(x.data)
            if x.name == "d2t":
                ids = a.astype(np.int64).reshape(-1)
                continue
            if x.tensor_type != gguf.GGMLQuantizationType.F32:
                a = dequantize(a, x.tensor_type)
            if x.name in EAGLE3_TENSORS:
                w[EAGLE3_TENSORS[x.name]] = np.array(a, dtype=np.float32).reshape(
                    [int(n) for n in reversed(x.shape)] if len(x.shape) > 1 else -1)
    except (TypeError, ValueError, NotImplementedError) as e:
        raise EdgespecError(f"{path}: unreadable EAGLE-3 head ({one_line(e)})") from None
    shapes = eagle3_weight_shapes(c)
    if (ids is None or len(ids) != c.n_draft_vocab or ids.min(initial=0) < 0 or set(w) != set(shapes)
            or any(w[k].shape != shape for k, shape in shapes.items())):
        raise EdgespecError(f"{path}: EAGLE-3 head tensors do not match its config")
    w["q.weight"] = unpermute_rope(w["q.weight"], c.n_head)
    w["k.weight"] = unpermute_rope(w["k.weight"], c.n_head_kv)
    fp = fields.get(EAGLE3_FINGERPRINT)
    if not isinstance(fp, str):
        raise EdgespecError(f"{path}: EAGLE-3 head has no target fingerprint")
    return HeadFile(path, c, fields.get(EAGLE3_TARGET), fp, ids, w)
