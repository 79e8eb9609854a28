"""Chat prompts: render messages with the target's own chat template (jinja2, no torch)."""

from __future__ import annotations

from edgespec.errors import EdgespecError
from edgespec.targets import TargetSpec


def render_chat(spec: TargetSpec, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages`; base models without a template get plain turns."""
    if not spec.chat_template:
        return "\n".join(m["content"] for m in messages) + ("\n" if add_generation_prompt else "")
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        tmpl = env.from_string(spec.chat_template)
        return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token="", eos_token="")
    except jinja2.TemplateError as e:
        raise EdgespecError(f"the target's chat template failed to render ({e})") from None
