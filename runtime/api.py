"""A drop-in for apps built on llama-cpp-python: swap `Llama` for `SpeculativeLlama`.

    from edgespec.runtime.api import SpeculativeLlama as Llama
    llm = Llama(model_path="model.gguf", n_ctx=2048, draft="default")
    llm.create_completion("def fib(n):", max_tokens=64, temperature=0)
    llm.create_chat_completion(messages=[{"role": "user", "content": "Hi"}], stream=True)

The same arguments, defaults and sampling chain (min-p, typical, penalties, logit bias, in
llama.cpp's order; GBNF grammars and JSON mode through llama.cpp's grammar sampler, drafts cut
where they leave the grammar), and the same OpenAI-style return dicts and streaming chunks as
`llama_cpp.Llama`, plus a `speculative` entry with the decode statistics; tool calls, logprobs
(streamed too), logits processors and stopping criteria as llama-cpp-python applies them.
Options not implemented (mirostat, suffix, logprobs with echo) and methods not provided
(embeddings, eval/sample, states) raise NotImplementedError naming them. Successive calls keep the cache's common prefix with the new
prompt (a chat's next turn decodes only the new tokens); streamed text holds back what could
still become a stop string, so it always joins to the non-streamed text.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import deque
from typing import Iterator

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.runtime.chat import render_chat
from edgespec.runtime.decoding import Generation, common_prefix
from edgespec.runtime.drafters import drafter_for
from edgespec.runtime.generate import open_target
from edgespec.runtime.grammar import Grammar
from edgespec.runtime.engine import Engine
from edgespec.runtime.sampling import SamplingParams, log_softmax
from edgespec.runtime.spec import SpecConfig

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's "random seed" value


class SpeculativeLlama:
    def __init__(self, model_path, n_ctx: int = 512, n_threads: int | None = None,
                 n_batch: int = 512, seed: int | None = None, draft: str | None = "default",
                 k: int | None = None, policy: str = "cost", verbose: bool = False,
                 lm_head: str = "auto", last_n_tokens_size: int = 64, flash_attn: bool | None = False,
                 **_placement):
        """model_path: a GGUF file, a known target name, an ONNX target folder, or an open
        engine. `_placement`: llama_cpp.Llama's loading options (n_gpu_layers, use_mmap, ...)
        are accepted; edgespec runs the model on the CPU with its own settings. `flash_attn`
        as llama_cpp.Llama (off by default): the same attention gives the same numbers; None
        lets llama.cpp choose (the server's setting)."""
        self.spec = SpecConfig(draft=draft, k=k, policy=policy, lm_head=lm_head)
        self.engine = model_path if isinstance(model_path, Engine) else open_target(
            model_path, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch, lm_head=lm_head,
            flash_attn=flash_attn, draft=draft)
        self.model_path = str(self.engine.model_file if self.engine is model_path else model_path)
        self.drafter = drafter_for(draft, self.engine)
        self.seed = seed or LLAMA_DEFAULT_SEED  # as llama_cpp.Llama keeps it (0 too)
        self.last_n_tokens_size = last_n_tokens_size
        self.verbose = verbose
        self.last_stats: dict = {}
        self.last_drafted_at: list[int] = []  # per draft position, in the last generation
        self.last_accepted_at: list[int] = []

    # -- llama_cpp.Llama's public surface used by apps -----------------------------------------
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self.engine.tokenize(text.decode("utf-8", errors="replace"), add_bos, special)

    def detokenize(self, tokens: list[int], prev_tokens=None, special: bool = False) -> bytes:
        return b"".join(self.engine.token_bytes(t) for t in tokens)

    def n_ctx(self) -> int:
        return self.engine.n_ctx

    def n_vocab(self) -> int:
        return self.engine.spec.n_vocab

    def n_embd(self) -> int:
        return self.engine.spec.n_embd

    def token_bos(self) -> int:
        return -1 if self.engine.spec.bos_id is None else self.engine.spec.bos_id

    def token_eos(self) -> int:
        return -1 if self.engine.spec.eos_id is None else self.engine.spec.eos_id

    def set_seed(self, seed: int) -> None:
        self.seed = seed

    def token_nl(self) -> int:
        return self.engine.token_nl()

    @property
    def metadata(self) -> dict[str, str]:
        """The model file's metadata, key -> value as text (llama.cpp's reading)."""
        return self.engine.metadata()

    @property
    def n_tokens(self) -> int:
        """Tokens in the cache (the last call's prompt and reply)."""
        return len(self.engine.tokens)

    @property
    def input_ids(self) -> np.ndarray:
        return np.asarray(self.engine.tokens, dtype=np.intc)

    @property
    def eval_tokens(self) -> deque:
        return deque(self.engine.tokens, maxlen=self.engine.n_ctx)

    def tokenizer(self) -> "_Tokenizer":
        return _Tokenizer(self)

    @staticmethod
    def longest_token_prefix(a, b) -> int:
        return common_prefix(list(a), list(b))

    @staticmethod
    def logits_to_logprobs(logits, axis: int = -1) -> np.ndarray:
        return log_softmax(logits, axis, dtype=np.float32)

    def generate(self, tokens, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0,
                 reset: bool = True, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_tau: float = 5.0,
                 mirostat_eta: float = 0.1, penalize_nl: bool = True, logits_processor=None,
                 stopping_criteria=None, grammar=None) -> Iterator[int]:
        """Token ids after `tokens`, speculatively decoded, until the end of generation or of
        the context (llama_cpp.Llama.generate's arguments; sending tokens into the generator
        is not supported)."""
        _refuse(mirostat_mode=mirostat_mode or None)
        gen = self._run(list(tokens), None, None, None, None, Grammar.for_engine(self.engine, grammar),
                        logits_processor, stopping_criteria, **_sampling(
                            temp, top_k, top_p, min_p, typical_p, repeat_penalty,
                            frequency_penalty, presence_penalty, None))
        for tok, _ in gen:
            if (yield tok) is not None:
                raise NotImplementedError("SpeculativeLlama.generate does not take tokens sent "
                                          "into it; start a new generate call with them")

    def create_chat_completion_openai_v1(self, *args, **kwargs):
        """create_chat_completion's result as the openai package's types."""
        from openai.types.chat import ChatCompletion, ChatCompletionChunk

        out = self.create_chat_completion(*args, **kwargs)
        if kwargs.get("stream", False):
            return (ChatCompletionChunk(**c) for c in out)
        return ChatCompletion(**out)

    def reset(self) -> None:
        """Forget the cached prompt (the next call prefills from scratch)."""
        self.engine.reset()

    def close(self) -> None:
        self.engine.close()

    def __call__(self, prompt: str, **kw):
        return self.create_completion(prompt, **kw)

    def _run(self, ids: list[int], max_tokens: int | None, stop, seed, logprobs: int | None = None,
             grammar=None, logits_processor=None, stopping_criteria=None, **sampling) -> Generation:
        if max_tokens is None or max_tokens <= 0:  # llama-cpp-python: until the context is full
            max_tokens = self.engine.n_ctx - len(ids)
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        if logits_processor is not None and not isinstance(logits_processor, (list, tuple)):
            logits_processor = [logits_processor]
        if seed is None:  # llama-cpp-python: each call's seed is drawn from the last one's
            seed = random.Random(self.seed).randint(0, 2 ** 32)
        self.seed = seed
        sp = SamplingParams(seed=seed,
                            penalty_last_n=self.last_n_tokens_size,
                            logits_processor=list(logits_processor) if logits_processor else None,
                            **sampling)
        policy = self.spec.make_policy(self.engine, sp.greedy, drafting=self.drafter is not None)
        return Generation(self.engine, ids, sp, max_tokens=max_tokens, drafter=self.drafter,
                          policy=policy, stop=stop, logprobs=logprobs, grammar=grammar,
                          stopping=_criteria(stopping_criteria))

    def _token_logprobs(self, gen: Generation, start: int = 0,
                        end: int | None = None) -> list[tuple[str, float, list[tuple[str, float]]]]:
        """(token text, logprob, [(top token text, logprob), ...]) per emitted token (those from
        `start` to `end`), end of generation tokens left out, as llama-cpp-python reports them."""
        def text(t: int) -> str:
            return self.engine.token_bytes(t).decode("utf-8", errors="ignore")

        out = []
        for tok, (lp, top) in zip(gen.token_ids[start:end], gen.logprobs[start:end]):
            if not self.engine.is_eog(tok):
                out.append((text(tok), lp, [(text(t), v) for t, v in top]))
        return out

    @staticmethod
    def _completion_logprobs(rows, at: int) -> dict:
        """llama-cpp-python's completion logprobs for these rows, text offsets from `at`."""
        offsets = []
        for tok_text, _, _ in rows:
            offsets.append(at)
            at += len(tok_text)
        return {"tokens": [r[0] for r in rows], "text_offset": offsets,
                "token_logprobs": [r[1] for r in rows],
                "top_logprobs": [{**dict(r[2]), r[0]: r[1]} for r in rows]}

    @staticmethod
    def _chat_logprobs(rows) -> dict:
        return {"content": [{"token": t, "logprob": lp, "bytes": None,
                             "top_logprobs": [{"token": u, "logprob": v, "bytes": None}
                                              for u, v in top]}
                            for t, lp, top in rows], "refusal": None}

    def _pieces(self, gen: Generation, with_logprobs: bool):
        """(text piece, logprob rows of the tokens emitted since the last piece) as the
        generation streams; a last ("", rest) carries tokens whose text never showed."""
        done = 0
        for _, piece in gen:
            if piece:
                n = len(gen.token_ids)
                yield piece, self._token_logprobs(gen, done, n) if with_logprobs else None
                done = n
        if with_logprobs and done < len(gen.token_ids):
            rest = self._token_logprobs(gen, done)
            if rest:
                yield "", rest

    def _stats(self, gen: Generation) -> dict:
        self.last_stats = gen.stats.to_dict()
        self.last_drafted_at, self.last_accepted_at = gen.stats.drafted_at, gen.stats.accepted_at
        return self.last_stats

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        """The prompt `create_chat_completion` would decode for `messages`."""
        return self.engine.tokenize(render_chat(self.engine.spec, messages))

    @staticmethod
    def _finish(gen: Generation) -> str:
        return "length" if gen.stats.finish_reason in ("length", "context") else "stop"

    def create_completion(self, prompt: str | list[int], suffix: str | None = None,
                          max_tokens: int | None = 16, temperature: float = 0.8,
                          top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
                          logprobs: int | None = None, echo: bool = False, stop=None,
                          frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                          repeat_penalty: float = 1.0, top_k: int = 40, stream: bool = False,
                          seed: int | None = None, tfs_z: float = 1.0, mirostat_mode: int = 0,
                          mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                          model: str | None = None, stopping_criteria=None,
                          logits_processor=None, grammar=None, logit_bias: dict | None = None):
        _refuse(suffix=suffix, mirostat_mode=mirostat_mode or None,
                **{"logprobs with echo": logprobs is not None and echo or None})
        ids = list(prompt) if isinstance(prompt, list) else self.engine.tokenize(prompt)
        text_in = prompt if isinstance(prompt, str) else self.detokenize(ids).decode("utf-8", "replace")
        gen = self._run(ids, max_tokens, stop, seed, logprobs,
                        Grammar.for_engine(self.engine, grammar), logits_processor,
                        stopping_criteria, **_sampling(
            temperature, top_k, top_p, min_p, typical_p, repeat_penalty, frequency_penalty,
            presence_penalty, logit_bias))
        cid, created = f"cmpl-{uuid.uuid4()}", int(time.time())
        if stream:
            return self._stream_completion(gen, cid, created, text_in if echo else "",
                                           len(text_in) if logprobs is not None else None)
        for _ in gen:
            pass
        text = (text_in if echo else "") + gen.text
        lps = None
        if logprobs is not None:
            lps = self._completion_logprobs(self._token_logprobs(gen), len(text_in))
        return {"id": cid, "object": "text_completion", "created": created, "model": self.model_path,
                "choices": [{"text": text, "index": 0, "logprobs": lps,
                             "finish_reason": self._finish(gen)}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": gen.stats.tokens,
                          "total_tokens": len(ids) + gen.stats.tokens},
                "speculative": self._stats(gen)}

    def _stream_completion(self, gen, cid, created, echo_text, logprobs_at: int | None) -> Iterator[dict]:
        """Chunks as llama-cpp-python streams them; with logprobs (`logprobs_at`: the prompt
        text's length, where offsets start) each chunk carries its tokens'."""
        def chunk(text, finish, lps=None):
            return {"id": cid, "object": "text_completion", "created": created, "model": self.model_path,
                    "choices": [{"text": text, "index": 0, "logprobs": lps, "finish_reason": finish}]}

        if echo_text:
            yield chunk(echo_text, None)
        at = logprobs_at
        for piece, rows in self._pieces(gen, logprobs_at is not None):
            lps = None
            if rows is not None:
                lps = self._completion_logprobs(rows, at)
                at += sum(len(r[0]) for r in rows)
            yield chunk(piece, None, lps)
        final = chunk("", self._finish(gen))
        final["speculative"] = self._stats(gen)
        yield final

    def create_chat_completion(self, messages: list[dict], functions=None, function_call=None,
                               tools=None, tool_choice=None, temperature: float = 0.2,
                               top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                               typical_p: float = 1.0, stream: bool = False, stop=None,
                               seed: int | None = None, response_format=None,
                               max_tokens: int | None = None, presence_penalty: float = 0.0,
                               frequency_penalty: float = 0.0, repeat_penalty: float = 1.0,
                               tfs_z: float = 1.0, mirostat_mode: int = 0,
                               mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                               model: str | None = None, logits_processor=None, grammar=None,
                               logit_bias: dict | None = None, logprobs: bool | None = None,
                               top_logprobs: int | None = None):
        _refuse(mirostat_mode=mirostat_mode or None)
        if response_format is not None and not isinstance(response_format, dict):
            raise EdgespecError("response_format must be an object such as {\"type\": \"json_object\"}")
        tools, tool_choice = _tools(functions, function_call, tools, tool_choice)
        tool = _chosen_tool(tools, tool_choice)
        if tool is not None:  # as llama-cpp-python: the arguments follow the tool's schema
            params = tool["function"].get("parameters")
            try:
                constrain = Grammar.for_engine(self.engine, None, {"type": "json_object", "schema": params}
                                               if params else {"type": "json_object"})
            except EdgespecError:  # a schema the converter cannot take: any JSON object
                constrain = Grammar.for_engine(self.engine, None, {"type": "json_object"})
        else:
            constrain = Grammar.for_engine(
                self.engine, grammar,
                None if not response_format or response_format.get("type") == "text" else response_format)
        prompt = render_chat(self.engine.spec, messages, tools=tools, tool_choice=tool_choice)
        if not self.engine.spec.chat_template:
            stop = list(stop or []) + ["\nUser:"] if not isinstance(stop, str) else [stop, "\nUser:"]
        ids = self.engine.tokenize(prompt)
        gen = self._run(ids, max_tokens, stop, seed, (top_logprobs or 0) if logprobs else None,
                        constrain, logits_processor, None, **_sampling(
                            temperature, top_k, top_p, min_p, typical_p, repeat_penalty,
                            frequency_penalty, presence_penalty, logit_bias))
        cid, created = f"chatcmpl-{uuid.uuid4()}", int(time.time())
        name = tool["function"]["name"] if tool is not None else None
        if stream:
            return self._stream_chat(gen, cid, created, bool(logprobs), name)
        for _ in gen:
            pass
        lps = self._chat_logprobs(self._token_logprobs(gen)) if logprobs else None
        message: dict = {"role": "assistant", "content": gen.text}
        finish = self._finish(gen)
        if name is not None:
            call = {"name": name, "arguments": gen.text}
            message = {"role": "assistant", "content": None, "function_call": call,
                       "tool_calls": [{"id": f"call__0_{name}_{cid}", "type": "function",
                                       "function": dict(call)}]}
            finish = "tool_calls"
        return {"id": cid, "object": "chat.completion", "created": created, "model": self.model_path,
                "choices": [{"index": 0, "message": message, "logprobs": lps, "finish_reason": finish}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": gen.stats.tokens,
                          "total_tokens": len(ids) + gen.stats.tokens},
                "speculative": self._stats(gen)}

    def _stream_chat(self, gen, cid, created, logprobs: bool, tool: str | None) -> Iterator[dict]:
        """Chunks as llama-cpp-python streams them: a role chunk, content deltas (with their
        tokens' logprobs when asked), a final chunk; a named tool's arguments stream as
        tool_calls deltas."""
        def chunk(delta, finish, lps=None):
            return {"id": cid, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_path,
                    "choices": [{"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}]}

        call_id = f"call__0_{tool}_{cid}"
        if tool is None:
            yield chunk({"role": "assistant"}, None)
        else:
            yield chunk({"role": "assistant", "content": None, "function_call": None,
                         "tool_calls": None}, None)
        for piece, rows in self._pieces(gen, logprobs):
            lps = self._chat_logprobs(rows) if rows is not None else None
            if tool is None:
                yield chunk({"content": piece} if piece else {}, None, lps)
            else:
                yield chunk({"role": None, "content": None,
                             "function_call": {"name": tool, "arguments": piece},
                             "tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                             "function": {"name": tool, "arguments": piece}}]},
                            None, lps)
        final = chunk({}, "tool_calls" if tool is not None else self._finish(gen))
        final["speculative"] = self._stats(gen)
        yield final


def _tools(functions, function_call, tools, tool_choice):
    """OpenAI's legacy `functions` / `function_call` as tools / tool_choice (llama-cpp-python's rule)."""
    if functions is not None:
        tools = [{"type": "function", "function": f} for f in functions]
    if function_call is not None:
        if isinstance(function_call, str) and function_call in ("none", "auto"):
            tool_choice = function_call
        elif isinstance(function_call, dict) and "name" in function_call:
            tool_choice = {"type": "function", "function": {"name": function_call["name"]}}
    return tools, tool_choice


def _chosen_tool(tools, tool_choice) -> dict | None:
    """The tool a request names in tool_choice (then the reply is a call to it), else None."""
    if not isinstance(tool_choice, dict) or tools is None:
        return None
    try:
        name = tool_choice["function"]["name"]
    except (KeyError, TypeError):
        raise EdgespecError("tool_choice must be \"none\", \"auto\" or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}") from None
    tool = next((t for t in tools if t.get("function", {}).get("name") == name), None)
    if tool is None:
        raise EdgespecError(f"tool_choice names {name!r}, which is not among the tools")
    return tool


def _criteria(stopping_criteria):
    """llama-cpp-python's StoppingCriteriaList (or one callable, or a list of them) as one
    callable (ids, logits) -> bool; None when there are none."""
    if not stopping_criteria:
        return None
    if callable(stopping_criteria) and not isinstance(stopping_criteria, list):
        return stopping_criteria
    funcs = list(stopping_criteria)
    return lambda ids, logits: any(f(ids, logits) for f in funcs)


def _sampling(temperature, top_k, top_p, min_p, typical_p, repeat_penalty, frequency_penalty,
              presence_penalty, logit_bias) -> dict:
    """SamplingParams fields from llama-cpp-python's arguments (a negative temperature is
    llama.cpp's plain draw from the model's distribution: temperature 1, no cuts)."""
    if temperature < 0:
        temperature, top_k, top_p, min_p, typical_p = 1.0, 0, 1.0, 0.0, 1.0
    return dict(temperature=float(temperature), top_k=max(0, int(top_k)),
                top_p=float(top_p) if 0 < top_p <= 1 else 1.0, min_p=float(min_p),
                typical_p=float(typical_p) if 0 < typical_p <= 1 else 1.0,
                repeat_penalty=float(repeat_penalty), frequency_penalty=float(frequency_penalty),
                presence_penalty=float(presence_penalty), logit_bias=logit_bias)


# Options llama_cpp.Llama takes that edgespec does not implement yet: asking for one is an
# error that names it, never a silent difference in the output.
def _refuse(**options) -> None:
    asked = [name for name, v in options.items() if v is not None and v is not False and v != []]
    if asked:
        raise NotImplementedError(f"edgespec's SpeculativeLlama does not support {', '.join(asked)} "
                                  "yet; call llama_cpp.Llama for these requests")


def _not_provided(name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"SpeculativeLlama.{name} is not implemented; use "
                                  "llama_cpp.Llama for it")
    method.__name__ = name
    return method


class _Tokenizer:
    """llama-cpp-python's tokenizer interface (LlamaTokenizer) over the model's vocabulary."""

    def __init__(self, llm: SpeculativeLlama):
        self.llm = llm

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.llm.tokenize(text, add_bos, special)

    def detokenize(self, tokens: list[int], prev_tokens=None, special: bool = False) -> bytes:
        return self.llm.detokenize(tokens, prev_tokens, special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos, special)

    def decode(self, tokens: list[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")


# llama_cpp.Llama's methods that edgespec does not provide (embeddings, manual eval/sample
# steps, state snapshots, hub downloads): each raises NotImplementedError naming itself.
for _name in ("create_embedding", "embed", "eval", "sample", "save_state", "load_state",
              "set_cache", "from_pretrained", "pooling_type", "eval_logits", "__getstate__"):
    setattr(SpeculativeLlama, _name, _not_provided(_name))
