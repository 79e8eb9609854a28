"""Grammar-constrained decoding with llama.cpp's own grammar sampler (GBNF), through the binding.

The decode loop asks three things of a grammar: may this token come next (`allows`), the logits
with every token it may not take set to -inf (`mask`), and advance by an emitted token
(`accept`). Drafts are checked on a copy (`clone`) and cut where they leave the grammar, so
verification only ever checks tokens the grammar allows; each verified row is constrained by the
state after the tokens before it, so the output is that of constrained decoding without drafts.
"""

from __future__ import annotations

import ctypes
import json

import numpy as np

from edgespec.errors import EdgespecError

TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)


class Grammar:
    def __init__(self, vocab, n_vocab: int, text: str, root: str = "root", _sampler=None):
        from llama_cpp import llama_cpp as lc

        self._lc, self.vocab, self.n_vocab, self.text, self.root = lc, vocab, n_vocab, text, root
        self._smpl = _sampler or lc.llama_sampler_init_grammar(vocab, text.encode(), root.encode())
        if not self._smpl:
            raise EdgespecError("the grammar does not parse (llama.cpp rejected it)")
        self._full = np.zeros(n_vocab, TOKEN_DATA)
        self._full["id"] = np.arange(n_vocab, dtype=np.int32)

    @classmethod
    def for_engine(cls, engine, grammar=None, response_format: dict | None = None) -> Grammar | None:
        """From llama-cpp-python's `LlamaGrammar` (or GBNF text) or an OpenAI `response_format`
        (json_object: any JSON object; json_schema: that schema), as llama-cpp-python builds them."""
        if grammar is None and not response_format:
            return None
        if not hasattr(engine, "_vocab"):
            raise EdgespecError(f"grammars need a llama.cpp vocabulary; {engine.spec.name} has none")
        if grammar is not None:
            text = grammar if isinstance(grammar, str) else getattr(grammar, "_grammar", None)
            root = getattr(grammar, "_root", "root") if not isinstance(grammar, str) else "root"
            if not isinstance(text, str):
                raise EdgespecError("grammar must be GBNF text or a llama_cpp.LlamaGrammar")
            return cls(engine._vocab, engine.n_vocab, text, root)
        from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

        kind = response_format.get("type")
        if kind == "json_object":
            schema = response_format.get("schema")
            text = json_schema_to_gbnf(json.dumps(schema)) if schema else JSON_GBNF
        elif kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            schema = spec.get("schema", spec)
            try:
                text = json_schema_to_gbnf(json.dumps(schema))
            except Exception as e:
                raise EdgespecError(f"response_format: the JSON schema cannot be turned into a "
                                    f"grammar ({e})") from None
        else:
            raise EdgespecError(f"response_format type {kind!r}: choose text, json_object or json_schema")
        return cls(engine._vocab, engine.n_vocab, text)

    def _apply(self, data: np.ndarray) -> None:
        lc = self._lc
        arr = lc.llama_token_data_array(
            ctypes.cast(data.ctypes.data, ctypes.POINTER(lc.llama_token_data)), len(data), -1, False)
        lc.llama_sampler_apply(self._smpl, ctypes.byref(arr))
        if arr.size != len(data):  # the grammar sampler masks in place; anything else is a surprise
            raise EdgespecError("llama.cpp's grammar sampler changed the candidate list's size")

    def allows(self, tokens) -> np.ndarray:
        """Per token, whether the grammar lets it come next."""
        data = np.zeros(len(tokens), TOKEN_DATA)
        data["id"] = tokens
        self._apply(data)
        return np.isfinite(data["logit"])

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits` [V] with the tokens the grammar forbids next at -inf (a copy, float64)."""
        self._full["logit"] = 0.0
        self._apply(self._full)
        out = np.asarray(logits, np.float64).copy()
        out[~np.isfinite(self._full["logit"])] = -np.inf
        return out

    def accept(self, token: int) -> None:
        self._lc.llama_sampler_accept(self._smpl, token)

    def clone(self) -> Grammar:
        return Grammar(self.vocab, self.n_vocab, self.text, self.root,
                       _sampler=self._lc.llama_sampler_clone(self._smpl))

    def close(self) -> None:
        if getattr(self, "_smpl", None):
            self._lc.llama_sampler_free(self._smpl)
            self._smpl = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
