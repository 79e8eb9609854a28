"""One call from text to generated text: what `edgespec generate` runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from edgespec.errors import EdgespecError
from edgespec.io import utf8
from edgespec.runtime.decoding import Generation, Stats, Target
from edgespec.runtime.drafters import drafter_for, reads_hidden
from edgespec.runtime.engine import Engine
from edgespec.runtime.sampling import SamplingParams
from edgespec.runtime.spec import SpecConfig


@dataclass
class Comparison:
    """Target-only decoding of the same prompt on the same engine, right after."""

    tokens_per_s: float
    speedup: float  # the speculative run's tokens/s over this one's
    same_output: bool  # identical token ids


@dataclass
class Result:
    text: str
    token_ids: list[int]
    stats: Stats
    draft: str  # what drafted: "none" or a head's description
    policy: str
    lm_head: str  # the LM head verification used
    compare: Comparison | None = None

    def to_dict(self) -> dict:
        out = {"text": self.text, "tokens": self.stats.tokens, "token_ids": self.token_ids,
               "draft": self.draft, "draft_policy": self.policy, "lm_head": self.lm_head}
        out.update(self.stats.to_dict())
        if self.compare:
            out.update(target_only_tokens_per_s=round(self.compare.tokens_per_s, 3),
                       speedup=round(self.compare.speedup, 4), same_as_target=self.compare.same_output)
        return out


def open_target(target, n_ctx: int = 4096, n_threads: int | None = None, n_batch: int = 512,
                lm_head: str = "auto", flash_attn: bool | None = None, draft: str | None = None) -> Target:
    """The engine for a target: llama.cpp for a GGUF file or known name, onnxruntime for a
    folder made by `edgespec export onnx-target` (whose LM head was chosen at export: `lm_head`
    applies to llama.cpp targets, see LlamaTarget, as does `flash_attn`). `draft`: the drafter
    it will serve: a head reads hidden states through llama.cpp's probe (a shared-KV head needs
    it; an MTP head reads its prompt rows from the prompt's own batches with it); none at all:
    every pass is one row, which the batched LM head does not make cheaper (LlamaTarget)."""
    p = Path(str(target)).expanduser()
    if p.is_dir():
        from edgespec.runtime.ort_target import OrtTarget

        return OrtTarget(p, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch)
    from edgespec.runtime.llama_target import LlamaTarget

    return LlamaTarget(target, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch, lm_head=lm_head,
                       flash_attn=flash_attn, probe=reads_hidden(draft), drafts=draft is not None)


def generate(target: str | Path | Target, prompt: str, max_tokens: int = 128,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | None = None, min_p: float = 0.0, repeat_penalty: float = 1.0,
             stop: list[str] | None = None, n_ctx: int = 4096,
             n_threads: int | None = None, spec: SpecConfig | None = None, compare: bool = False,
             on_text: Callable[[str], None] | None = None) -> Result:
    """Generate a continuation of `prompt`; `on_text` receives each text piece as it streams.

    target: a name, GGUF path or ONNX target folder (opened here with the spec's LM head), or
    an open engine. spec: the drafter, draft length, policy and LM head (default: no drafter).
    compare: also decode the prompt target-only and report the speedup.
    """
    spec = spec or SpecConfig(draft=None)
    if not prompt or not prompt.strip():
        raise EdgespecError("empty prompt: give some text with --prompt")
    utf8(prompt, "prompt")  # before anything loads
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              min_p=min_p, repeat_penalty=repeat_penalty)
    engine = target if isinstance(target, Engine) else open_target(
        target, n_ctx=n_ctx, n_threads=n_threads, lm_head=spec.lm_head, draft=spec.draft)
    sampling.check_vocab(engine.spec.n_vocab)
    drafter = drafter_for(spec.draft, engine)
    ids = engine.tokenize(prompt)

    def run(d) -> Generation:
        pol = spec.make_policy(engine, sampling.greedy, drafting=d is not None)
        gen = Generation(engine, ids, sampling, max_tokens=max_tokens, drafter=d, policy=pol, stop=stop)
        for _, piece in gen:
            if on_text and piece and d is drafter:
                on_text(piece)
        return gen

    gen = run(drafter)
    res = Result(gen.text, gen.token_ids, gen.stats, drafter.name if drafter else "none", spec.policy,
                 engine.describe_lm_head(sampling.greedy))
    if compare and drafter:
        base = run(None)
        rate = base.stats.tokens_per_s
        res.compare = Comparison(rate, gen.stats.tokens_per_s / rate if rate else 0.0,
                                 base.token_ids == gen.token_ids)
    return res
