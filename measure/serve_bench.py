"""`edgespec bench-serve`: servers under concurrent clients, edgespec's and stock llama.cpp's.

    edgespec bench-serve --target gemma3-270m --clients 1,2,4,8 --json results/serve.json

Every server is started on a free local port (all at once: an idle server takes no CPU) and
loaded with 1, 2, 4, ... clients at once, interleaved: at each client count each server in
turn, the order reversed in alternate rounds. Each client sends its share of the bench prompts
one after another (streamed; prompt tokens as every server gets them; greedy; the same
new-token budget). Per server and client count: total
generated tokens over the wall time of that phase (total tok/s), time to first token (p50, p95)
and each request's own generation speed (tokens over the time from its first token to its last,
median). Servers (N = the most clients): `edgespec serve --parallel N` with the default drafter
and without drafting, and stock `llama-server --parallel N` plain and with its own n-gram
speculation; each slot gets n_ctx tokens of context.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

from edgespec.errors import EdgespecError
from edgespec.measure.peers import SERVER_CONFIGS, ServerProcess, find_tool, free_port


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return 0.0
    i = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[i]


def _stream(url: str, body: dict, parse) -> dict:
    """POST and read a server-sent event stream; `parse(event)` -> (new text?, tokens or None
    when the event is the last); returns timings of the request."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    with urllib.request.urlopen(req, timeout=900) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise EdgespecError(f"server error: {ev['error']}")
            text, n = parse(ev)
            now = time.perf_counter()
            if text and first is None:
                first = now
            if text:
                last = now
            if n is not None:
                tokens = n
    end = time.perf_counter()
    first = first or end
    return {"ttft_s": first - t0, "total_s": end - t0, "tokens": tokens,
            "gen_tok_s": (tokens - 1) / (last - first) if last and last > first and tokens > 1 else 0.0}


def _edgespec_parse(ev: dict):
    text = (ev.get("choices") or [{}])[0].get("text") or ""
    sp = ev.get("speculative")
    return text, (int(sp["tokens"]) if sp else None)


def _llama_parse(ev: dict):
    text = ev.get("content") or ""
    t = ev.get("timings")
    return text, (int(t["predicted_n"]) if ev.get("stop") and t else None)


class _Server(ServerProcess):
    """A started server whose `request(ids, max_tokens)` streams one completion from `path`."""

    def __init__(self, name: str, cmd: list[str], port: int, path: str, body, parse, env=None):
        self.path, self.body, self.parse = path, body, parse
        super().__init__(name, cmd, port, env=env)

    def request(self, ids: list[int], max_tokens: int) -> dict:
        return _stream(self.url + self.path, self.body(ids, max_tokens), self.parse)


def _start(kind: str, target_arg: str, model_file: Path, n_ctx: int, threads: int, slots: int) -> _Server:
    port = free_port()
    if kind.startswith("edgespec"):
        draft = "none" if kind == "edgespec:none" else "default"
        cmd = [sys.executable, "-m", "edgespec", "serve", "--target", target_arg, "--draft", draft,
               "--port", str(port), "--n-ctx", str(n_ctx), "--threads", str(threads),
               "--max-queue", "64", "--parallel", str(slots)]
        body = lambda ids, n: {"prompt": ids, "max_tokens": n, "temperature": 0.0, "stream": True}  # noqa: E731
        return _Server(kind, cmd, port, "/v1/completions", body, _edgespec_parse,
                       env=dict(os.environ, EDGESPEC_NO_PROGRESS="1"))
    spec = kind.split(":", 1)[1] if ":" in kind else "none"
    cmd = [str(find_tool("llama-server")), "-m", str(model_file), "-t", str(threads), "-tb", str(threads),
           "-c", str(n_ctx * slots), "-np", str(slots), "--host", "127.0.0.1", "--port", str(port),
           "--no-webui", *SERVER_CONFIGS[spec]]
    body = lambda ids, n: {"prompt": ids, "n_predict": n, "temperature": 0.0, "samplers": ["temperature"],  # noqa: E731
                           "cache_prompt": False, "stream": True}
    return _Server(kind, cmd, port, "/completion", body, _llama_parse)


def _phase(server: _Server, prompts: list[list[int]], clients: int, per_client: int,
           max_tokens: int) -> dict:
    """`clients` streaming clients at once, each sending `per_client` requests in turn: the
    requests' timings and the phase's wall time."""
    rows: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(per_client):
            ids = prompts[(c * per_client + r) % len(prompts)]
            try:
                row = server.request(ids, max_tokens)
            except Exception as e:  # noqa: BLE001 - reported, not raised in a thread
                with lock:
                    errors.append(str(e)[:200])
                return
            with lock:
                rows.append(row)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise EdgespecError(f"{server.name}, {clients} clients: {errors[0]}")
    return {"rows": rows, "wall_s": wall}


def _summary(clients: int, phases: list[dict]) -> dict:
    """One server at one client count over its rounds: total tokens over total wall time,
    TTFT percentiles and the median request speed over every request."""
    rows = [r for p in phases for r in p["rows"]]
    tokens, wall = sum(r["tokens"] for r in rows), sum(p["wall_s"] for p in phases)
    return {"clients": clients, "requests": len(rows), "tokens": tokens, "wall_s": round(wall, 3),
            "total_tok_s": round(tokens / wall, 3),
            "total_tok_s_by_round": [round(sum(r["tokens"] for r in p["rows"]) / p["wall_s"], 3)
                                     for p in phases],
            "ttft_p50_ms": round(1000 * statistics.median(r["ttft_s"] for r in rows), 2),
            "ttft_p95_ms": round(1000 * _pct([r["ttft_s"] for r in rows], 0.95), 2),
            "request_tok_s_median": round(statistics.median(r["gen_tok_s"] for r in rows), 3)}


def bench_serve(target: str, prompts: list[dict], clients: list[int], servers: list[str],
                per_client: int = 2, max_tokens: int = 64, n_ctx: int = 2048,
                threads: int | None = None, rounds: int = 2) -> dict:
    from edgespec.measure.bench import machine_info, prompt_ids
    from edgespec.runtime.generate import open_target

    if not clients or min(clients) < 1:
        raise EdgespecError("--clients needs positive counts, e.g. 1,2,4,8")
    if rounds < 1:
        raise EdgespecError(f"--rounds must be >= 1, got {rounds}")
    eng = open_target(target, n_ctx=n_ctx, n_threads=threads, lm_head="full")
    if eng.engine != "llama.cpp":
        raise EdgespecError("bench-serve runs GGUF targets")
    ids = prompt_ids(prompts, eng, max_tokens, n_ctx)
    model_file, n_threads, name = eng.model_file, eng.n_threads, eng.spec.name
    warm = eng.tokenize("Warm-up: the quick brown fox jumps over the lazy dog.")
    eng.close()
    started: dict[str, _Server] = {}
    raw: dict[str, dict[int, list[dict]]] = {k: {c: [] for c in clients} for k in servers}
    try:
        for kind in servers:  # every server up (idle ones take no CPU), each warmed once
            started[kind] = _start(kind, target, model_file, n_ctx, n_threads, max(clients))
            started[kind].request(warm, 16)
        # interleaved: at each client count every server in turn, the order reversed in
        # alternate rounds, so a machine that gets busier or quieter meets them all alike
        for r in range(rounds):
            for i, c in enumerate(clients):
                for kind in (servers if (r + i) % 2 == 0 else servers[::-1]):
                    raw[kind][c].append(_phase(started[kind], ids, c, per_client, max_tokens))
    finally:
        for srv in started.values():
            srv.close()
    commands = {k: [Path(c).name if i == 0 else c for i, c in enumerate(srv.cmd)]
                for k, srv in started.items()}
    out = {k: [_summary(c, raw[k][c]) for c in clients] for k in servers}
    return {"target": {"name": name, "file": Path(model_file).name}, "servers": out,
            "commands": commands,
            "settings": {"clients": clients, "slots": max(clients), "requests_per_client": per_client,
                         "rounds": rounds, "max_tokens": max_tokens,
                         "n_ctx_per_slot": n_ctx, "prompts": len(prompts), "temperature": 0.0},
            "machine": machine_info(n_threads)}


def format_serve(report: dict) -> str:
    rows = [("server", "clients", "total tok/s", "TTFT p50 ms", "TTFT p95 ms", "request tok/s (median)")]
    for name, phases in report["servers"].items():
        for p in phases:
            rows.append((name, str(p["clients"]), f"{p['total_tok_s']:.1f}", f"{p['ttft_p50_ms']:.0f}",
                         f"{p['ttft_p95_ms']:.0f}", f"{p['request_tok_s_median']:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(f"machine: {report['machine']['cpu']}, {report['machine']['threads']} threads")
    return "\n".join(lines)


def plot_serve(report: dict, out: str | Path) -> None:
    """Total tok/s and time to first token (p50) against concurrent clients, one line per server."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EdgespecError("--plot needs matplotlib: pip install 'edgespec[plot]'") from None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, phases in report["servers"].items():
        xs = [p["clients"] for p in phases]
        a.plot(xs, [p["total_tok_s"] for p in phases], marker="o", label=name)
        b.plot(xs, [p["ttft_p50_ms"] for p in phases], marker="o", label=name)
    for ax, label in ((a, "total tokens/s"), (b, "time to first token, p50 (ms)")):
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["settings"]["clients"], [str(c) for c in report["settings"]["clients"]])
    a.set_title(report["target"]["name"])
    a.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
