"""The shipped prompt set (code and prose from the held-out stdlib side, plus chat questions),
which the bench and the exporters' checks read; training never sees it."""

from __future__ import annotations

from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.io import read_prompt_lines

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "bench_prompts.jsonl"


def read_prompts(path: str | Path = DEFAULT_PROMPTS) -> list[dict]:
    """Each line's object (a non-empty `prompt`, optional `kind`, `messages`)."""
    out = [obj for _, obj in read_prompt_lines(path, nonempty=True)]
    if not out:
        raise EdgespecError(f"{path}: no prompts")
    return out
