"""Stock llama.cpp's tools, built by `make llama-tools` from the llama.cpp that llama-cpp-python
vendors, as the peer in the bench. `make test` builds them and points EDGESPEC_LLAMA_TOOLS at
them; a bare `pytest` without that variable skips these tests."""

import json
import os
import subprocess
import sys
import time

import pytest

from edgespec.errors import EdgespecError

pytestmark = pytest.mark.integration

TOOLS = os.environ.get("EDGESPEC_LLAMA_TOOLS")
needs_tools = pytest.mark.skipif(not TOOLS, reason="EDGESPEC_LLAMA_TOOLS not set (make test builds the tools)")


@needs_tools
def test_the_tools_are_built_from_the_bindings_llama_cpp():
    from edgespec.measure.peers import TOOLS as NAMES, find_tool

    for name in NAMES:
        path = find_tool(name)
        assert os.access(path, os.X_OK)
    out = subprocess.run([str(find_tool("llama-server")), "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and "version" in (out.stdout + out.stderr).lower()


def test_a_missing_tool_says_how_to_build_it(tmp_path, monkeypatch):
    from edgespec.measure.peers import find_tool

    monkeypatch.setenv("EDGESPEC_LLAMA_TOOLS", str(tmp_path))
    with pytest.raises(EdgespecError, match="make llama-tools"):
        find_tool("llama-server")


@needs_tools
def test_llama_server_decodes_the_prompt_tokens_greedily_as_llama_cpp_does():
    """The server, started as the bench starts it, continues the same prompt tokens: its greedy
    text begins as edgespec's target-only greedy text on SmolLM2 (same llama.cpp; the prompt is
    split into batches differently, so near-ties further on may differ), and its own n-gram
    speculation reports drafts."""
    from edgespec.measure.peers import SERVER_CONFIGS, LlamaServer
    from edgespec.runtime.decoding import Generation
    from edgespec.runtime.generate import open_target
    from edgespec.runtime.sampling import SamplingParams

    eng = open_target("smollm2-135m", n_ctx=1024, lm_head="full")
    ids = eng.tokenize("1 2 3 4 5 6 7 8 9 10\n" * 4 + "1 2 3")
    g = Generation(eng, ids, SamplingParams(), max_tokens=24)
    ours = [t for t, _ in g]
    with LlamaServer(eng.model_file, [], eng.n_threads, 1024) as srv:
        plain = srv.complete(ids, 24, 0.0, 0)
    with LlamaServer(eng.model_file, SERVER_CONFIGS["ngram-map-k"], eng.n_threads, 1024) as srv:
        spec = srv.complete(ids, 24, 0.0, 0)
        time.sleep(0.5)
        counters = srv.spec_counters()
    eng.close()
    assert plain["tokens"] == len(plain["token_ids"]) > 0 and plain["decode_s"] > 0
    assert plain["token_ids"][:6] == ours[:6]
    assert spec["token_ids"][:8] == plain["token_ids"][:8]
    assert counters["draft_n"] > 0 and counters["draft_n_accepted"] > 0  # the lines repeat


@needs_tools
def test_bench_with_llama_server_peers(tmp_path):
    out = tmp_path / "peers.json"
    res = subprocess.run([sys.executable, "-m", "edgespec", "bench", "--target", "smollm2-135m",
                          "--limit", "2", "--max-new-tokens", "16", "--methods", "target,lookup",
                          "--no-memory", "--peers", "llama-server", "--json", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    srv = json.loads(out.read_text())["peers"]["llama-server"]
    assert list(srv["configs"]) == ["none", "ngram-simple", "ngram-mod", "ngram-map-k"]
    assert srv["rounds"] == 2 and srv["best_speculative"] in srv["configs"]
    for c in srv["configs"].values():
        assert c["tokens_per_s"] > 0 and len(c["per_prompt"]) == 2
        assert c["speedup_vs_edgespec_target"] > 0 and 0 <= c["same_as_server_plain_share"] <= 1
    assert srv["configs"]["none"]["speedup_vs_server_plain"] == 1.0
    assert set(srv["methods_vs_best"]) == {"target", "lookup"}
    assert "stock llama-server" in res.stdout


@needs_tools
def test_bench_serve_loads_edgespec_and_llama_server_with_concurrent_clients(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in (
        "def add(a, b):", "The capital of France is", "Once upon a time", "import numpy as np")) + "\n")
    out = tmp_path / "serve.json"
    res = subprocess.run([sys.executable, "-m", "edgespec", "bench-serve", "--target", "smollm2-135m",
                          "--clients", "1,2", "--servers", "edgespec,llama-server",
                          "--requests-per-client", "1", "--max-tokens", "12", "--n-ctx", "512",
                          "--prompts", str(prompts), "--json", str(out)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert list(rep["servers"]) == ["edgespec", "llama-server"]
    for phases in rep["servers"].values():
        assert [p["clients"] for p in phases] == [1, 2]
        assert [p["requests"] for p in phases] == [1, 2]
        for p in phases:
            assert 0 < p["tokens"] <= 12 * p["requests"] and p["total_tok_s"] > 0
            assert 0 < p["ttft_p50_ms"] <= p["ttft_p95_ms"]
    bad = subprocess.run([sys.executable, "-m", "edgespec", "bench-serve", "--target", "smollm2-135m",
                          "--servers", "vllm"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown server 'vllm'" in bad.stderr
