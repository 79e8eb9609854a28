"""A drop-in for apps built on llama-cpp-python: swap `Llama` for `SpeculativeLlama`.

    from edgespec.runtime.api import SpeculativeLlama as Llama
    llm = Llama(model_path="model.gguf", n_ctx=2048, draft="default")
    llm.create_completion("def fib(n):", max_tokens=64, temperature=0)
    llm.create_chat_completion(messages=[{"role": "user", "content": "Hi"}], stream=True)

Same arguments (unsupported ones are accepted and ignored) and the same OpenAI-style return
dicts and streaming chunks as `llama_cpp.Llama`, plus a `speculative` entry with the decode
statistics. Defaults follow llama-cpp-python's.
"""

from __future__ import annotations

import time
import uuid
from typing import Iterator

from edgespec.runtime.chat import render_chat
from edgespec.runtime.decoding import Generation
from edgespec.runtime.drafters import make_drafter
from edgespec.runtime.generate import open_target
from edgespec.runtime.policies import make_policy
from edgespec.runtime.sampling import SamplingParams


class SpeculativeLlama:
    def __init__(self, model_path: str, n_ctx: int = 512, n_threads: int | None = None,
                 n_batch: int = 512, seed: int | None = None, draft: str | None = "default",
                 k: int | None = None, policy: str = "cost", verbose: bool = False,
                 lm_head: str = "auto", **_ignored):
        self.model_path = model_path
        self.engine = open_target(model_path, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch,
                                  lm_head=lm_head)
        self.drafter = make_drafter(draft, self.engine.spec)
        self.k, self.policy, self.seed = k, policy, seed
        self.last_stats: dict = {}

    # -- llama_cpp.Llama's public surface used by apps -----------------------------------------
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self.engine.tokenize(text.decode("utf-8", errors="replace"), add_bos, special)

    def detokenize(self, tokens: list[int]) -> bytes:
        return b"".join(self.engine.token_bytes(t) for t in tokens)

    def n_ctx(self) -> int:
        return self.engine.n_ctx

    def __call__(self, prompt: str, **kw):
        return self.create_completion(prompt, **kw)

    def _run(self, ids: list[int], max_tokens: int | None, temperature: float, top_p: float,
             top_k: int, stop, seed) -> Generation:
        if max_tokens is None or max_tokens <= 0:  # llama-cpp-python: until the context is full
            max_tokens = self.engine.n_ctx - len(ids)
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        sp = SamplingParams(temperature=max(0.0, float(temperature)), top_k=max(0, int(top_k)),
                            top_p=float(top_p) if 0 < top_p <= 1 else 1.0,
                            seed=self.seed if seed is None else seed)
        policy = make_policy(self.policy, self.k if self.drafter else 0, self.engine, greedy=sp.greedy)
        return Generation(self.engine, ids, sp, max_tokens=max_tokens, drafter=self.drafter,
                          policy=policy, stop=stop)

    def _stats(self, gen: Generation) -> dict:
        self.last_stats = gen.stats.to_dict()
        return self.last_stats

    @staticmethod
    def _finish(gen: Generation) -> str:
        return "length" if gen.stats.finish_reason in ("length", "context") else "stop"

    def create_completion(self, prompt: str, suffix: str | None = None, max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, top_k: int = 40,
                          stop=None, stream: bool = False, seed: int | None = None,
                          echo: bool = False, **_ignored):
        ids = self.engine.tokenize(prompt)
        gen = self._run(ids, max_tokens, temperature, top_p, top_k, stop, seed)
        cid, created = f"cmpl-{uuid.uuid4()}", int(time.time())
        if stream:
            return self._stream_completion(gen, cid, created, prompt if echo else "")
        for _ in gen:
            pass
        text = (prompt if echo else "") + gen.text
        return {"id": cid, "object": "text_completion", "created": created, "model": self.model_path,
                "choices": [{"text": text, "index": 0, "logprobs": None,
                             "finish_reason": self._finish(gen)}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": gen.stats.tokens,
                          "total_tokens": len(ids) + gen.stats.tokens},
                "speculative": self._stats(gen)}

    def _stream_completion(self, gen, cid, created, echo_text) -> Iterator[dict]:
        def chunk(text, finish):
            return {"id": cid, "object": "text_completion", "created": created, "model": self.model_path,
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}

        if echo_text:
            yield chunk(echo_text, None)
        for _, piece in gen:
            if piece:
                yield chunk(piece, None)
        final = chunk("", self._finish(gen))
        final["speculative"] = self._stats(gen)
        yield final

    def create_chat_completion(self, messages: list[dict], temperature: float = 0.2,
                               top_p: float = 0.95, top_k: int = 40, stream: bool = False,
                               stop=None, seed: int | None = None, max_tokens: int | None = None,
                               **_ignored):
        prompt = render_chat(self.engine.spec, messages)
        if not self.engine.spec.chat_template:
            stop = list(stop or []) + ["\nUser:"] if not isinstance(stop, str) else [stop, "\nUser:"]
        ids = self.engine.tokenize(prompt)
        gen = self._run(ids, max_tokens, temperature, top_p, top_k, stop, seed)
        cid, created = f"chatcmpl-{uuid.uuid4()}", int(time.time())
        if stream:
            return self._stream_chat(gen, cid, created)
        for _ in gen:
            pass
        return {"id": cid, "object": "chat.completion", "created": created, "model": self.model_path,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text},
                             "logprobs": None, "finish_reason": self._finish(gen)}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": gen.stats.tokens,
                          "total_tokens": len(ids) + gen.stats.tokens},
                "speculative": self._stats(gen)}

    def _stream_chat(self, gen, cid, created) -> Iterator[dict]:
        def chunk(delta, finish):
            return {"id": cid, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_path,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        yield chunk({"role": "assistant"}, None)
        for _, piece in gen:
            if piece:
                yield chunk({"content": piece}, None)
        final = chunk({}, self._finish(gen))
        final["speculative"] = self._stats(gen)
        yield final
