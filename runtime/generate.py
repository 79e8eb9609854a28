"""One call from text to generated text: what `edgespec generate` runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from edgespec.errors import EdgespecError
from edgespec.runtime.decoding import Generation, Stats
from edgespec.runtime.llama_target import LlamaTarget
from edgespec.runtime.policies import make_policy
from edgespec.runtime.sampling import SamplingParams


@dataclass
class Result:
    text: str
    token_ids: list[int]
    stats: Stats
    draft: str  # what drafted: "none" or a head's description

    def to_dict(self) -> dict:
        out = {"text": self.text, "tokens": self.stats.tokens, "token_ids": self.token_ids,
               "draft": self.draft}
        out.update(self.stats.to_dict())
        return out


def generate(target: str | Path | LlamaTarget, prompt: str, max_tokens: int = 128,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | None = None, stop: list[str] | None = None, n_ctx: int = 4096,
             n_threads: int | None = None, draft: str | None = None, k: int | None = None,
             policy: str = "cost",
             on_text: Callable[[str], None] | None = None) -> Result:
    """Generate a continuation of `prompt`; `on_text` receives each text piece as it streams.

    draft: None/"none" (target only), "lookup" (prompt lookup), "default" (the head shipped for
    the target, mixed with prompt lookup), a head file/folder, or "head:default"/"head:PATH".
    k: the most tokens drafted per step (None: the engine's `draft_k`).
    """
    if not prompt or not prompt.strip():
        raise EdgespecError("empty prompt: give some text with --prompt")
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    engine = target if hasattr(target, "decode") else open_target(
        target, n_ctx=n_ctx, n_threads=n_threads)
    drafter = make_drafter(draft, engine.spec)
    ids = engine.tokenize(prompt)
    gen = Generation(engine, ids, sampling, max_tokens=max_tokens, drafter=drafter,
                     policy=make_policy(policy, k if drafter else 0, engine, greedy=sampling.greedy),
                     stop=stop)
    for _, piece in gen:
        if on_text and piece:
            on_text(piece)
    return Result(gen.text, gen.token_ids, gen.stats, getattr(drafter, "name", "none"))


def open_target(target, n_ctx: int = 4096, n_threads: int | None = None, n_batch: int = 512,
                lm_head: str = "auto"):
    """The engine for a target: llama.cpp for a GGUF file or known name, onnxruntime for a
    folder made by `edgespec export onnx-target` (whose LM head was chosen at export: `lm_head`
    applies to llama.cpp targets, see LlamaTarget)."""
    p = Path(str(target)).expanduser()
    if p.is_dir():
        from edgespec.runtime.ort_target import OrtTarget

        return OrtTarget(p, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch)
    return LlamaTarget(target, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch, lm_head=lm_head)


def make_drafter(draft: str | None, spec):
    """A drafter from its command-line name (see `generate`).

    "none", "lookup", "default" (the shipped head with prompt lookup), a head file or checkpoint
    folder (with prompt lookup), or "head:default" / "head:PATH" for the head alone."""
    from edgespec.runtime.drafters import HeadDrafter, MixedDrafter, PromptLookup, default_head

    if draft in (None, "", "none"):
        return None
    if draft == "lookup":
        return PromptLookup()
    alone = draft.startswith("head:")
    name = draft[len("head:"):] if alone else draft
    head = HeadDrafter(default_head(spec) if name == "default" else name, spec)
    return head if alone else MixedDrafter(head, PromptLookup())
