"""What ships with edgespec under runtime/heads/<target>/: draft heads and low-rank LM head
bases, found by the target's tokenizer fingerprint (never by folder name)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.runtime.formats import BASIS_NAME, GGUF_FINGERPRINT

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


def default_head(spec) -> Path:
    """The head shipped for this target: a file under runtime/heads/*/ whose fingerprint
    matches; the ONNX export first (its int8 draft step is the fastest measured), else GGUF."""
    if HEADS_DIR.is_dir():
        for d in sorted(HEADS_DIR.iterdir()):
            for f in sorted(d.glob("*.onnx")) + sorted(d.glob("*.gguf")):
                if head_fingerprint(f) == spec.tokenizer_fingerprint:
                    return f
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
