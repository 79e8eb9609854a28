"""Write edgespec/bench_prompts.jsonl: the default bench prompt set.

Code and prose come from the held-out side of the stdlib split (`edgespec.training.data`), which the data
stage never uses; chat prompts are plain user questions. Run: python scripts/make_bench_prompts.py
"""

import json
import random
from pathlib import Path

from edgespec.training.data import held_out_passages

CHAT = [
    "Explain in simple terms why the sky is blue.",
    "What are three tips for writing clear emails at work?",
    "How do I make a cup of good coffee with a French press?",
    "Write a short note thanking a friend for helping me move house.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a simple plan to start running three times a week.",
    "Why do leaves change colour in autumn?",
    "Summarise the water cycle for a ten-year-old.",
]


def main():
    rng = random.Random(7)
    passages = held_out_passages()
    out = []
    for kind, n in (("code", 8), ("prose", 8)):
        pool = [p for p in passages if p["kind"] == kind]
        for p in rng.sample(pool, n):
            out.append({"prompt": p["text"][:400], "kind": kind, "source": p["source"]})
    for q in CHAT:
        out.append({"prompt": f"Question: {q}\nAnswer:", "kind": "chat", "messages": [
            {"role": "user", "content": q}]})
    path = Path(__file__).resolve().parents[1] / "edgespec" / "bench_prompts.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in out))
    print(f"{len(out)} prompts -> {path}")


if __name__ == "__main__":
    main()
