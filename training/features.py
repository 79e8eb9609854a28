"""Stage 2, hidden states: run the target over the data on llama.cpp and store, per token, the
final hidden state (after the output norm: exactly what the runtime feeds the head) and the id.

    edgespec extract --target gemma3-270m --data runs/gemma/data --out runs/gemma/feat --dtype int4

Storage: safetensors shards, one per `shard_samples` samples, each with `tokens` int32 [N],
`seq` int32 [N] (sample index), and the hidden states as
    fp16   `hidden` float16 [N, E]
    int8   `q` int8 [N, E] + `scale` float16 [N, E/G]            (symmetric, per group of G)
    int4   `q` uint8 [N, E/2] (two values a byte) + `scale` float16 [N, E/G]
plus `manifest.json` (target fingerprint, dtype, group size, counts, sha256 per shard, bytes per
token). Before int8/int4 quantization each vector is divided by per-channel scales (the square
root of each channel's RMS over the first shard, kept in the manifest) and turned by an
orthonormal DCT-II: the target's few huge outlier channels then no longer set the scale of their
whole group, which cuts the int4 error of the teacher distribution at the same bytes per token
(`scripts/feature_quant_error.py` measures it, results/feature-quant-error.json); `--transform none`
turns it off. Shards are written atomically; a killed run resumes at the next unwritten shard.
Reading is memory-mapped and checks each shard's checksum once.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgespec.cache import sha256_file
from edgespec.errors import EdgespecError
from edgespec.io import atomic_write, atomic_write_text, progress, read_json

DTYPES = ("fp16", "int8", "int4")
_QMAX = {"int8": 127, "int4": 7}


# -- quantization ---------------------------------------------------------------------------
def quantize(h: np.ndarray, dtype: str, group: int) -> dict[str, np.ndarray]:
    """[N, E] float -> arrays to store. Symmetric per-group scales (absmax / qmax)."""
    if dtype == "fp16":
        return {"hidden": h.astype(np.float16)}
    n, e = h.shape
    if e % group:
        raise EdgespecError(f"group size {group} does not divide the hidden width {e}")
    g = h.astype(np.float32).reshape(n, e // group, group)
    qmax = _QMAX[dtype]
    scale = np.abs(g).max(axis=2, keepdims=True) / qmax
    scale = np.where(scale == 0, 1.0, scale).astype(np.float16)
    q = np.clip(np.rint(g / scale.astype(np.float32)), -qmax - 1, qmax).astype(np.int8).reshape(n, e)
    if dtype == "int4":
        u = (q + 8).astype(np.uint8)
        q = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)
    return {"q": q, "scale": scale.reshape(n, e // group)}


def dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II as an [n, n] float32 matrix M with coefficients = x @ M."""
    k, i = np.arange(n)[None, :], np.arange(n)[:, None]
    m = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * i + 1) * k / (2 * n))
    m[:, 0] /= np.sqrt(2.0)
    return m.astype(np.float32)


def make_transform(h: np.ndarray) -> dict:
    """Per-channel scales (sqrt of the channel RMS) from sample hidden states [N, E]."""
    rms = np.sqrt((h.astype(np.float64) ** 2).mean(axis=0))
    return {"kind": "dct", "channel_scale": [float(x) for x in np.maximum(np.sqrt(rms), 1e-3).astype(np.float32)]}


class Codec:
    """Hidden states <-> stored arrays for one features folder (dtype, group, transform)."""

    def __init__(self, dtype: str, group: int, transform: dict | None = None):
        self.dtype, self.group = dtype, group
        self.transform = transform if dtype != "fp16" and transform and transform["kind"] != "none" else None
        if self.transform:
            self.scale = np.asarray(self.transform["channel_scale"], dtype=np.float32)
            self.basis = dct_matrix(len(self.scale))

    def encode(self, h: np.ndarray) -> dict[str, np.ndarray]:
        if self.transform:
            h = (h.astype(np.float32) / self.scale) @ self.basis
        return quantize(h, self.dtype, self.group)

    def decode(self, arrays: dict[str, np.ndarray]) -> np.ndarray:
        h = dequantize(arrays, self.dtype, self.group)
        if self.transform:
            h = (h @ self.basis.T) * self.scale
        return h

    def names(self) -> list[str]:
        return ["hidden"] if self.dtype == "fp16" else ["q", "scale"]


def dequantize(arrays: dict[str, np.ndarray], dtype: str, group: int) -> np.ndarray:
    """Inverse of `quantize`: -> float32 [N, E]."""
    if dtype == "fp16":
        return np.asarray(arrays["hidden"], dtype=np.float32)
    q, scale = np.asarray(arrays["q"]), np.asarray(arrays["scale"], dtype=np.float32)
    if dtype == "int4":
        lo = (q & 0x0F).astype(np.int8) - 8
        hi = (q >> 4).astype(np.int8) - 8
        q = np.empty((q.shape[0], q.shape[1] * 2), dtype=np.int8)
        q[:, 0::2], q[:, 1::2] = lo, hi
    n, e = q.shape
    return (q.reshape(n, e // group, group).astype(np.float32) * scale[:, :, None]).reshape(n, e)


def bytes_per_token(dtype: str, n_embd: int, group: int) -> float:
    """Stored bytes per token: hidden state + scales + token id + sample index."""
    body = {"fp16": 2 * n_embd, "int8": n_embd, "int4": n_embd // 2}[dtype]
    scales = 0 if dtype == "fp16" else 2 * (n_embd // group)
    return body + scales + 8


# -- extraction -----------------------------------------------------------------------------
@dataclass
class ExtractConfig:
    dtype: str = "int4"
    group_size: int = 32
    shard_samples: int = 100
    n_batch: int = 256  # tokens per decode, every one's hidden state read
    transform: str = "dct"  # int8/int4: channel scales + DCT before quantizing ("none": off)
    layers: tuple[int, ...] = ()  # also store these layers' inputs (EAGLE-3 features)
    kv_layers: tuple[int, ...] = ()  # also store these layers' keys and values (shared-KV heads)


def sample_hidden(engine, tokens: list[int], layers: tuple[int, ...] = (),
                  kv_layers: tuple[int, ...] = ()) -> np.ndarray:
    """The target's final hidden state at every position of `tokens`: [T, E] float32 (read
    before the LM head where the engine can: llama.cpp's logits are then never computed).
    With `layers`, each listed layer's input follows it: [T, E * (1 + len(layers))]; with
    `kv_layers`, then each listed layer's keys and values as its KV cache holds them (keys
    after the norm and RoPE), `kv_width` floats each."""
    engine.reset()
    if kv_layers:
        return engine.hidden_states(tokens, layers=tuple(layers), kv_layers=tuple(kv_layers))
    return engine.hidden_states(tokens, layers=tuple(layers))


def default_kv_layers(spec) -> tuple[int, ...]:
    """The target layers a shared-KV head reads, one per head layer (llama.cpp's rule for
    Gemma assistants): the last sliding-window layer, then the last global one; a target
    without sliding layers: its last two layers."""
    types = list(spec.layer_types)
    if "sliding" in types and "global" in types:
        last = lambda kind: max(i for i, t in enumerate(types) if t == kind)  # noqa: E731
        return (last("sliding"), last("global"))
    return (spec.n_layer - 2, spec.n_layer - 1)


def extract(target, data: str | Path, out: str | Path, cfg: ExtractConfig | None = None,
            engine=None) -> dict:
    from safetensors.numpy import save_file

    from edgespec.training.data import read_data
    from edgespec.runtime.llama_target import LlamaTarget

    cfg = cfg or ExtractConfig()
    if cfg.dtype not in DTYPES:
        raise EdgespecError(f"unknown --dtype {cfg.dtype}; choose one of {', '.join(DTYPES)}")
    if cfg.transform not in ("dct", "none"):
        raise EdgespecError(f"unknown --transform {cfg.transform}; choose dct or none")
    data_manifest, samples = read_data(data)
    max_len = max(len(s["tokens"]) for s in samples)
    engine = engine or LlamaTarget(target, n_ctx=max_len + 16, n_batch=cfg.n_batch, lm_head="full",
                                   probe=True)
    spec = engine.spec
    if data_manifest["target_fingerprint"] != spec.tokenizer_fingerprint:
        raise EdgespecError(f"{data} was made by another target (tokenizer fingerprint "
                            f"{data_manifest['target_fingerprint']} != {spec.tokenizer_fingerprint})")
    if cfg.dtype != "fp16" and spec.n_embd % cfg.group_size:
        raise EdgespecError(f"--group-size {cfg.group_size} must divide n_embd={spec.n_embd}")
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EdgespecError(f"{out}: cannot create output folder ({e.strerror})") from None
    man_path = out / "manifest.json"
    kind = "none" if cfg.dtype == "fp16" else cfg.transform
    settings = {"dtype": cfg.dtype, "group_size": cfg.group_size, "shard_samples": cfg.shard_samples,
                "layers": [int(i) for i in cfg.layers], "kv_layers": [int(i) for i in cfg.kv_layers]}
    kv_width = spec.n_head_kv * spec.head_dim
    bad = [i for i in cfg.kv_layers if not 0 <= i < spec.n_layer]
    if bad:
        raise EdgespecError(f"--kv layer {bad[0]} is not a layer of {spec.name} (0 to {spec.n_layer - 1})")
    manifest = read_json(man_path) if man_path.exists() else None
    if manifest and (manifest["target_fingerprint"] != spec.tokenizer_fingerprint
                     or {k: manifest.get(k, []) for k in settings} != settings
                     or _transform_kind(manifest) != kind):
        raise EdgespecError(f"{out} holds features made with other settings or another target; "
                            "use a new --out folder")
    manifest = manifest or {"target": spec.name, "target_fingerprint": spec.tokenizer_fingerprint,
                            "n_embd": spec.n_embd, "n_vocab": spec.n_vocab, **settings,
                            "width": spec.n_embd * (1 + len(cfg.layers)) + 2 * kv_width * len(cfg.kv_layers),
                            **({"kv_width": kv_width,
                                "kv_layer_types": [spec.layer_types[i] for i in cfg.kv_layers]}
                               if cfg.kv_layers else {}),
                            "data": str(data), "shards": [], "complete": False,
                            "transform": {"kind": kind} if kind == "none" else None}
    codec = Codec(cfg.dtype, cfg.group_size, manifest["transform"])
    manifest["shards"] = _intact_shards(out, manifest["shards"])
    start = sum(s["samples"] for s in manifest["shards"])
    t0, done_now = time.perf_counter(), 0
    bar = progress(total=sum(len(s["tokens"]) for s in samples), desc="extract", unit="tok",
                   initial=sum(len(s["tokens"]) for s in samples[:start]))
    for s0 in range(start, len(samples), cfg.shard_samples):
        chunk = samples[s0:s0 + cfg.shard_samples]
        toks, seqs, hid = [], [], []
        for s in chunk:
            hid.append(sample_hidden(engine, s["tokens"], cfg.layers, cfg.kv_layers))
            toks.extend(s["tokens"])
            seqs.extend([s["index"]] * len(s["tokens"]))
            bar.update(len(s["tokens"]))
            done_now += len(s["tokens"])
        hid = np.concatenate(hid)
        if manifest["transform"] is None:  # fixed from the first shard, before anything is stored
            manifest["transform"] = make_transform(hid)
            codec = Codec(cfg.dtype, cfg.group_size, manifest["transform"])
        arrays = codec.encode(hid)
        arrays["tokens"] = np.asarray(toks, dtype=np.int32)
        arrays["seq"] = np.asarray(seqs, dtype=np.int32)
        name = f"features-{len(manifest['shards']):05d}.safetensors"
        atomic_write(out / name, lambda tmp: save_file(arrays, tmp))
        manifest["shards"].append({"file": name, "samples": len(chunk), "tokens": len(toks),
                                   "sha256": sha256_file(out / name)})
        atomic_write_text(man_path, json.dumps(manifest, indent=1))
    bar.close()
    n_tok = sum(s["tokens"] for s in manifest["shards"])
    size = sum((out / s["file"]).stat().st_size for s in manifest["shards"])
    manifest.update(complete=True, tokens=n_tok, samples=len(samples), bytes=size,
                    bytes_per_token=round(size / max(n_tok, 1), 2),
                    tokens_per_s=round(done_now / max(time.perf_counter() - t0, 1e-9), 1)
                    if done_now else manifest.get("tokens_per_s"))
    atomic_write_text(man_path, json.dumps(manifest, indent=1))
    return manifest


def _intact_shards(out: Path, shards: list[dict]) -> list[dict]:
    """The leading shards whose files exist with their recorded checksums: extraction goes on
    (or starts again) after them, so a corrupt or missing shard is made anew."""
    for i, sh in enumerate(shards):
        f = out / sh["file"]
        if not f.is_file() or sha256_file(f) != sh["sha256"]:
            print(f"edgespec: {f} is missing or corrupt; extracting again from there", file=sys.stderr)
            return shards[:i]
    return shards


def _transform_kind(manifest: dict) -> str:
    t = manifest.get("transform")
    return t["kind"] if t else "none"


# -- reading --------------------------------------------------------------------------------
class _Samples:
    """Per sample token ids (`tokens`) and `hidden(i)`; what training and evaluation read."""

    tokens: list[np.ndarray]
    _ids: list[int]  # the data-sample index of each sample
    layers: tuple[int, ...] = ()  # layer inputs stored after the final hidden state
    kv_layers: tuple[int, ...] = ()  # layers whose keys and values follow them
    kv_width: int = 0  # floats of one layer's keys (or values) per token

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_tokens(self) -> int:
        return int(sum(len(t) for t in self.tokens))

    def sample_ids(self) -> list[int]:
        return list(self._ids)

    @property
    def width(self) -> int:
        """Floats per stored vector: the final hidden state, then any layer inputs, then any
        layers' keys and values."""
        return (self.n_embd * (1 + len(getattr(self, "layers", ())))
                + 2 * getattr(self, "kv_width", 0) * len(getattr(self, "kv_layers", ())))


def open_features(features) -> "_Samples":
    """A features folder path, an already open `Features`/`OnlineFeatures`, or a list of
    folders (one `FeatureSet`)."""
    if isinstance(features, _Samples):
        return features
    if isinstance(features, (list, tuple)):
        return Features(features[0]) if len(features) == 1 else FeatureSet(features)
    return Features(features)


def features_source(target, features: str | Path | None, data: str | Path | None,
                    online: bool = False, cache_mb: int = 1024,
                    layers: tuple[int, ...] = (), kv_layers: tuple[int, ...] = ()) -> "_Samples | str | Path":
    """What `train` reads: a features folder, or with `online` the target run over a data
    folder (`OnlineFeatures`). Exactly one of the two must be given."""
    if bool(features) == bool(online):
        raise EdgespecError("give either --features DIR or --online --data DIR")
    if not online:
        return features
    if not data:
        raise EdgespecError("--online needs --data DIR (the output of `edgespec data`)")
    return OnlineFeatures(target, data, cache_mb=cache_mb, layers=layers, kv_layers=kv_layers)


def check_manifest(path: Path, m: dict) -> None:
    """Every field a features manifest is read for, of the right type and range."""
    def bad(what: str) -> EdgespecError:
        return EdgespecError(f"{path}: invalid features manifest ({what}); extract again")

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40

    if m.get("dtype") not in DTYPES:
        raise bad(f"dtype {m.get('dtype')!r}")
    e, g = m.get("n_embd"), m.get("group_size")
    if not count(e) or not e or not count(g) or not g or (m["dtype"] != "fp16" and e % g):
        raise bad(f"n_embd {e!r}, group_size {g!r}")
    layers = m.get("layers", [])
    if not (isinstance(layers, list) and all(count(i) for i in layers)):
        raise bad(f"layers {layers!r}")
    kv = m.get("kv_layers", [])
    if not (isinstance(kv, list) and all(count(i) for i in kv)):
        raise bad(f"kv_layers {kv!r}")
    kvw = m.get("kv_width", 0) if kv else 0
    if not count(kvw) or (kv and not kvw):
        raise bad(f"kv_width {kvw!r}")
    if m.get("width", e) != e * (1 + len(layers)) + 2 * kvw * len(kv):
        raise bad(f"width {m.get('width')!r}")
    # the stored vector: final hidden state, each layer input, each KV layer's keys and values
    e = e * (1 + len(layers)) + 2 * kvw * len(kv)
    if m["dtype"] != "fp16" and e % g:
        raise bad(f"width {e} not a multiple of group_size {g}")
    if not isinstance(m.get("target_fingerprint"), str):
        raise bad("target fingerprint")
    t = m.get("transform")
    if t is not None and not (isinstance(t, dict) and t.get("kind") in ("none", "dct") and (
            t["kind"] == "none" or (isinstance(t.get("channel_scale"), list) and len(t["channel_scale"]) == e
                                    and all(isinstance(x, (int, float)) and x > 0 for x in t["channel_scale"])))):
        raise bad("transform")
    shards = m.get("shards")
    if not isinstance(shards, list) or not shards:
        raise bad("no shards")
    for sh in shards:
        if not (isinstance(sh, dict) and isinstance(sh.get("file"), str) and Path(sh["file"]).name == sh["file"]
                and sh["file"] and isinstance(sh.get("sha256"), str) and count(sh.get("samples"))
                and count(sh.get("tokens"))):
            raise bad(f"shard entry {sh!r:.60}")


class Features(_Samples):
    """A memory-mapped view of a features folder: per sample, token ids and hidden states."""

    def __init__(self, folder: str | Path, verify: bool = True):
        from safetensors import safe_open

        folder = Path(folder)
        man_path = folder / "manifest.json"
        if not man_path.exists():
            raise EdgespecError(f"{folder}: no manifest.json; run `edgespec extract` first")
        self.manifest = m = read_json(man_path)
        if not isinstance(m, dict) or m.get("complete") is not True:
            raise EdgespecError(f"{folder}: extraction is incomplete; run `edgespec extract` again "
                                "to resume")
        check_manifest(man_path, m)
        self.dtype, self.group = m["dtype"], m["group_size"]
        self.codec = Codec(self.dtype, self.group, m.get("transform"))
        self.fingerprint, self.n_embd = m["target_fingerprint"], m["n_embd"]
        self.layers = tuple(m.get("layers", []))
        self.kv_layers = tuple(m.get("kv_layers", []))
        self.kv_width = int(m.get("kv_width", 0)) if self.kv_layers else 0
        self.tokens: list[np.ndarray] = []  # per sample
        self._where: list[tuple[int, int, int]] = []  # (shard, start, end) per sample
        self._ids = []
        self._shards = []
        for i, s in enumerate(m["shards"]):
            path = folder / s["file"]
            if not path.exists():
                raise EdgespecError(f"{path}: shard missing; run `edgespec extract` again")
            if verify and sha256_file(path) != s["sha256"]:
                raise EdgespecError(f"{path}: checksum mismatch (corrupt or truncated shard); "
                                    "run `edgespec extract` again to re-create it")
            try:
                f = safe_open(str(path), framework="numpy")
                toks, seq = f.get_tensor("tokens"), f.get_tensor("seq")
            except Exception as e:
                raise EdgespecError(f"{path}: unreadable shard ({e})") from None
            self._shards.append(f)
            bounds = np.flatnonzero(np.diff(seq)) + 1
            for a, b in zip(np.r_[0, bounds], np.r_[bounds, len(seq)]):
                self.tokens.append(toks[a:b])
                self._where.append((i, int(a), int(b)))
                self._ids.append(int(seq[a]))
        if not self.tokens:
            raise EdgespecError(f"{folder}: no samples")

    def hidden(self, i: int) -> np.ndarray:
        """Hidden states of sample i: [T, E] float32 (dequantized); with layer inputs stored,
        [T, E * (1 + len(layers))] (final hidden state first)."""
        shard, a, b = self._where[i]
        f = self._shards[shard]
        return self.codec.decode({n: f.get_slice(n)[a:b] for n in self.codec.names()})


class FeatureSet(_Samples):
    """Several features folders of one target read as one: samples in folder order, each keeping
    its own data-sample index (so each folder's held-out split stays what it was). Training
    drops repeated samples and any training sample equal to a held-out one (`split_samples`)."""

    def __init__(self, folders):
        parts = [f if isinstance(f, Features) else Features(f) for f in folders]
        first = parts[0]
        for f, p in zip(folders, parts):
            if ((p.fingerprint, p.n_embd, p.layers, p.kv_layers)
                    != (first.fingerprint, first.n_embd, first.layers, first.kv_layers)):
                raise EdgespecError(f"{f}: features of another target or other layers than {folders[0]}")
        self.parts = parts
        self.fingerprint, self.n_embd, self.layers = first.fingerprint, first.n_embd, first.layers
        self.kv_layers, self.kv_width = first.kv_layers, first.kv_width
        dtypes = sorted({p.dtype for p in parts})
        self.dtype = dtypes[0] if len(dtypes) == 1 else "+".join(dtypes)
        self.manifest = first.manifest
        self.tokens, self._ids, self._where = [], [], []
        for k, p in enumerate(parts):
            self.tokens += p.tokens
            self._ids += p.sample_ids()
            self._where += [(k, i) for i in range(len(p.tokens))]

    def hidden(self, i: int) -> np.ndarray:
        k, j = self._where[i]
        return self.parts[k].hidden(j)


class FinalStateOnly(_Samples):
    """A view of features that also hold layer inputs (`extract --layers`) or keys and values
    (`extract --kv`) with the final hidden state alone, what the MTP head reads: one
    extraction feeds every kind of head."""

    def __init__(self, feats: _Samples):
        self.inner = feats
        self.fingerprint, self.n_embd, self.layers = feats.fingerprint, feats.n_embd, ()
        self.kv_layers, self.kv_width = (), 0
        self.dtype, self.manifest = feats.dtype, feats.manifest
        self.tokens, self._ids = feats.tokens, feats.sample_ids()

    def hidden(self, i: int) -> np.ndarray:
        return np.ascontiguousarray(self.inner.hidden(i)[:, :self.n_embd])


def final_state_only(feats: _Samples) -> _Samples:
    """`feats` as the MTP head reads them: unchanged with the final state alone, else
    `FinalStateOnly`."""
    return (FinalStateOnly(feats) if getattr(feats, "layers", ()) or getattr(feats, "kv_layers", ())
            else feats)


class OnlineFeatures(_Samples):
    """The `Features` interface computed on the fly: the target runs over a data sample when
    training first asks for it, and the hidden states stay in RAM only (float16, an LRU cache of
    `cache_mb`; 0 = recompute every time). Nothing is written to disk.

        edgespec train --target gemma3-270m --data runs/gemma/data --online --out runs/gemma/head
    """

    dtype = "online"

    def __init__(self, target, data: str | Path, cache_mb: int = 1024, n_batch: int = 64, engine=None,
                 layers: tuple[int, ...] = (), kv_layers: tuple[int, ...] = ()):
        from collections import OrderedDict

        from edgespec.training.data import read_data
        from edgespec.runtime.llama_target import LlamaTarget

        data_manifest, samples = read_data(data)
        max_len = max(len(s["tokens"]) for s in samples)
        self.engine = engine or LlamaTarget(target, n_ctx=max_len + 16, n_batch=n_batch,
                                            lm_head="full", probe=True)
        spec = self.engine.spec
        if data_manifest["target_fingerprint"] != spec.tokenizer_fingerprint:
            raise EdgespecError(f"{data} was made by another target (tokenizer fingerprint "
                                f"{data_manifest['target_fingerprint']} != {spec.tokenizer_fingerprint})")
        self.fingerprint, self.n_embd = spec.tokenizer_fingerprint, spec.n_embd
        self.layers = tuple(layers)
        self.kv_layers = tuple(kv_layers)
        self.kv_width = spec.n_head_kv * spec.head_dim if self.kv_layers else 0
        self.tokens = [np.asarray(s["tokens"], dtype=np.int32) for s in samples]
        self._ids = [int(s["index"]) for s in samples]
        self.manifest = {"target": spec.name, "target_fingerprint": self.fingerprint, "data": str(data),
                         "dtype": self.dtype, "cache_mb": cache_mb}
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._budget, self._used = cache_mb << 20, 0
        self.target_tokens = 0  # tokens the target ran so far (cache misses)
        self.target_seconds = 0.0

    def hidden(self, i: int) -> np.ndarray:
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i].astype(np.float32)
        t0 = time.perf_counter()
        h = sample_hidden(self.engine, [int(x) for x in self.tokens[i]], self.layers, self.kv_layers)
        self.target_seconds += time.perf_counter() - t0
        self.target_tokens += len(h)
        if h.nbytes // 2 <= self._budget:
            self._cache[i] = h.astype(np.float16)
            self._used += h.nbytes // 2
            while self._used > self._budget:
                _, old = self._cache.popitem(last=False)
                self._used -= old.nbytes
        return h


def requantize(src: str | Path, out: str | Path, dtype: str, group_size: int = 32,
               transform: str = "dct") -> dict:
    """Write a copy of a features folder in another storage type (e.g. fp16 -> int8), shard by
    shard, without running the target again. Used by the storage ablation."""
    from safetensors.numpy import save_file

    if dtype not in DTYPES:
        raise EdgespecError(f"unknown dtype {dtype}; choose one of {', '.join(DTYPES)}")
    feats = Features(src)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    m = dict(feats.manifest, dtype=dtype, group_size=group_size, shards=[],
             requantized_from=f"{src} ({feats.dtype})")
    codec = None
    for i, s in enumerate(feats.manifest["shards"]):
        f = feats._shards[i]
        hidden = feats.codec.decode({n: f.get_tensor(n) for n in feats.codec.names()})
        if codec is None:
            m["transform"] = {"kind": "none"} if dtype == "fp16" or transform == "none" else make_transform(hidden)
            codec = Codec(dtype, group_size, m["transform"])
        arrays = codec.encode(hidden)
        arrays["tokens"], arrays["seq"] = f.get_tensor("tokens"), f.get_tensor("seq")
        atomic_write(out / s["file"], lambda tmp: save_file(arrays, tmp))
        m["shards"].append(dict(s, sha256=sha256_file(out / s["file"])))
    size = sum((out / s["file"]).stat().st_size for s in m["shards"])
    m.update(bytes=size, bytes_per_token=round(size / max(m["tokens"], 1), 2))
    atomic_write_text(out / "manifest.json", json.dumps(m, indent=1))
    return m
