"""The target in torch, through transformers' GGUF loader: the same weights llama.cpp runs.

Used for training and ONNX export (extra `edgespec[train]`); the runtime never imports this.
"""

from __future__ import annotations

from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.targets import resolve_target


def load_torch_target(target: str | Path, dtype: str = "float32"):
    """Load a GGUF target as a transformers causal LM (weights dequantized to `dtype`)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise EdgespecError("the torch target needs the train extra; "
                            "run: pip install 'edgespec[train]'") from None
    path = resolve_target(target)
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=getattr(torch, dtype))
    model.eval()
    return model


def forward_hidden(model, input_ids):
    """Final hidden states (after the output norm) and logits for a [B, T] batch of token ids."""
    import torch

    with torch.no_grad():
        out = model.model(input_ids=input_ids)
        hidden = out.last_hidden_state
        return model.lm_head(hidden), hidden
