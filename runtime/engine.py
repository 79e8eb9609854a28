"""The target engine's interface: what the decode loop asks of LlamaTarget, OrtTarget, a batch
slot (runtime/batching.py) or the tests' mock. Capabilities some engines lack have defaults
here, so the loop calls them instead of probing for them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgespec.errors import EdgespecError

if TYPE_CHECKING:
    from edgespec.runtime.lowrank import LowRankInfo
    from edgespec.targets import TargetSpec


class Engine:
    """A tokenizer, a KV cache that holds `tokens` at positions 0.., batched decodes and exact
    rollback. Subclasses implement the methods that raise NotImplementedError."""

    spec: TargetSpec  # the target's shape and tokenizer, from its GGUF file
    tokens: list[int]  # tokens whose K/V sit in the cache
    n_ctx: int
    n_threads: int
    engine: str  # "llama.cpp", "onnxruntime"
    version: str  # the engine's version (stored measurements are keyed by it)
    model_file: Path  # the file whose content keys measurements cached for this engine
    draft_k: int = 4  # default for the most tokens drafted per step, greedy decoding
    draft_k_sampled: int = 4  # the same for sampling (its rows need every logit)
    lowrank: LowRankInfo | None = None  # the low-rank LM head greedy verification uses, if any
    lowrank_head = None  # its scorer, on engines that run it next to llama.cpp
    batched_head = None  # the LM head every row goes through, on llama.cpp engines that have one
    n_seq: int = 1  # sequences the cache holds (batch slots decode them together)
    # prefill(..., last_logits=True) decodes the prompt as llama_cpp.Llama does, its last row's
    # logits returned (a sampled request then draws its first token from them, as it would)
    prefill_logits: bool = False

    # -- required -------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        raise NotImplementedError

    def token_bytes(self, token: int) -> bytes:
        raise NotImplementedError

    def is_eog(self, token: int) -> bool:
        raise NotImplementedError

    def prefill(self, tokens: list[int], last_logits: bool = False) -> np.ndarray | None:
        """The tokens into the cache; with `last_logits` the last one's logits [V]."""
        raise NotImplementedError

    def hidden_states(self, tokens: list[int]) -> np.ndarray:
        """Decode tokens into the cache; their final hidden states [n, E]."""
        raise NotImplementedError

    def prefill_hidden(self, tokens: list[int], n_last: int) -> np.ndarray:
        """Decode tokens into the cache; the hidden states of the last n_last (as
        `hidden_states` gives them). Engines that can read them from the prompt's own batches
        do (llama.cpp); this default decodes the rest first, then those."""
        n_last = min(n_last, len(tokens))
        self.prefill(tokens[:len(tokens) - n_last])
        return self.hidden_states(tokens[len(tokens) - n_last:])

    def decode(self, tokens: list[int], hidden: bool = False, all_logits: bool = True,
               copy: bool = True, top_only: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """One batched pass: logits per row (only their top tokens exact where `top_only` and a
        low-rank LM head answers), hidden states per row where asked."""
        raise NotImplementedError

    def truncate(self, n: int) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def describe_lm_head(self, greedy: bool = True) -> str:
        return self.spec.lm_head_type

    # -- optional capabilities, with what an engine without them does ---------------------------
    def hidden_free(self, top_only: bool) -> bool:
        """Whether a decode computes the hidden states anyway (reading them costs nothing)."""
        return False

    def set_feature_layers(self, layers: tuple[int, ...] = ()) -> None:
        """Hidden-state reads also carry these layers' inputs (EAGLE-3 heads)."""
        if tuple(layers):
            raise EdgespecError("this engine cannot read the layer inputs an EAGLE-3 head needs; "
                                "run it on a llama.cpp target")

    def can_hand_kv(self) -> bool:
        """Whether `set_kv_layers` works here: a shared-KV head can draft on this engine."""
        return False

    def set_kv_layers(self, layers: tuple[int, ...] = ()) -> None:
        """Hidden-state reads also carry these layers' keys and values (shared-KV heads)."""
        if tuple(layers):
            raise EdgespecError("this engine cannot hand its keys and values to a shared-KV head; "
                                "run it on a llama.cpp target")

    def invariant_batch(self) -> int:
        """The most tokens one decode may hold and keep one-token numbers (0: not known)."""
        return 0

    def cost_policy(self, k: int, greedy: bool):
        """A draft policy of the engine's own (a batch slot's), or None for the usual one."""
        return None

    def native_sampler(self, sampling, seed: int):
        """The engine's own sampler chain for a request, drawing `pick(row)` from row `row` of
        the last decode with `seed`'s stream, or None (the rows are then sampled in numpy)."""
        return None

    def token_nl(self) -> int:
        return self.tokenize("\n", add_bos=False, special=False)[-1]

    def metadata(self) -> dict[str, str]:
        return {}
