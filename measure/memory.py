"""Peak memory of one configuration (target engine, LM head, drafter), each measured in a fresh
process so configurations never share pages: what `edgespec bench` reports next to plain
llama.cpp's own figure.

    python -m edgespec.measure.memory --target gemma3-270m --lm-head full --draft none
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

from edgespec.errors import EdgespecError

PROMPT = "Memory check: the quick brown fox jumps over the lazy dog, again and again."


def peak_rss_mb(target: str, lm_head: str = "full", draft: str = "none", n_ctx: int = 4096,
                threads: int | None = None, tokens: int = 16) -> float:
    """Peak RSS (MB) of a fresh process that opens the target and drafter and decodes `tokens`
    greedy tokens."""
    cmd = [sys.executable, "-m", "edgespec.measure.memory", "--target", str(target), "--lm-head",
           lm_head, "--draft", draft, "--n-ctx", str(n_ctx), "--tokens", str(tokens)]
    if threads:
        cmd += ["--threads", str(threads)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise EdgespecError(f"memory measurement failed for {target} ({lm_head}, {draft}): {last}")
    return float(json.loads(res.stdout.strip().splitlines()[-1])["peak_rss_mb"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edgespec.measure.memory")
    p.add_argument("--target", required=True)
    p.add_argument("--lm-head", default="full")
    p.add_argument("--draft", default="none")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tokens", type=int, default=16)
    a = p.parse_args(argv)
    from edgespec.runtime.generate import generate
    from edgespec.runtime.spec import SpecConfig

    try:
        generate(a.target, PROMPT, max_tokens=a.tokens, n_ctx=a.n_ctx, n_threads=a.threads,
                 spec=SpecConfig(draft=a.draft, lm_head=a.lm_head, policy="fixed"))
    except EdgespecError as e:
        print(f"edgespec: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"peak_rss_mb": round(peak_of_this_process_mb(), 1)}))
    return 0


def peak_of_this_process_mb() -> float:
    """VmHWM, the high-water mark of this process's own memory map. (ru_maxrss would do on
    other systems, but Linux carries the parent's figure over fork + exec into it.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


if __name__ == "__main__":
    sys.exit(main())
