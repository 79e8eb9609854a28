"""What ships with edgespec under runtime/heads/<target>/: draft heads and low-rank LM head
bases, found by the target's tokenizer fingerprint (never by folder name)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.runtime.formats import BASIS_NAME, GGUF_FINGERPRINT, GGUF_SHARED_KV_ARCH, gguf_architecture

HEADS_DIR = Path(__file__).resolve().parent / "heads"


def head_fingerprint(path: Path) -> str | None:
    """The target fingerprint stored in a head file (GGUF or ONNX), None if it has none."""
    from edgespec.gguf_meta import read_header

    try:
        if path.suffix == ".gguf":
            return read_header(path).metadata.get(GGUF_FINGERPRINT)
        if path.suffix == ".onnx":
            from edgespec.runtime.heads import onnx_head_file

            return onnx_head_file(path).fingerprint
    except EdgespecError:
        return None
    return None


def file_reads_kv(path: Path) -> bool:
    """Whether a head file (GGUF or ONNX) is a shared-KV head's: one that reads the target's
    keys and values, which only some engines can hand it (`Engine.can_hand_kv`)."""
    if path.suffix == ".gguf":
        return gguf_architecture(path) == GGUF_SHARED_KV_ARCH
    if path.suffix == ".onnx":
        from edgespec.runtime.heads import onnx_head_arch

        return onnx_head_arch(path) == "shared-kv"
    return False


def default_head(spec, kv: bool = True) -> Path:
    """The head shipped for this target: a file under runtime/heads/*/ whose fingerprint
    matches. A shared-KV head first where `kv` (the engine can hand it the target's keys and
    values: llama.cpp, one sequence), otherwise a head that reads hidden states alone; of each,
    the ONNX export first (its int8 draft step is the fastest measured), else GGUF."""
    found = []
    if HEADS_DIR.is_dir():
        for d in sorted(HEADS_DIR.iterdir()):
            for f in sorted(d.glob("*.onnx")) + sorted(d.glob("*.gguf")):
                if head_fingerprint(f) == spec.tokenizer_fingerprint:
                    found.append((not file_reads_kv(f), f))
            if found:  # one target's heads share a folder: the others need not be opened
                break
    usable = [(rank, f) for rank, f in found if kv or rank]  # rank False: a shared-KV head
    if usable:
        return min(usable, key=lambda x: x[0])[1]  # stable: ONNX before GGUF within a kind
    if found:
        raise EdgespecError(f"the head shipped for target {spec.name} reads the target's keys and "
                            "values, which this engine cannot hand it; run the target on llama.cpp")
    raise EdgespecError(f"no default head ships for target {spec.name}; train one with "
                        "`edgespec train` and pass its folder to --draft")


def shipped_basis(spec) -> Path | None:
    """The low-rank LM head basis shipped for this target, if any."""
    if HEADS_DIR.is_dir():
        for f in sorted(HEADS_DIR.glob(f"*/{BASIS_NAME}")):
            try:
                with np.load(f) as z:
                    if str(z["target_fingerprint"]) == spec.tokenizer_fingerprint:
                        return f
            except Exception:  # not a basis file: not the one
                continue
    return None
