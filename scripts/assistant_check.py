"""A gemma4-assistant GGUF (`edgespec export llama-cpp` of a shared-KV head) inside
llama-server-nextn, against edgespec's replay of llama.cpp's draft loop on the same text
(measure/assistant_check.py says how).

    .venv/bin/python scripts/assistant_check.py gemma3-270m assistant.gguf [--limit 12] [--n-predict 128]
Writes results/assistant-check-<target>.json (a new -runN file where one stands). Needs
`make llama-tools` (EDGESPEC_LLAMA_TOOLS or the user cache).
"""

import argparse

from edgespec.io import write_result
from edgespec.measure.bench import machine_info
from edgespec.measure.assistant_check import assistant_in_llama_server
from edgespec.prompts import DEFAULT_PROMPTS, read_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("head")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--server", default="llama-server-nextn",
                    help="llama-server-nextn (the patched gemma3 graph) or llama-server (stock)")
    a = ap.parse_args()
    prompts = [p["prompt"] for p in read_prompts(DEFAULT_PROMPTS)][:a.limit]
    r = assistant_in_llama_server(a.target, a.head, prompts, n_predict=a.n_predict, server=a.server)
    from edgespec.runtime.llama_target import default_threads

    r["machine"] = machine_info(default_threads())
    path = write_result("results", f"assistant-check-{a.target}" + ("-stock" if a.server == "llama-server" else ""), r)
    print({k: v for k, v in r.items() if k not in ("per_prompt", "machine", "diagnosis")})
    print(r["diagnosis"])
    print(f"written to {path}")


if __name__ == "__main__":
    main()
