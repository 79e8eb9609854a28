"""Integration: the SmolLM2-135M-Instruct target (llama architecture, chat template)."""

import pytest

pytestmark = pytest.mark.integration


def test_smollm2_spec_chat_and_generation():
    from edgespec.chat import render_chat
    from edgespec.runtime.generate import generate
    from edgespec.runtime.llama_target import LlamaTarget
    from edgespec.targets import load_target_spec

    spec = load_target_spec("smollm2-135m")
    assert spec.arch == "llama" and spec.n_vocab == 49152 and spec.sliding_window is None
    assert set(spec.layer_types) == {"global"} and spec.chat_template
    prompt = render_chat(spec, [{"role": "user", "content": "Name a colour."}])
    assert "<|im_start|>user\nName a colour.<|im_end|>" in prompt
    assert prompt.rstrip().endswith("<|im_start|>assistant")
    engine = LlamaTarget("smollm2-135m", n_ctx=512)
    res = generate(engine, prompt, max_tokens=12)
    assert res.stats.tokens >= 1 and res.text.strip()
    lookup = generate(engine, prompt, max_tokens=12, draft="lookup")
    assert lookup.stats.tokens >= 1


def test_chat_cli_session_commands():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "edgespec", "chat", "--target", "smollm2-135m",
                          "--max-tokens", "8"], input="Hello!\n/stats\n/reset\n/stats\nBye\n",
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "[history cleared]" in res.stderr
    assert "2 messages in history" in res.stderr and "0 messages in history" in res.stderr
    assert res.stderr.count("tokens/pass") == 2  # one stats line per reply


def test_chat_data_cuts_long_prompts_to_fit_the_context(tmp_path):
    """`edgespec data --chat`: a passage whose chat prompt would overflow the context is cut so
    the new tokens still fit (it used to stop the whole run)."""
    import json

    from edgespec.data import DataConfig, make_data, read_data

    src = tmp_path / "p.jsonl"
    long = "The quick brown fox jumps over the lazy dog near the river bank. " * 12
    src.write_text(json.dumps({"prompt": long}) + "\n" + json.dumps({"prompt": "Say hi."}) + "\n")
    cfg = DataConfig(n_prompts=2, prompt_tokens=8, new_tokens=8, sample_share=0.0, chat=True)
    make_data("smollm2-135m", [str(src)], tmp_path / "d", cfg)
    _, samples = read_data(tmp_path / "d")
    budget = cfg.prompt_tokens + cfg.new_tokens + 64 - cfg.new_tokens - 8
    assert len(samples) == 2 and all(s["prompt_len"] <= budget for s in samples)
    assert max(s["prompt_len"] for s in samples) > 30  # the long one kept what fits
