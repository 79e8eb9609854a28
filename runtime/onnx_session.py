"""onnxruntime sessions for edgespec's ONNX files (heads and targets): CPU, sequential, quiet."""

from __future__ import annotations

from pathlib import Path

from edgespec.errors import EdgespecError


def open_session(path: str | Path, threads: int, spin: bool = True):
    """spin=False: worker threads sleep between runs instead of spinning, for sessions that take
    turns with another engine's threads (llama.cpp) on the same cores."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise EdgespecError(f"{path}: not a loadable ONNX model ({str(e).splitlines()[0]})") from None
