"""The `edgespec` command. Each subcommand parses its arguments and calls one library function."""

from __future__ import annotations

import argparse
import json
import sys

from edgespec import __version__
from edgespec.errors import EdgespecError


def _cmd_info(args) -> int:
    from edgespec.targets import load_target_spec

    spec = load_target_spec(args.target)
    d = spec.to_dict()
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    d["chat_template"] = "yes" if spec.chat_template else "none"
    d["layer_types"] = "".join("G" if t == "global" else "s" for t in spec.layer_types)
    for k, v in d.items():
        print(f"{k:22s} {v}")
    return 0


def _cmd_generate(args) -> int:
    from edgespec.runtime.generate import generate

    stream = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    res = generate(args.target, args.prompt, max_tokens=args.max_tokens,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   seed=args.seed, stop=args.stop, n_ctx=args.n_ctx, n_threads=args.threads,
                   on_text=stream)
    if args.json:
        print(json.dumps(res.to_dict()))
    else:
        s = res.stats
        print()
        print(f"[{s.tokens} tokens, {s.tokens_per_s:.1f} tok/s, prefill {s.prefill_s * 1000:.0f} ms "
              f"for {s.prompt_tokens} prompt tokens, draft: {res.draft}, "
              f"mean accepted {s.mean_accepted:.2f}, finish: {s.finish_reason}]", file=sys.stderr)
    return 0


def _positive_int(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got '{v}'") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {n}")
    return n


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like every other bad input
        print(f"edgespec: error: {message} (see: {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="edgespec", description="Speculative decoding for CPUs and phones.")
    p.add_argument("--version", action="version", version=f"edgespec {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("info", help="show a target's spec read from its GGUF metadata")
    s.add_argument("target", help="gemma3-270m, smollm2-135m, or a path to a .gguf file")
    s.add_argument("--json", action="store_true", help="print the spec as JSON")
    s.set_defaults(func=_cmd_info)

    s = sub.add_parser("generate", help="generate text from a prompt, streaming")
    s.add_argument("--target", required=True, help="gemma3-270m, smollm2-135m, or a .gguf path")
    s.add_argument("--prompt", required=True)
    s.add_argument("--max-tokens", type=_positive_int, default=128)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--n-ctx", type=_positive_int, default=4096)
    s.add_argument("--threads", type=_positive_int, default=None)
    s.add_argument("--json", action="store_true", help="print one JSON object at the end")
    s.set_defaults(func=_cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EdgespecError as e:
        print(f"edgespec: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("edgespec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
