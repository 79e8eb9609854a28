"""An EAGLE-3 head GGUF inside stock llama-server, against edgespec's replay of llama.cpp's draft
loop on the same text (measure/eagle3_check.py says how).

    .venv/bin/python scripts/eagle3_check.py smollm2-135m runtime/heads/smollm2-135m/eagle3-q8_0.gguf \
        [--limit 12] [--n-predict 128]
Writes results/eagle3-check-<target>.json (a new -runN file where one stands). Needs
`make llama-tools` (EDGESPEC_LLAMA_TOOLS or the user cache).
"""

import argparse

from edgespec.io import write_result
from edgespec.measure.bench import machine_info
from edgespec.measure.eagle3_check import eagle3_in_llama_server
from edgespec.prompts import DEFAULT_PROMPTS, read_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("head")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--n-predict", type=int, default=128)
    a = ap.parse_args()
    prompts = [p["prompt"] for p in read_prompts(DEFAULT_PROMPTS)][:a.limit]
    r = eagle3_in_llama_server(a.target, a.head, prompts, n_predict=a.n_predict)
    from edgespec.runtime.llama_target import default_threads

    r["machine"] = machine_info(default_threads())
    path = write_result("results", f"eagle3-check-{a.target}", r)
    print({k: v for k, v in r.items() if k not in ("per_prompt", "machine")})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
