"""Chat prompts: render messages with the target's own chat template (jinja2, no torch)."""

from __future__ import annotations

import functools

from edgespec.errors import EdgespecError
from edgespec.targets import TargetSpec


@functools.lru_cache(maxsize=8)
def _template(source: str):
    """A chat template compiled once (compiling costs milliseconds a call; rendering far less)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)


def render_chat(spec: TargetSpec, messages: list[dict], add_generation_prompt: bool = True,
                tools: list | None = None, tool_choice=None) -> str:
    """The prompt text for `messages`; base models without a template get plain turns. The
    template sees `tools` and `tool_choice` (as llama-cpp-python passes them) where it uses them."""
    if not spec.chat_template:
        return "\n".join(m["content"] for m in messages) + ("\n" if add_generation_prompt else "")
    import jinja2

    try:
        return _template(spec.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token="", eos_token="", tools=tools, tool_choice=tool_choice)
    except jinja2.TemplateError as e:
        raise EdgespecError(f"the target's chat template failed to render ({e})") from None


class ChatSession:
    """A multi-turn chat over one loaded target and drafter (what `edgespec chat` drives).

    Chat models get their own template; base models continue a plain "User:/Assistant:"
    transcript and stop at the next "User:" line.
    """

    def __init__(self, engine, drafter=None, spec=None, max_tokens: int = 256,
                 temperature: float = 0.0, seed: int | None = None, sampling=None):
        """spec: a SpecConfig (draft length, policy; its drafter is `drafter`, made by the caller).
        sampling: the whole SamplingParams (cuts and penalties too); None: `temperature` and
        `seed` alone."""
        from edgespec.runtime.sampling import SamplingParams
        from edgespec.runtime.spec import SpecConfig

        self.engine, self.drafter, self.spec = engine, drafter, spec or SpecConfig()
        self.max_tokens = max_tokens
        self.sampling = sampling or SamplingParams(temperature=temperature, seed=seed)
        self.messages: list[dict] = []
        self.totals = {"replies": 0, "tokens": 0, "decode_s": 0.0, "verify_passes": 0}

    def prompt_text(self) -> str:
        spec = self.engine.spec
        if spec.chat_template:
            return render_chat(spec, self.messages)
        turns = [f"{'User' if m['role'] == 'user' else 'Assistant'}: {m['content']}" for m in self.messages]
        return "\n".join(turns) + "\nAssistant:"

    def reply(self, text: str, on_text=None):
        """Add a user turn and stream the answer; returns the Generation (its stats filled in).
        A KeyboardInterrupt stops the reply early and keeps what was said so far."""
        from edgespec.runtime.decoding import Generation

        if not text.strip():
            raise EdgespecError("empty message")
        self.messages.append({"role": "user", "content": text})
        ids = self.engine.tokenize(self.prompt_text())
        if len(ids) + 8 >= self.engine.n_ctx:
            self.messages.pop()
            raise EdgespecError("the conversation no longer fits the context; /reset to start over")
        stop = None if self.engine.spec.chat_template else ["\nUser:"]
        policy = self.spec.make_policy(self.engine, self.sampling.greedy,
                                       drafting=self.drafter is not None)
        gen = Generation(self.engine, ids, self.sampling, max_tokens=self.max_tokens,
                         drafter=self.drafter, policy=policy, stop=stop)
        try:
            for _, piece in gen:
                if on_text and piece:
                    on_text(piece)
        except KeyboardInterrupt:
            gen.stats.finish_reason = "interrupted"
        self.messages.append({"role": "assistant", "content": gen.text.strip()})
        t = self.totals
        t["replies"] += 1
        t["tokens"] += gen.stats.tokens
        t["decode_s"] += gen.stats.decode_s
        t["verify_passes"] += gen.stats.verify_passes
        return gen

    def reset(self) -> None:
        self.messages = []

    def stats_line(self) -> str:
        t = self.totals
        rate = t["tokens"] / t["decode_s"] if t["decode_s"] else 0.0
        per = t["tokens"] / t["verify_passes"] if t["verify_passes"] else 0.0
        return (f"{t['replies']} replies, {t['tokens']} tokens, {rate:.1f} tok/s, "
                f"{per:.2f} tokens per target pass, {len(self.messages)} messages in history")


def open_chat(args) -> ChatSession:
    """The session `edgespec chat` runs, from its parsed arguments (the bench's chat-cli rows
    open theirs here too). Sampling values out of range fail before the model loads."""
    from edgespec.runtime.drafters import drafter_for
    from edgespec.runtime.generate import open_target
    from edgespec.runtime.sampling import SamplingParams
    from edgespec.runtime.spec import SpecConfig

    spec = SpecConfig.from_args(args)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed)
    flash = {"on": True, "off": False}.get(getattr(args, "flash_attn", "off"))  # "auto": None
    engine = open_target(args.target, n_ctx=args.n_ctx, n_threads=args.threads,
                         lm_head=spec.lm_head, draft=spec.draft, flash_attn=flash)
    try:
        sampling.check_vocab(engine.spec.n_vocab)
    except EdgespecError:
        engine.close()
        raise
    return ChatSession(engine, drafter_for(spec.draft, engine), spec,
                       max_tokens=args.max_tokens, sampling=sampling)
