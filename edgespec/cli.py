"""The `edgespec` command. Each subcommand parses its arguments and calls one library function."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from edgespec import __version__
from edgespec.errors import EdgespecError, one_line
from edgespec.io import int_at_least


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


def _args_info(s) -> None:
    s.add_argument("target", help="gemma3-270m, smollm2-135m, or a path to a .gguf file")
    s.add_argument("--json", action="store_true", help="print the spec as JSON")


def _cmd_generate(args) -> int:
    from edgespec.runtime.generate import generate
    from edgespec.runtime.spec import SpecConfig

    stream = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    res = generate(args.target, args.prompt, max_tokens=args.max_tokens,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                   seed=args.seed, stop=args.stop, n_ctx=args.n_ctx, n_threads=args.threads,
                   spec=SpecConfig.from_args(args), compare=args.compare, on_text=stream)
    if args.json:
        print(json.dumps(res.to_dict()))
        return 0
    s = res.stats
    print()
    print(f"[{s.tokens} tokens, {s.tokens_per_s:.1f} tok/s, prefill {s.prefill_s * 1000:.0f} ms "
          f"for {s.prompt_tokens} prompt tokens, draft: {res.draft}, "
          f"mean accepted {s.mean_accepted:.2f} tokens/pass, finish: {s.finish_reason}]", file=sys.stderr)
    if res.compare:
        c = res.compare
        same = "identical" if c.same_output else "differs (llama.cpp batch numerics)"
        print(f"[target-only (LM head: {res.lm_head}) in the same run: {c.tokens_per_s:.1f} tok/s "
              f"-> speedup {c.speedup:.2f}x; output {same}]", file=sys.stderr)
    return 0


def _args_generate(s) -> None:
    from edgespec.runtime.spec import add_spec_args

    s.add_argument("--target", required=True, help="gemma3-270m, smollm2-135m, or a .gguf path")
    s.add_argument("--prompt", required=True)
    s.add_argument("--max-tokens", type=_positive_int, default=128)
    add_sampling_args(s)
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--n-ctx", type=_positive_int, default=4096)
    s.add_argument("--threads", type=_positive_int, default=None)
    add_spec_args(s, draft="none")
    s.add_argument("--compare", action="store_true",
                   help="also run target-only on the same prompt and report the speedup")
    s.add_argument("--json", action="store_true", help="print one JSON object at the end")


def _cmd_data(args) -> int:
    from edgespec.training.data import DataConfig, make_data

    cfg = DataConfig(n_prompts=args.n_prompts, skip_prompts=args.skip_prompts,
                     prompt_tokens=args.prompt_tokens,
                     new_tokens=args.new_tokens, sample_share=args.sample_share, seed=args.seed,
                     chat=args.chat, shard_size=args.shard_size, text_tokens=args.text_tokens)
    m = make_data(args.target, args.prompts, args.out, cfg, parallel=args.parallel)
    print(json.dumps({k: m[k] for k in ("samples", "tokens", "target")}))
    return 0


def _args_data(s) -> None:
    s.add_argument("--target", required=True)
    s.add_argument("--prompts", nargs="*", default=["stdlib"],
                   help="prompt sources: .jsonl (field 'prompt'), .txt, 'stdlib' (default) or "
                        "'site-packages'")
    s.add_argument("--out", required=True)
    s.add_argument("--n-prompts", type=_positive_int, default=400)
    s.add_argument("--skip-prompts", type=_nonneg_int, default=0, metavar="N",
                   help="leave out the first N passages of the seeded order (a later stage's "
                        "data: the passages after an earlier stage's --n-prompts)")
    s.add_argument("--prompt-tokens", type=_positive_int, default=48)
    s.add_argument("--new-tokens", type=_nonneg_int, default=128,
                   help="tokens the target writes per prompt; 0: the text alone (--text-tokens)")
    s.add_argument("--text-tokens", type=_positive_int, default=512,
                   help="with --new-tokens 0: tokens of each passage kept")
    s.add_argument("--sample-share", type=float, default=0.5)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--parallel", type=_positive_int, default=1,
                   help="continuations written at once, one batched llama.cpp decode per step")
    s.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    s.add_argument("--shard-size", type=_positive_int, default=50,
                   help="samples per shard file (a killed run resumes after the last one)")


def _cmd_extract(args) -> int:
    from edgespec.targets import load_target_spec
    from edgespec.training.eagle3 import parse_layers
    from edgespec.training.features import ExtractConfig, default_kv_layers, extract

    spec = load_target_spec(args.target)
    layers = parse_layers(args.layers, spec.n_layer) if args.layers else ()
    kv = default_kv_layers(spec) if args.kv else ()
    m = extract(args.target, args.data, args.out,
                ExtractConfig(dtype=args.dtype, group_size=args.group_size, transform=args.transform,
                              shard_samples=args.shard_samples, layers=layers, kv_layers=kv,
                              n_batch=args.n_batch))
    print(json.dumps({k: m[k] for k in ("tokens", "dtype", "group_size", "bytes",
                                        "bytes_per_token", "tokens_per_s")}))
    return 0


def _args_extract(s) -> None:
    s.add_argument("--target", required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--dtype", default="int4", help="fp16, int8 or int4 (default)")
    s.add_argument("--group-size", type=_positive_int, default=32)
    s.add_argument("--transform", default="dct", choices=["dct", "none"],
                   help="int8/int4: channel scales + DCT before quantizing (default dct)")
    s.add_argument("--shard-samples", type=_positive_int, default=100,
                   help="samples per shard file (a killed run resumes after the last one)")
    s.add_argument("--n-batch", type=_positive_int, default=256,
                   help="tokens per llama.cpp decode (default 256)")
    s.add_argument("--layers", default=None,
                   help="also store these layers' inputs, for --arch eagle3 heads: A,B,C or "
                        "'eagle3' (layers 2, n/2 and n-3)")
    s.add_argument("--kv", action="store_true",
                   help="also store the keys and values of the layers a --arch shared-kv head "
                        "reads (the last sliding and the last global layer)")


def _cmd_train(args) -> int:
    from edgespec.training.features import features_source
    from edgespec.training.train import TrainConfig, train

    cfg = TrainConfig(optimizer=args.optimizer, steps=args.steps, batch=args.batch,
                      n_steps=args.unroll, draft_vocab=args.draft_vocab, lr=args.lr,
                      muon_lr=args.muon_lr,
                      seed=args.seed, threads=args.threads or 0, save_every=args.save_every,
                      arch=args.arch, max_train_tokens=args.max_train_tokens or 0,
                      init_from=os.path.abspath(args.init_from) if args.init_from else "",
                      topk=args.topk, topk_weight=args.topk_weight)
    overrides = {}
    if args.input_norms:
        if args.arch != "shared-kv":
            raise EdgespecError("--input-norms is a shared-kv head option")
        overrides["input_norms"] = True
    if args.d_model:
        if args.arch != "shared-kv":
            raise EdgespecError("--d-model is a shared-kv head option (the MTP head is the target's width)")
        overrides["d_model"] = args.d_model
    if args.layer_types:
        overrides["layer_types"] = args.layer_types.split(",")
    if args.seq_len:
        cfg.seq_len = args.seq_len
    layers, kv = (), ()
    if args.online and args.arch == "eagle3":
        from edgespec.targets import load_target_spec
        from edgespec.training.eagle3 import parse_layers

        layers = parse_layers(args.layers or "eagle3", load_target_spec(args.target).n_layer)
    if args.online and args.arch == "shared-kv":
        from edgespec.targets import load_target_spec
        from edgespec.training.features import default_kv_layers

        kv = default_kv_layers(load_target_spec(args.target))
    features = features_source(args.target, args.features, args.data if args.online else None,
                               online=args.online, cache_mb=args.online_cache_mb, layers=layers,
                               kv_layers=kv)
    meta = train(args.target, features, args.out, cfg, resume=args.resume,
                 head_overrides=overrides, log=lambda m: print(m, file=sys.stderr), carry=args.carry)
    if os.environ.get("RANK", "0") != "0":  # under torchrun rank 0 reports
        return 0
    print(json.dumps({"out": args.out, "steps": meta["train"]["steps_done"],
                      "seconds": meta["train"]["seconds"],
                      "trainable_parameters": meta["train"]["trainable_parameters"],
                      "draft_vocab": meta["draft_vocab"]["size"],
                      "coverage": meta["draft_vocab"]["coverage"]}))
    return 0


def _args_train(s) -> None:
    s.add_argument("--target", required=True)
    s.add_argument("--features", default=None, nargs="+",
                   help="hidden states stored by `edgespec extract` (several folders: read as one, "
                        "repeated samples trained on once)")
    s.add_argument("--online", action="store_true",
                   help="run the target during training instead (nothing stored on disk); needs --data")
    s.add_argument("--data", default=None, help="--online: the output of `edgespec data`")
    s.add_argument("--online-cache-mb", type=int, default=1024,
                   help="--online: RAM kept for hidden states already computed (0 = none)")
    s.add_argument("--out", required=True)
    s.add_argument("--optimizer", default="muon", choices=["adamw", "muon"])
    s.add_argument("--steps", type=_positive_int, default=800)
    s.add_argument("--batch", type=_positive_int, default=4)
    s.add_argument("--unroll", type=_positive_int, default=4, help="draft steps unrolled")
    s.add_argument("--seq-len", type=_positive_int, default=None, help="positions per training window (96)")
    s.add_argument("--draft-vocab", type=_positive_int, default=4096)
    s.add_argument("--max-train-tokens", type=_positive_int, default=None,
                   help="train on a fixed random subset of the training samples this many tokens "
                        "large (data-scaling curves); default all")
    s.add_argument("--lr", type=_positive_float, default=2e-3,
                   help="AdamW's learning rate (with Muon: for the parameters Muon does not take)")
    s.add_argument("--muon-lr", type=_positive_float, default=0.02,
                   help="Muon's learning rate for the weight matrices (lower it to continue a "
                        "trained head with --init-from)")
    s.add_argument("--topk-weight", type=float, default=0.0,
                   help="add this times the cross-entropy on the target's --topk most likely "
                        "draft tokens to the forward KL (ranking-aware, HASS-style; 0: KL alone)")
    s.add_argument("--topk", type=_positive_int, default=10)
    s.add_argument("--layer-types", default=None, help="mtp: e.g. sliding,global")
    s.add_argument("--arch", default="mtp", choices=["mtp", "eagle3", "shared-kv"],
                   help="mtp: edgespec's head (default); eagle3: llama.cpp's EAGLE-3 graph, on "
                        "features extracted with --layers (export it with `export llama-cpp`); "
                        "shared-kv: a head with no K/V of its own that attends the target's "
                        "cache, on features extracted with --kv")
    s.add_argument("--layers", default=None,
                   help="--online --arch eagle3: the target layers read (default 'eagle3')")
    s.add_argument("--input-norms", action="store_true",
                   help="--arch shared-kv: RMS-norm the token embedding and hidden state before "
                        "pre_proj (as the MTP head does; llama.cpp's Gemma 4 assistant has none)")
    s.add_argument("--d-model", type=_positive_int, default=None,
                   help="--arch shared-kv: the head's own width (default: the target's; llama.cpp's "
                        "gemma4-assistant layout needs another one)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=_positive_int, default=None)
    s.add_argument("--save-every", type=_positive_int, default=250,
                   help="steps between checkpoints (a killed run resumes from the last one)")
    s.add_argument("--resume", action="store_true")
    s.add_argument("--carry", default=None, metavar="DIR",
                   help="also keep the run's resumable state here with each checkpoint, in files "
                        "small enough to commit (fp16/bf16, < 20 MB each); with --resume a fresh "
                        "machine continues from it (same features and flags)")
    s.add_argument("--init-from", default=None, metavar="CKPT",
                   help="start from this checkpoint's weights and draft vocabulary (continued "
                        "training: new optimizer state and schedule over --steps)")


def _cmd_eval_head(args) -> int:
    from edgespec.training.train import eval_head

    if bool(args.features) == bool(args.data):
        raise EdgespecError("give either --features DIR or --data DIR (the target then runs on it)")
    features = args.features or args.data
    r = eval_head(args.ckpt, features, max_chain=args.max_chain, start_from=args.start_from,
                  online=bool(args.data), all_samples=args.all_samples)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"held-out samples {r['samples']}, chain starts {r['positions']}")
        print("acceptance by position: " + " ".join(f"{a:.3f}" for a in r["acceptance_by_position"]))
        print("expected accepted (k drafts): " + " ".join(f"k={k}:{v:.2f}" for k, v in r["expected_accepted"].items()))
    return 0


def _args_eval_head(s) -> None:
    s.add_argument("ckpt", help="a checkpoint folder, or a carried state (`train --carry DIR`)")
    s.add_argument("--features", default=None, help="held-out hidden states stored by `extract`")
    s.add_argument("--data", default=None, help="or a data folder: the target runs on its held-out samples")
    s.add_argument("--max-chain", type=_positive_int, default=8)
    s.add_argument("--start-from", type=int, default=0, help="count chain starts from this position on")
    s.add_argument("--all-samples", action="store_true",
                   help="score every sample, not only the held-out ones (for a folder made from "
                        "held-out text)")
    s.add_argument("--json", action="store_true")


def _cmd_serve(args) -> int:
    if args.max_queue < 0:
        raise EdgespecError(f"--max-queue must be >= 0, got {args.max_queue}")
    try:
        from edgespec.runtime.server import serve
        from edgespec.runtime.spec import SpecConfig
        import fastapi, uvicorn  # noqa: F401  (the `serve` extra)
    except ImportError:
        raise EdgespecError("the server needs its extra: pip install 'edgespec[serve]'") from None
    print(f"edgespec serve: http://{args.host}:{args.port}/ (chat page), /v1/ (OpenAI API)",
          file=sys.stderr)
    serve(args.target, SpecConfig.from_args(args), host=args.host, port=args.port, n_ctx=args.n_ctx,
          threads=args.threads, api_key=args.api_key, max_queue=args.max_queue, parallel=args.parallel)
    return 0


def _args_serve(s) -> None:
    from edgespec.runtime.spec import add_spec_args

    s.add_argument("--target", required=True)
    add_spec_args(s, draft="default")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_positive_int, default=8080)
    s.add_argument("--n-ctx", type=_positive_int, default=4096, help="context per slot")
    s.add_argument("--threads", type=_positive_int, default=None)
    s.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/")
    s.add_argument("--max-queue", type=int, default=8,
                   help="requests that may wait while every slot is busy; more get 503")
    s.add_argument("--parallel", type=_positive_int, default=1,
                   help="slots: requests generating at once in one cache, their drafts verified "
                        "in one batched decode per step (GGUF targets)")


def _cmd_chat(args) -> int:
    from edgespec.runtime.chat import open_chat

    session = open_chat(args)
    engine = session.engine
    mode = "chat template" if engine.spec.chat_template else "plain continuation (base model)"
    print(f"edgespec chat: {engine.spec.name}, {mode}, draft: {args.draft}. "
          "Commands: /reset /stats /quit; Ctrl-C stops a reply.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/quit", "/exit"):
            break
        if cmd == "/reset":
            session.reset()
            print("[history cleared]", file=sys.stderr)
            continue
        if cmd == "/stats":
            print(f"[{session.stats_line()}]", file=sys.stderr)
            continue
        try:
            gen = session.reply(cmd, on_text=lambda p: (sys.stdout.write(p), sys.stdout.flush()))
        except EdgespecError as e:
            print(f"edgespec: {e}", file=sys.stderr)
            continue
        s = gen.stats
        print()
        print(f"[{s.tokens} tokens, {s.tokens_per_s:.1f} tok/s, {s.mean_accepted:.2f} tokens/pass, "
              f"{s.finish_reason}]", file=sys.stderr)
    return 0


def _args_chat(s) -> None:
    from edgespec.runtime.spec import add_spec_args

    s.add_argument("--target", required=True)
    add_spec_args(s, draft="lookup")
    s.add_argument("--max-tokens", type=_positive_int, default=256)
    # llama.cpp's own chat defaults for the cuts (llama-cli, llama-server, llama-cpp-python's
    # create_chat_completion): they shape the law only once --temperature is above 0
    add_sampling_args(s, top_k=40, top_p=0.95, min_p=0.05)
    s.add_argument("--n-ctx", type=_positive_int, default=4096)
    s.add_argument("--threads", type=_positive_int, default=None)
    s.add_argument("--flash-attn", choices=("off", "on", "auto"), default="off",
                   help="llama.cpp's flash attention: off (default, as llama_cpp.Llama: the same "
                        "attention writes the same replies), on, or auto (llama.cpp chooses)")


def add_sampling_args(s, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> None:
    """--temperature, --top-k, --top-p, --min-p, --repeat-penalty and --seed, as llama.cpp names
    them (the chain runs in llama.cpp's order: penalties, top-k, top-p, min-p, temperature)."""
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=top_k, help=f"keep the k likeliest tokens; 0: all "
                   f"(default: {top_k})")
    s.add_argument("--top-p", type=float, default=top_p, help=f"nucleus mass kept (default: {top_p})")
    s.add_argument("--min-p", type=float, default=min_p, help="drop tokens under this times the "
                   f"likeliest one's probability (default: {min_p})")
    s.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="penalise the last 64 tokens' repeats; 1: off (default: 1.0)")
    s.add_argument("--seed", type=int, default=None)


def _cmd_bench(args) -> int:
    from edgespec.measure import bench as b
    from edgespec.prompts import DEFAULT_PROMPTS, read_prompts

    prompts = read_prompts(args.prompts or DEFAULT_PROMPTS)
    if args.workload:
        return _bench_workload(args, prompts)
    if args.only:
        raise EdgespecError("--only picks rows of a --workload; give --workload too")
    if not args.target:
        raise EdgespecError("bench needs --target (or --workload)")
    if args.limit:
        prompts = prompts[: args.limit]
    methods = b.parse_methods(args.methods, args.draft or ["default"], args.k, args.policy)
    device = None
    threads = args.threads
    if args.device:
        from edgespec.devices import apply_profile

        device, threads = apply_profile(args.device, threads)
    if args.json:
        b.ensure_new(args.json)  # before the run, not after it
    report = b.bench(args.target, prompts, methods, max_new_tokens=args.max_new_tokens,
                     threads=threads, temperature=args.temperature, seed=args.seed,
                     device=device, baseline=args.baseline, lm_head=args.lm_head,
                     memory=not args.no_memory, background_load=args.background_load,
                     peers=tuple(args.peers or ()), peer_head=args.peer_eagle3)
    print(b.format_table(report))
    if args.json:
        b.write_report(report, args.json)
        print(f"report written to {args.json}", file=sys.stderr)
    if args.plot:
        b.plot(report, args.plot)
    return 0


def _bench_workload(args, prompts: list[dict]) -> int:
    """`bench --workload NAME`: the drop-in against llama_cpp.Llama, each row an app's call."""
    from edgespec.measure import bench as b
    from edgespec.measure.workload import CLI_DRAFT, bench_workload, format_workload

    if args.json:
        b.ensure_new(args.json)
    if args.limit:  # per kind: each row runs the prompts of its own kinds
        by_kind: dict[str, list[dict]] = {}
        for p in prompts:
            by_kind.setdefault(p.get("kind"), []).append(p)
        prompts = [p for ps in by_kind.values() for p in ps[:args.limit]]
    default = [CLI_DRAFT] if args.workload == "chat-cli" else ["default"]
    report = bench_workload(args.workload, prompts, max_tokens=args.max_new_tokens,
                            threads=args.threads, draft=args.draft or default,
                            copy_quant=args.copy_quant.upper(), only=args.only)
    print(format_workload(report))
    if args.json:
        b.write_report(report, args.json)
        print(f"report written to {args.json}", file=sys.stderr)
    return 0


def _args_bench(s) -> None:
    from edgespec.runtime.spec import add_spec_args

    s.add_argument("--target", default=None, help="the target (not needed with --workload)")
    s.add_argument("--copy-quant", default="Q4_0",
                   help="--workload verify-friendly: the type the drop-in's copy of the file is "
                        "re-quantized to (Q4_0, Q5_0, Q8_0, IQ4_NL; default Q4_0)")
    s.add_argument("--workload", default=None, choices=["defaults", "verify-friendly", "chat-cli"],
                   help="instead of methods: the drop-in against llama_cpp.Llama, each row one "
                        "app call with llama-cpp-python's defaults (Gemma completions at T=0 and "
                        "at the defaults, SmolLM2 chat at the defaults and at T=0.8); "
                        "verify-friendly: the SmolLM2 rows with the drop-in on a --copy-quant copy "
                        "of the file (llama_cpp.Llama on the file, and on the copy); chat-cli: "
                        "`edgespec chat` on SmolLM2 (its defaults, and --temperature 0.8) against "
                        "create_chat_completion with the same sampling values, two turns a "
                        "conversation (--draft: the chat's own default unless given)")
    s.add_argument("--only", default=None,
                   help="--workload: run just the rows whose name holds this text (e.g. smollm2)")
    add_spec_args(s, many_drafts=True)
    s.add_argument("--prompts", default=None, help="JSONL with a 'prompt' field (default: shipped set)")
    s.add_argument("--max-new-tokens", type=_positive_int, default=128)
    s.add_argument("--methods", default="target,lookup,lookup:fixed,edgespec",
                   help="comma list of target, lookup, edgespec; a :POLICY suffix sets that "
                        "entry's draft-length policy (otherwise --policy, for lookup too)")
    s.add_argument("--threads", type=_positive_int, default=None)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--limit", type=_positive_int, default=None, help="use the first N prompts (with --workload: of each kind)")
    s.add_argument("--device", default=None, help="apply a device profile (see `edgespec devices`)")
    s.add_argument("--json", default=None, help="write the full report here")
    s.add_argument("--plot", default=None, help="draw tokens/s and acceptance to this PNG")
    s.add_argument("--baseline", default=None,
                   help="a file of the same target (e.g. the shipped GGUF) decoded target-only "
                        "with llama.cpp's full LM head in the same run; speedups against it are "
                        "reported too")
    s.add_argument("--peers", nargs="+", choices=["llama-server"], default=None,
                   help="add stock llama.cpp rows: llama-server's plain decoding and its own "
                        "speculation (ngram-simple, ngram-mod, ngram-map-k) on the same prompts; "
                        "needs `make llama-tools`")
    s.add_argument("--peer-eagle3", default=None, metavar="GGUF",
                   help="with --peers llama-server: also run llama-server --spec-type "
                        "draft-eagle3 with this EAGLE-3 head (`edgespec export llama-cpp`)")
    s.add_argument("--background-load", type=int, default=0, metavar="N",
                   help="run N CPU-hogging processes during the timed runs (after the warm-up)")
    s.add_argument("--no-memory", action="store_true",
                   help="skip the peak-memory measurement (a fresh process per configuration)")


def _cmd_bench_serve(args) -> int:
    from edgespec.measure import bench as b
    from edgespec.measure.serve_bench import bench_serve, format_serve
    from edgespec.prompts import DEFAULT_PROMPTS, read_prompts

    try:
        clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        raise EdgespecError(f"--clients takes counts like 1,2,4,8, not '{args.clients}'") from None
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    known = {"edgespec", "edgespec:none", "llama-server", "llama-server:ngram-simple",
             "llama-server:ngram-mod", "llama-server:ngram-map-k"}
    bad = [s for s in servers if s not in known]
    if bad:
        raise EdgespecError(f"unknown server '{bad[0]}'; choose from {', '.join(sorted(known))}")
    if any(s.startswith("llama-server") for s in servers):
        from edgespec.measure.peers import find_tool

        find_tool("llama-server")
    prompts = read_prompts(args.prompts or DEFAULT_PROMPTS)
    if args.json:
        b.ensure_new(args.json)
    report = bench_serve(args.target, prompts, clients, servers, per_client=args.requests_per_client,
                         max_tokens=args.max_tokens, n_ctx=args.n_ctx, threads=args.threads,
                         rounds=args.rounds)
    print(format_serve(report))
    if args.json:
        b.write_report(report, args.json)
        print(f"report written to {args.json}", file=sys.stderr)
    if args.plot:
        from edgespec.measure.serve_bench import plot_serve

        plot_serve(report, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _args_bench_serve(s) -> None:
    s.add_argument("--target", required=True)
    s.add_argument("--clients", default="1,2,4,8")
    s.add_argument("--servers", default="edgespec,edgespec:none,llama-server,llama-server:ngram-mod",
                   help="comma-separated: edgespec, edgespec:none, llama-server, "
                        "llama-server:ngram-simple|ngram-mod|ngram-map-k")
    s.add_argument("--requests-per-client", type=_positive_int, default=2,
                   help="requests each client sends in turn, per round")
    s.add_argument("--rounds", type=_positive_int, default=2,
                   help="passes over every client count, the servers' order reversed each time")
    s.add_argument("--max-tokens", type=_positive_int, default=64)
    s.add_argument("--n-ctx", type=_positive_int, default=2048, help="context per sequence")
    s.add_argument("--threads", type=_positive_int, default=None)
    s.add_argument("--prompts", default=None)
    s.add_argument("--json", default=None)
    s.add_argument("--plot", default=None, help="PNG: total tok/s and TTFT against clients")


def _cmd_build_llama_lib(args) -> int:
    from edgespec.llama_lib import build

    folder = build(log=lambda m: print(f"edgespec: {m}", file=sys.stderr))
    print(folder)
    return 0


def _args_build_llama_lib(s) -> None:
    pass


def _cmd_devices(args) -> int:
    from edgespec.devices import load_profiles

    profiles = load_profiles()
    if args.json:
        print(json.dumps(profiles, indent=1))
        return 0
    for p in profiles.values():
        c = p["cores"]
        print(f"{p['name']:20s} {c['big']}+{c['mid']}+{c['little']} cores, {p['threads']} threads, "
              f"{p['ram_gb']} GB x {p['app_memory_share']:.0%}, {p['memory_bandwidth_gbs']} GB/s, "
              f"{p['onnx_execution_provider']}  ({p['title']})")
    return 0


def _args_devices(s) -> None:
    s.add_argument("--json", action="store_true")


def _cmd_plan(args) -> int:
    from edgespec.devices import plan_target

    r = plan_target(args.device, args.target, draft=args.draft, context=args.context,
                    mean_accepted=args.mean_accepted, bench=args.bench, draft_len=args.k)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    m = r["memory_mb"]
    print(f"{r['title']}: target {m['target']} MB + head {m['head']} MB + KV {m['kv_cache']} MB "
          f"(context {r['context']}) = {m['total']} MB of a {m['budget']} MB budget: "
          f"{'fits' if r['fits'] else 'DOES NOT FIT'}")
    line = f"bandwidth-bound decode: target-only ~{r['target_only_tokens_per_s']} tok/s"
    if "speculative_tokens_per_s" in r:
        line += (f", speculative ~{r['speculative_tokens_per_s']} tok/s ({r['speedup']:.2f}x at "
                 f"{r['mean_accepted']:.2f} tokens per pass, k={r['draft_len']})")
    print(line + f"  [estimate: {r['bandwidth_efficiency']:.0%} of theoretical bandwidth]")
    return 0


def _args_plan(s) -> None:
    s.add_argument("--device", required=True)
    s.add_argument("--target", required=True)
    s.add_argument("--draft", default=None,
                   help="'default' (the shipped head), a head .onnx/.gguf file or checkpoint folder")
    s.add_argument("--context", type=_positive_int, default=4096)
    s.add_argument("--mean-accepted", type=float, default=None, help="tokens per verify pass")
    s.add_argument("--bench", default=None, help="take mean accepted from a bench JSON")
    s.add_argument("-k", "--k", type=_positive_int, default=4)
    s.add_argument("--json", action="store_true")


def _is_shared_kv(ckpt: str) -> bool:
    from edgespec.runtime.drafters import reads_kv

    return Path(ckpt).is_dir() and reads_kv(ckpt)


def _cmd_export(args) -> int:
    if args.kind == "target":
        from edgespec.exporters.target import export_target

        quant = args.quant.upper() if args.quant else None
        r = export_target(args.source, args.out, threads=args.threads, check=not args.no_check,
                          mode=args.mode, quant=quant,
                          head_type=args.head_type or (None if quant else "Q4_0"))
    elif args.kind == "onnx-target":
        from edgespec.exporters.onnx_target import export_onnx_target

        r = export_onnx_target(args.source, args.out, quant=args.quant or "int8",
                               check=not args.no_check, log=lambda m: print(m, file=sys.stderr),
                               lm_head=args.lm_head, rank=args.rank, candidates=args.candidates)
    elif args.kind == "lowrank-basis":
        from edgespec.exporters.lowrank_basis import export_lowrank_basis

        r = export_lowrank_basis(args.source, args.out, rank=args.rank, check=not args.no_check,
                                 threads=args.threads, log=lambda m: print(m, file=sys.stderr))
    elif args.kind == "llama-cpp" and _is_shared_kv(args.source):
        from edgespec.exporters.gemma4_assistant import check_assistant_export, write_assistant_gguf

        if args.check and not args.features:
            raise EdgespecError("--check needs --features DIR (held-out features with --kv)")
        r = write_assistant_gguf(args.source, args.out, quant=args.quant or "q8_0")
        if args.check:
            r["check"] = check_assistant_export(args.source, args.out, args.features)
    elif args.kind == "llama-cpp":
        from edgespec.exporters.eagle3_gguf import check_eagle3_export, write_eagle3_gguf

        if args.check and not args.features:
            raise EdgespecError("--check needs --features DIR (held-out features with --layers)")
        r = write_eagle3_gguf(args.source, args.out, quant=args.quant or "q8_0")
        if args.check:
            r["check"] = check_eagle3_export(args.source, args.out, args.features)
    elif args.kind == "speculators":
        from edgespec.exporters.speculators import check_speculators_export, write_speculators

        if args.check and not args.features:
            raise EdgespecError("--check needs --features DIR (held-out features with --layers)")
        r = write_speculators(args.source, args.out, verifier=args.verifier,
                              dtype=args.dtype or "float32")
        if args.check:
            r["check"] = check_speculators_export(args.source, args.out, args.features)
    elif args.kind in ("gguf", "onnx"):
        from edgespec.exporters.check import check_head_export

        if args.check and not args.features:
            raise EdgespecError("--check needs --features DIR (recorded inputs)")
        if args.kind == "gguf":
            from edgespec.exporters.gguf_head import write_head_gguf

            r = write_head_gguf(args.source, args.out, quant=args.quant or "q8_0")
        else:
            from edgespec.exporters.onnx_head import write_head_onnx

            r = write_head_onnx(args.source, args.out, quant=args.quant or "int8")
        if args.check:
            r["check"] = check_head_export(args.source, args.out, args.features)
    else:
        raise EdgespecError(f"unknown export kind {args.kind}")
    if args.json:
        print(json.dumps(r, indent=1))
    else:
        for k, v in r.items():
            print(f"{k:22s} {v}")
    return 0


def _args_export(s) -> None:
    s.add_argument("kind", choices=["gguf", "onnx", "llama-cpp", "speculators", "target",
                                    "onnx-target", "lowrank-basis"])
    s.add_argument("source", help="head checkpoint folder, or a target for `target`")
    s.add_argument("--out", required=True)
    s.add_argument("--quant", default=None, help="gguf: f16, q8_0 (default), q4_0; llama-cpp: f16, "
                   "q8_0 (default); onnx, onnx-target: fp32, int8 (default), int4; target: "
                   "re-quantize the trunk's weights to Q4_0, Q5_0, Q8_0 or IQ4_NL (types "
                   "llama.cpp batches well on CPUs; the LM head keeps its type)")
    s.add_argument("--head-type", default=None, help="target: LM head tensor type (default Q4_0)")
    s.add_argument("--verifier", default=None,
                   help="speculators: the target's Hugging Face id or path for vLLM (default: "
                        "the repository the target's GGUF names, else its name)")
    s.add_argument("--dtype", default=None, choices=["float32", "float16"],
                   help="speculators: weight type (default float32)")
    s.add_argument("--mode", default="untie", choices=["untie", "requantize"],
                   help="target: add a separate LM head (default) or re-quantize the tied one")
    s.add_argument("--lm-head", default="lowrank", choices=["lowrank", "full"],
                   help="onnx-target: greedy decoding takes the top logit from a low-rank "
                        "candidate search rescored exactly (default), or computes every logit")
    s.add_argument("--rank", type=_positive_int, default=256,
                   help="onnx-target, lowrank-basis: low-rank LM head rank")
    s.add_argument("--candidates", type=_positive_int, default=64,
                   help="onnx-target: candidates per position rescored exactly")
    s.add_argument("--check", action="store_true", help="check the export against the trained head")
    s.add_argument("--no-check", action="store_true",
                   help="target, onnx-target, lowrank-basis: skip the cost/agreement report")
    s.add_argument("--features", default=None, help="recorded inputs for --check")
    s.add_argument("--threads", type=_positive_int, default=None)
    s.add_argument("--json", action="store_true")


def _positive_int(v: str) -> int:
    return int_at_least(v, 1)


def _nonneg_int(v: str) -> int:
    return int_at_least(v, 0)


def _positive_float(v: str) -> float:
    import argparse
    import math

    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{v}'") from None
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {v}")
    return x


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like every other bad input
        print(f"edgespec: error: {message} (see: {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


COMMANDS = [  # (name, help, arguments, handler), in the order `--help` lists them
    ("info", "show a target's spec read from its GGUF metadata", _args_info, _cmd_info),
    ("generate", "generate text from a prompt, streaming", _args_generate, _cmd_generate),
    ("chat", "interactive streaming chat in the terminal", _args_chat, _cmd_chat),
    ("serve", "an OpenAI-compatible HTTP server with a chat page", _args_serve, _cmd_serve),
    ("bench-serve", "servers under 1, 2, 4, ... concurrent clients: edgespec serve and stock "
     "llama-server", _args_bench_serve, _cmd_bench_serve),
    ("bench", "tokens/s and acceptance: target-only vs lookup vs heads", _args_bench, _cmd_bench),
    ("export", "export a head (gguf, onnx; an EAGLE-3 head for stock llama.cpp: llama-cpp, for "
     "vLLM: speculators), a verify-friendly target (target, onnx-target) or a low-rank LM head "
     "basis (lowrank-basis)", _args_export, _cmd_export),
    ("build-llama-lib", "build llama.cpp's batch-invariant library once (bit-exact speculative "
     "greedy decoding); prints its folder", _args_build_llama_lib, _cmd_build_llama_lib),
    ("devices", "list the device profiles", _args_devices, _cmd_devices),
    ("plan", "memory fit and speed estimate for a device", _args_plan, _cmd_plan),
    ("data", "have the target write training text from prompt sources", _args_data, _cmd_data),
    ("extract", "store the target's hidden states for the data", _args_extract, _cmd_extract),
    ("train", "train a draft head (MTP or EAGLE-3) on stored hidden states", _args_train,
     _cmd_train),
    ("eval-head", "offline acceptance of a head on held-out features", _args_eval_head,
     _cmd_eval_head),
]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="edgespec", description="Speculative decoding for CPUs and phones.")
    p.add_argument("--version", action="version", version=f"edgespec {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, text, add_args, handler in COMMANDS:
        s = sub.add_parser(name, help=text)
        add_args(s)
        s.set_defaults(func=handler)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EdgespecError as e:
        print(f"edgespec: error: {one_line(e)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("edgespec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
