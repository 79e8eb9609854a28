"""Exporters: draft heads to GGUF and ONNX, and verify-friendly target files."""

from edgespec.errors import EdgespecError


def require_mtp_head(head_config: dict, ckpt, kind: str) -> None:
    """`export gguf` and `export onnx` write edgespec's own MTP head: an EAGLE-3 checkpoint is a
    clear error that names the exports it has."""
    from edgespec.runtime.formats import head_arch

    if head_arch(head_config) == "eagle3":
        raise EdgespecError(f"{ckpt} is an EAGLE-3 head; `export {kind}` writes edgespec's MTP head: "
                            "export it with `edgespec export llama-cpp` or `edgespec export speculators`")
