"""Stock llama.cpp as the peer in `edgespec bench --peers llama-server`.

The `llama-server` built from the llama.cpp that llama-cpp-python vendors (`make llama-tools`,
scripts/build_llama_tools.sh) runs the same target file, same threads, same context, on the same
prompt tokens, once per configuration: its plain decoding and its own speculation
(`--spec-type ngram-simple | ngram-mod | ngram-map-k`, each at its defaults, as a user would
start it). Each configuration is its own server process; the bench runs every configuration
once before its own interleaved runs and once after (two rounds, so drift hits all alike).
Generation speed is the server's own `timings` (prediction only, like edgespec's decode time);
the wall time of each request is kept too.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from edgespec import cache
from edgespec.errors import EdgespecError

TOOLS = ("llama-server", "llama-speculative-simple", "llama-bench",
         "llama-server-nextn")  # the last: patched gemma3 graph (scripts/patches/gemma3-nextn.patch)

# name -> extra llama-server arguments
SERVER_CONFIGS: dict[str, list[str]] = {
    "none": [],
    "ngram-simple": ["--spec-type", "ngram-simple"],
    "ngram-mod": ["--spec-type", "ngram-mod"],
    "ngram-map-k": ["--spec-type", "ngram-map-k"],
}


def server_configs(eagle3_head: str | Path | None = None) -> dict[str, list[str]]:
    """The configurations a bench runs: SERVER_CONFIGS, plus `draft-eagle3` with an EAGLE-3
    head GGUF (`edgespec export llama-cpp`) where one is given."""
    out = dict(SERVER_CONFIGS)
    if eagle3_head:
        out["draft-eagle3"] = ["-md", str(eagle3_head), "--spec-type", "draft-eagle3"]
    return out


def llama_version() -> str:
    import llama_cpp

    return llama_cpp.__version__


def tools_dir() -> Path:
    """Where `make llama-tools` put the binaries: $EDGESPEC_LLAMA_TOOLS, else the cache's
    llama-tools/<llama-cpp-python version>/bin."""
    env = os.environ.get("EDGESPEC_LLAMA_TOOLS")
    if env:
        return Path(env).expanduser()
    return cache.cache_root() / "llama-tools" / llama_version() / "bin"


def find_tool(name: str) -> Path:
    if name not in TOOLS:
        raise EdgespecError(f"unknown llama.cpp tool '{name}'; built: {', '.join(TOOLS)}")
    path = tools_dir() / name
    if not os.access(path, os.X_OK):
        raise EdgespecError(f"{name} is not built ({path}); run `make llama-tools` "
                            "(or point EDGESPEC_LLAMA_TOOLS at a folder holding it)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server process on a local port, its output in a log file, ready once its `/health`
    answers 200; a context manager that stops it (llama-server, `edgespec serve`)."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict | None = None,
                 start_timeout: float = 300.0):
        self.name, self.cmd, self.port = name, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"edgespec-server-{port}.log"
        self._log_f = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log_f, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise

    def _tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
            return lines[-1][:200] if lines else "no output"
        except OSError:
            return "no log"

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise EdgespecError(f"{self.name} exited with {self.proc.returncode} at start: "
                                    f"{self._tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.2)
        raise EdgespecError(f"{self.name} did not become ready in {timeout:.0f} s: {self._tail()}")

    def close(self) -> None:
        """Stop the process (terminate, then kill) and remove its log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_f.close()
        self.log.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LlamaServer(ServerProcess):
    """Stock `llama-server` on the target file, one slot, on a free local port (`tool`: the
    patched `llama-server-nextn` instead)."""

    def __init__(self, model: str | Path, extra: list[str], threads: int, n_ctx: int,
                 start_timeout: float = 180.0, tool: str = "llama-server"):
        port = free_port()
        super().__init__(tool, [
            str(find_tool(tool)), "-m", str(model), "-t", str(threads), "-tb", str(threads),
            "-c", str(n_ctx), "-np", "1", "--host", "127.0.0.1", "--port", str(port), "--no-webui",
            "--metrics", *extra], port, start_timeout=start_timeout)

    def complete(self, ids: list[int], n_predict: int, temperature: float, seed: int) -> dict:
        """One /completion request on prompt tokens: the server's timings, its tokens and the
        request's wall time."""
        body = {"prompt": ids, "n_predict": n_predict, "temperature": temperature, "seed": seed,
                "samplers": ["temperature"], "cache_prompt": False, "return_tokens": True,
                "stream": False}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                out = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise EdgespecError(f"llama-server request failed ({e}): {self._tail()}") from None
        wall = time.perf_counter() - t0
        t = out.get("timings") or {}
        return {"tokens": int(t.get("predicted_n", 0)), "decode_s": float(t.get("predicted_ms", 0)) / 1000,
                "prefill_s": float(t.get("prompt_ms", 0)) / 1000, "wall_s": round(wall, 5),
                "token_ids": [int(x) for x in out.get("tokens") or []]}

    def spec_counters(self) -> dict:
        """The server's speculation counters so far (its /metrics; this llama.cpp leaves them
        out of a response's timings): draft tokens, accepted ones, verify steps."""
        names = {"llamacpp:spec_decode_num_draft_tokens_total": "draft_n",
                 "llamacpp:spec_decode_num_accepted_tokens_total": "draft_n_accepted",
                 "llamacpp:spec_decode_num_drafts_total": "verify_steps"}
        out = dict.fromkeys(names.values(), 0)
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
                text = r.read().decode("utf-8", "replace")
        except (urllib.error.URLError, OSError):
            return out
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] in names:
                out[names[parts[0]]] = int(float(parts[1]))
        return out


def server_round(model: str | Path, prompts: list[list[int]], configs: dict[str, list[str]], threads: int,
                 n_ctx: int, max_new_tokens: int, temperature: float, seed: int,
                 warm: list[int]) -> dict[str, dict]:
    """Each configuration in its own server process, every prompt once; per config the rows
    and the speculation counters of the timed requests."""
    out = {}
    for name, extra in configs.items():
        with LlamaServer(model, extra, threads, n_ctx) as srv:
            srv.complete(warm, 16, temperature, seed)  # page the model in
            time.sleep(0.5)  # the counters are updated as a request's slot is released
            before = srv.spec_counters()
            rows = [srv.complete(ids, max_new_tokens, temperature, seed) for ids in prompts]
            time.sleep(0.5)
            after = srv.spec_counters()
            out[name] = {"rows": rows, "counters": {k: after[k] - before[k] for k in after},
                         "args": list(extra)}
    return out


def _tps(rows: list[dict]) -> float:
    dec = sum(r["decode_s"] for r in rows)
    return sum(r["tokens"] for r in rows) / dec if dec else 0.0


def speed_ratios(rows: list[dict], base: list[dict]) -> tuple[float, float]:
    """(median of per-prompt speed ratios, total-tokens ratio)."""
    ratios = [(r["tokens"] / r["decode_s"]) / (b["tokens"] / b["decode_s"])
              for r, b in zip(rows, base) if r["decode_s"] > 0 and b["decode_s"] > 0 and r["tokens"] and b["tokens"]]
    tb = _tps(base)
    return (round(statistics.median(ratios), 4) if ratios else 0.0), (round(_tps(rows) / tb, 4) if tb else 0.0)


def summarize_server(rounds: list[dict[str, dict]], target_rows: list[dict] | None,
                     greedy: bool) -> dict:
    """Per configuration: rounds pooled per prompt (tokens and decode time summed), tok/s,
    speedups against the server's plain decoding and against edgespec's target-only row,
    draft acceptance, and for greedy runs how often the text equals the server's plain text
    and edgespec's target-only text."""
    configs = list(rounds[0])
    pooled: dict[str, list[dict]] = {}
    for name in configs:
        per = []
        for i in range(len(rounds[0][name]["rows"])):
            rs = [r[name]["rows"][i] for r in rounds]
            per.append({"tokens": sum(r["tokens"] for r in rs), "decode_s": sum(r["decode_s"] for r in rs),
                        "wall_s": [r["wall_s"] for r in rs], "token_ids": rs[0]["token_ids"],
                        "same_over_rounds": all(r["token_ids"] == rs[0]["token_ids"] for r in rs)})
        pooled[name] = per
    out = {}
    for name, rows in pooled.items():
        med, tot = speed_ratios(rows, pooled["none"])
        cnt = {k: sum(r[name]["counters"][k] for r in rounds) for k in rounds[0][name]["counters"]}
        d = {"tokens_per_s": round(_tps(rows), 3), "speedup_vs_server_plain": med,
             "speedup_total_vs_server_plain": tot,
             "median_wall_s": round(statistics.median(w for r in rows for w in r["wall_s"]), 4),
             "draft_n": cnt["draft_n"], "draft_n_accepted": cnt["draft_n_accepted"],
             "verify_steps_with_drafts": cnt["verify_steps"],
             "draft_acceptance": round(cnt["draft_n_accepted"] / max(1, cnt["draft_n"]), 4),
             "args": rounds[0][name]["args"]}
        if target_rows is not None:
            # edgespec's target rows are one round; compare speeds per prompt
            med_t, tot_t = speed_ratios(rows, target_rows)
            d["speedup_vs_edgespec_target"], d["speedup_total_vs_edgespec_target"] = med_t, tot_t
        if greedy:
            d["same_as_server_plain_share"] = round(sum(
                r["token_ids"] == b["token_ids"] for r, b in zip(rows, pooled["none"])) / len(rows), 4)
            if target_rows is not None:
                d["same_as_edgespec_target_share"] = round(sum(
                    r["token_ids"] == t["token_ids"] for r, t in zip(rows, target_rows)) / len(rows), 4)
        d["per_prompt"] = [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]
        out[name] = d
    return out
