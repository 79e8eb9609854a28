"""Exporters: draft heads to GGUF and ONNX, and verify-friendly target files."""
