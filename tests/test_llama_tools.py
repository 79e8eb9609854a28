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
        deadline = time.time() + 10  # the server may publish its counters a moment later
        counters = srv.spec_counters()
        while not counters.get("draft_n") and time.time() < deadline:
            time.sleep(0.05)
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
                          "--prompts", str(prompts), "--json", str(out), "--plot", str(tmp_path / "s.png")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = json.loads(out.read_text())
    assert list(rep["servers"]) == ["edgespec", "llama-server"]
    assert rep["commands"]["edgespec"][-2:] == ["--parallel", "2"] and rep["settings"]["slots"] == 2
    for phases in rep["servers"].values():
        assert [p["clients"] for p in phases] == [1, 2]
        assert [p["requests"] for p in phases] == [2, 4]  # 2 rounds, interleaved
        for p in phases:
            assert len(p["total_tok_s_by_round"]) == 2
            assert 0 < p["tokens"] <= 12 * p["requests"] and p["total_tok_s"] > 0
            assert 0 < p["ttft_p50_ms"] <= p["ttft_p95_ms"]
    bad = subprocess.run([sys.executable, "-m", "edgespec", "bench-serve", "--target", "smollm2-135m",
                          "--servers", "vllm"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown server 'vllm'" in bad.stderr


SHIPPED_EAGLE3 = os.path.join(os.path.dirname(__file__), "..", "runtime", "heads", "smollm2-135m",
                              "eagle3-q8_0.gguf")


@needs_tools
def test_an_exported_eagle3_head_drafts_inside_stock_llama_server():
    """The shipped SmolLM2 EAGLE-3 head (trained and exported by edgespec) loads in stock
    llama-server with --spec-type draft-eagle3, its drafts get accepted, and llama.cpp's own
    acceptance equals edgespec's replay of llama.cpp's draft loop with the file's weights on the
    same text, up to llama.cpp's batch numerics."""
    from edgespec.measure.eagle3_check import eagle3_in_llama_server

    prompts = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
               "The history of the printing press begins in",
               "import os\nimport sys\n\n\ndef main(argv):\n"]
    r = eagle3_in_llama_server("smollm2-135m", SHIPPED_EAGLE3, prompts, n_predict=64)
    assert all(p["llama_drafted"] > 0 for p in r["per_prompt"]), r
    assert r["llama_acceptance"] >= 0.05, r  # a random head of this shape: 0
    assert abs(r["llama_acceptance"] - r["edgespec_acceptance"]) <= 0.1, r


@needs_tools
def test_stock_llama_cpp_cannot_run_eagle3_on_gemma3(tmp_path):
    """Why no Gemma 3 EAGLE-3 head is exported for llama.cpp: this llama.cpp's gemma3 graph never
    records its layer inputs, and draft-eagle3 aborts at the first decode. If a later pin fixes
    it, this test fails and the exporter's refusal can go."""
    import numpy as np
    import torch

    from edgespec.exporters.eagle3_gguf import write_eagle3_gguf
    from edgespec.measure.peers import find_tool
    from edgespec.targets import embedding_rows, load_target_spec
    from edgespec.training.eagle3 import Eagle3Head, default_target_layers
    from edgespec.training.train import eagle3_config_for, save_checkpoint

    spec = load_target_spec("gemma3-270m")
    ids = np.arange(0, 256 * 16, 16)
    head = Eagle3Head(eagle3_config_for(spec, len(ids), default_target_layers(spec.n_layer)))
    head.lm_head.copy_(torch.from_numpy(embedding_rows(spec)[ids]))
    save_checkpoint(tmp_path / "ck", head, {"target": spec.name, "target_path": spec.path,
                                            "target_fingerprint": spec.tokenizer_fingerprint,
                                            "draft_vocab": {"ids": ids, "size": len(ids)}})
    with pytest.raises(EdgespecError, match="cannot run an EAGLE-3 head on a gemma3 target"):
        write_eagle3_gguf(tmp_path / "ck", tmp_path / "h.gguf")
    write_eagle3_gguf(tmp_path / "ck", tmp_path / "h.gguf", any_target=True)
    r = subprocess.run([str(find_tool("llama-speculative-simple")), "-m", spec.path, "-md",
                        str(tmp_path / "h.gguf"), "--spec-type", "draft-eagle3", "-p", "Hello",
                        "-n", "4", "--temp", "0", "-t", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "layer input tensor is null" in r.stdout + r.stderr
