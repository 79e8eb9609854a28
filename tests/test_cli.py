"""The CLI's contract for bad input: one line on stderr, exit code 2, no traceback."""

import subprocess
import sys

import pytest

from test_targets import write_tiny_gguf


def edgespec(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True,
                          text=True, timeout=timeout)


def assert_usage_error(res, needle):
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert needle in lines[0], lines[0]


def test_bad_inputs(tmp_path):
    good = write_tiny_gguf(tmp_path / "t.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-40])
    junk = tmp_path / "junk.gguf"
    junk.write_text("not a model\n" * 10)
    mamba = write_tiny_gguf(tmp_path / "m.gguf", arch="mamba")
    assert_usage_error(edgespec("info", str(tmp_path / "nope.gguf")), "no such file")
    assert_usage_error(edgespec("info", str(junk)), "not a GGUF")
    assert_usage_error(edgespec("info", str(cut)), "truncated")
    assert_usage_error(edgespec("info", str(mamba)), "not supported")
    assert_usage_error(edgespec("info", "gemma-9000"), "unknown target")
    assert_usage_error(edgespec("generate", "--target", str(cut), "--prompt", "hi"), "truncated")
    assert_usage_error(edgespec("generate", "--target", str(good), "--prompt", ""), "empty prompt")
    assert_usage_error(edgespec("generate", "--target", str(good), "--prompt", "x",
                                "--temperature", "-1"), "temperature")
    assert_usage_error(edgespec("generate", "--target", str(good), "--prompt", "x",
                                "--max-tokens", "0"), "max-tokens")
    assert_usage_error(edgespec("generate", "--target", str(good), "--prompt", "x", "-k", "0"), "-k")
    for flag, value, needle in (("--temperature", "-1", "temperature"), ("--top-k", "-1", "top_k"),
                                ("--top-p", "0", "top_p"), ("--min-p", "1.5", "min_p"),
                                ("--repeat-penalty", "0", "repeat_penalty")):
        # sampling values are checked before the model loads (the tiny file would not chat)
        assert_usage_error(edgespec("chat", "--target", str(good), flag, value), needle)
    assert_usage_error(edgespec("generate", "--target", str(good), "--prompt", "x",
                                "--min-p", "-0.1"), "min_p")
    assert_usage_error(edgespec("frobnicate"), "invalid choice")
    for flag, value in (("--lr", "0"), ("--muon-lr", "-0.01"), ("--muon-lr", "inf")):
        assert_usage_error(edgespec("train", "--target", str(good), "--features", str(tmp_path),
                                    "--out", str(tmp_path / "h"), flag, value), "expected a number > 0")
    assert not (tmp_path / "h").exists()
    assert_usage_error(edgespec("export", "onnx", str(tmp_path), "--quant", "int3", "--out",
                                str(tmp_path / "h.onnx")), "unknown --quant")
    assert_usage_error(edgespec("export", "onnx-target", str(good), "--quant", "q2", "--out",
                                str(tmp_path / "t")), "unknown --quant")


def test_info_json_on_tiny_file(tmp_path):
    import json

    res = edgespec("info", str(write_tiny_gguf(tmp_path / "t.gguf", n_layer=6)), "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["n_layer"] == 6 and d["layer_types"][-1] == "global" and d["sliding_window"] == 8


@pytest.mark.integration
def test_info_gemma_json():
    import json

    res = edgespec("info", "gemma3-270m", "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["arch"] == "gemma3" and d["n_layer"] == 18 and d["n_embd"] == 640
    assert d["n_vocab"] == 262144 and d["sliding_window"] == 512
    assert [i for i, t in enumerate(d["layer_types"]) if t == "global"] == [5, 11, 17]
    assert set(d["layer_types"]) == {"sliding", "global"}


@pytest.mark.integration
def test_generate_gemma_json():
    import json

    res = edgespec("generate", "--target", "gemma3-270m", "--prompt", "The capital of France is",
                   "--max-tokens", "8", "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["tokens"] == 8 and len(d["token_ids"]) == 8 and d["text"].strip()
    assert d["tokens_per_s"] > 0 and d["mean_accepted"] == 1.0


@pytest.mark.integration
def test_top_k_beyond_the_vocabulary_is_a_usage_error():
    """SmolLM2 has 49,152 tokens: --top-k 60000 is a typo, for generate and for chat alike."""
    assert_usage_error(edgespec("generate", "--target", "smollm2-135m", "--prompt", "x",
                                "--temperature", "0.8", "--top-k", "60000"), "vocabulary (49152 tokens)")
    res = subprocess.run([sys.executable, "-m", "edgespec", "chat", "--target", "smollm2-135m",
                          "--top-k", "60000"], input="hello\n", capture_output=True, text=True, timeout=300)
    assert_usage_error(res, "vocabulary (49152 tokens)")
    assert not res.stdout


@pytest.mark.integration
def test_heads_are_checked_against_their_target(tmp_path):
    from edgespec.runtime.assets import HEADS_DIR

    for ext in ("gguf", "onnx"):
        gemma_head = next(HEADS_DIR.glob(f"gemma3-270m/*.{ext}"))
        res = edgespec("generate", "--target", "smollm2-135m", "--prompt", "hi", "--draft", str(gemma_head))
        assert_usage_error(res, "trained for target")
    assert_usage_error(edgespec("generate", "--target", "gemma3-270m", "--prompt", "hi",
                                "--draft", str(tmp_path)), "not a head checkpoint")


@pytest.mark.integration
def test_generate_with_default_head_and_bench(tmp_path):
    import json

    res = edgespec("generate", "--target", "gemma3-270m", "--prompt", "def add(a, b):",
                   "--max-tokens", "12", "--draft", "default", "--compare", "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["tokens"] == 12 and d["draft"].endswith(".onnx+lookup") and d["draft_policy"] == "cost"
    # every pass emits its accepted drafts plus one token of the target's own
    assert d["tokens"] == d["accepted"] + d["verify_passes"]
    assert d["mean_accepted"] == pytest.approx(d["tokens"] / d["verify_passes"], abs=1e-4)
    assert d["speedup"] == pytest.approx(d["tokens_per_s"] / d["target_only_tokens_per_s"], rel=1e-2)
    assert isinstance(d["same_as_target"], bool) and "rank-256 search" in d["lm_head"]
    out = tmp_path / "b.json"
    res = edgespec("bench", "--target", "gemma3-270m", "--limit", "2", "--max-new-tokens", "8",
                   "--baseline", "gemma3-270m", "--json", str(out))
    assert res.returncode == 0, res.stderr
    rep = json.loads(out.read_text())
    # greedy rows take the low-rank LM head by default: "target" is plain llama.cpp on the same
    # file (every speedup's reference), "target:lowrank" the drafters' engine without drafting
    assert list(rep["methods"]) == ["target", "target:lowrank", "lookup", "lookup:fixed", "edgespec",
                                    "baseline"]
    pol = {m["name"]: m["policy"] for m in rep["settings"]["methods"]}
    assert pol["lookup"] == pol["edgespec"] == "cost" and pol["lookup:fixed"] == "fixed"
    assert "rank-256 search" in rep["target"]["lm_head_type"]
    # every greedy method of the low-rank engine says, per prompt, why its text differs (if it does)
    for name in ("target:lowrank", "lookup", "lookup:fixed", "edgespec"):
        why = rep["methods"][name]["divergence"]
        assert sum(why["counts"].values()) == 2 and len(why["per_prompt"]) == 2
        assert set(why["counts"]) <= {"same", "batch numerics", "lm head", "length", "reference not reproduced"}
    assert "divergence" not in rep["methods"]["target"]
    mem = rep["memory"]  # each configuration in its own process, against plain llama.cpp's
    assert mem["plain_llama_cpp_peak_rss_mb"] > 100
    assert set(mem["methods"]) == {"target:lowrank", "lookup", "lookup:fixed", "edgespec"}
    assert mem["methods"]["lookup"] == mem["methods"]["lookup:fixed"]  # one configuration
    assert mem["methods"]["edgespec"]["peak_rss_mb"] > mem["plain_llama_cpp_peak_rss_mb"]
    assert "vs baseline" in res.stdout
    assert rep["methods"]["baseline"]["same_as_target_share"] == 1.0  # the same file, greedy
    assert rep["methods"]["target"]["tokens"] == 16 and rep["machine"]["threads"] >= 1
    # every ratio is the one its raw figures give: per prompt (median) and in total
    import statistics

    rate = lambda r: r["tokens"] / r["decode_s"]  # noqa: E731
    ms = rep["methods"]
    for m in ms.values():
        for ref, med, tot in ((ms["target"], "speedup", "speedup_total"),
                              (ms["baseline"], "speedup_vs_baseline", "speedup_total_vs_baseline")):
            assert m[tot] == pytest.approx(rate(m) / rate(ref), abs=2e-3)
            assert m[med] == pytest.approx(statistics.median(
                rate(a) / rate(b) for a, b in zip(m["per_prompt"], ref["per_prompt"])), abs=2e-3)
    assert_usage_error(edgespec("bench", "--target", "gemma3-270m", "--limit", "1", "--json", str(out)),
                       "never overwritten")
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"oops": 1}\n')
    assert_usage_error(edgespec("bench", "--target", "gemma3-270m", "--prompts", str(bad)), "p.jsonl:2")
    assert_usage_error(edgespec("bench", "--target", "gemma3-270m", "--device", "toaster"), "unknown device")
    assert_usage_error(edgespec("bench", "--target", "gemma3-270m", "--baseline", "smollm2-135m",
                                "--limit", "1"), "not a file of target")
    assert_usage_error(edgespec("bench", "--workload", "verify-friendly", "--copy-quant", "Q3_K"),
                       "unknown --copy-quant Q3_K")
    assert_usage_error(edgespec("bench", "--workload", "defaults", "--only", "phi-9"), "no row of workload")
    assert_usage_error(edgespec("bench", "--target", "gemma3-270m", "--only", "smollm2"), "give --workload")
    assert_usage_error(edgespec("bench", "--workload", "defaults", "--only", "smollm2",
                                "--draft", "none", "--draft", "none"), "distinct --draft")


@pytest.mark.integration
def test_bad_text_seed_and_cache_faults(tmp_path):
    """A prompt that is not UTF-8 is a clear error; --seed -1 means random (llama.cpp's rule);
    a cache that cannot be written falls back to llama.cpp's full LM head with a warning."""
    import json
    import os

    res = subprocess.run([sys.executable, "-m", "edgespec", "generate", "--target", "gemma3-270m",
                          "--prompt", b"caf\xe9 au lait", "--max-tokens", "2"], capture_output=True, text=True)
    assert_usage_error(res, "not valid UTF-8")
    res = edgespec("generate", "--target", "gemma3-270m", "--prompt", "Once upon a time", "--max-tokens",
                   "4", "--temperature", "0.8", "--seed", "-1", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["tokens"] == 4
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    env = dict(os.environ, EDGESPEC_CACHE=str(blocker / "cache"))
    res = subprocess.run([sys.executable, "-m", "edgespec", "generate", "--target", str(_gemma_path()),
                          "--prompt", "The capital of France is", "--max-tokens", "4", "--json"],
                         capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert "warning" in res.stderr and "full LM head instead" in res.stderr
    assert json.loads(res.stdout)["lm_head"] == "Q8_0"  # no low-rank search, no batched head


def _gemma_path():
    from edgespec.targets import resolve_target

    return resolve_target("gemma3-270m")
