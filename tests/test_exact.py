"""Integration: bit-exact speculative greedy decoding on llama.cpp (edgespec/llama_lib.py).

With the batch-invariant library build (`make setup` builds it; `make test` requires it), greedy
text with the full LM head equals plain greedy decoding of the same build bit for bit, whatever
drafts, and llama_cpp.Llama's own greedy text on the same prompts. With the stock library the
same calls work and say `exact: false`.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

PROMPTS = [
    "The lighthouse keeper climbed the stairs every evening",
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
    "Photosynthesis is the process by which",
    "In 1848, revolutions spread across Europe because",
    "import os\nimport json\n\ndef load_config(path):\n",
    "The recipe calls for two cups of flour,",
]


def invariant_loaded() -> bool:
    from edgespec import llama_lib

    import llama_cpp  # noqa: F401  (the library is chosen when it loads)

    return llama_lib.loaded_is_invariant()


def test_make_test_runs_the_invariant_build():
    """`make test` asks for the invariant build (EDGESPEC_LLAMA_LIB=invariant): it must be the
    library this process loaded, not silently the stock one."""
    if os.environ.get("EDGESPEC_LLAMA_LIB") != "invariant":
        pytest.skip("EDGESPEC_LLAMA_LIB=invariant is not set (make test sets it)")
    assert invariant_loaded()


@pytest.mark.parametrize("target", ["gemma3-270m", "smollm2-135m"])
def test_speculative_greedy_equals_plain_and_llama_cpp(target):
    """128 tokens per prompt: drafting (prompt lookup, and the default head where one ships)
    gives plain decoding's text on every prompt wherever the start-up check says exact, and
    plain decoding gives llama_cpp.Llama's on >= 90% of prompts."""
    from llama_cpp import Llama

    from edgespec.runtime.api import SpeculativeLlama
    from edgespec.targets import resolve_target

    path = str(resolve_target(target))
    ref = Llama(model_path=path, n_ctx=512, verbose=False)
    plain = SpeculativeLlama(model_path=path, n_ctx=512, draft=None, lm_head="full")
    # a fixed draft length: the cost policy may learn (from earlier runs) that drafting does
    # not pay with the full LM head, and these runs must draft
    drafters = [SpeculativeLlama(model_path=path, n_ctx=512, draft=d, lm_head="full",
                                 policy="fixed", k=4) for d in ("lookup", "default")]
    same_ref, exact_runs, drafted = 0, 0, 0
    for p in PROMPTS:
        want = ref.create_completion(p, temperature=0, max_tokens=128)["choices"][0]["text"]
        base = plain.create_completion(p, temperature=0, max_tokens=128)
        same_ref += base["choices"][0]["text"] == want
        for llm in drafters:
            out = llm.create_completion(p, temperature=0, max_tokens=128)
            st = out["speculative"]
            if st["exact"]:
                exact_runs += 1
                assert out["choices"][0]["text"] == base["choices"][0]["text"], (target, p)
            drafted += st["drafted"]
    assert same_ref >= 0.9 * len(PROMPTS), same_ref
    assert drafted > 0
    if not invariant_loaded():
        pytest.skip(f"stock library: {exact_runs} of {2 * len(PROMPTS)} runs exact, so the "
                    "text comparison is not claimed (make test runs the invariant build)")
    assert exact_runs == 2 * len(PROMPTS)  # every drafted run was compared with plain text


def test_the_check_is_measured_once_and_caps_the_verify_batch():
    from edgespec.cache import read_json
    from edgespec.runtime.decoding import Generation
    from edgespec.runtime.drafters import make_drafter
    from edgespec.runtime.llama_target import INVARIANCE_FILE, LlamaTarget
    from edgespec.runtime.policies import FixedK
    from edgespec.runtime.sampling import SamplingParams

    t = LlamaTarget("gemma3-270m", n_ctx=512, lm_head="full", flash_attn=False)
    n = t.invariant_batch()
    assert n in read_json(INVARIANCE_FILE).values()
    if invariant_loaded():
        assert n >= 4
    again = LlamaTarget("gemma3-270m", n_ctx=512, lm_head="full", flash_attn=False)
    if n < 2:
        pytest.skip(f"this library keeps one-token numbers for {n} rows: no exact mode to check")
    # once measured, a later engine reads the figure without decoding anything
    again._measure_invariance = lambda most: pytest.fail("measured twice")
    assert again.invariant_batch() == n
    ids = t.tokenize("one two three four five six seven eight nine ten one two three four")
    rows = []
    decode = t.decode
    t.decode = lambda tokens, **kw: (rows.append(len(tokens)), decode(tokens, **kw))[1]
    g = Generation(t, ids, SamplingParams(), max_tokens=40, drafter=make_drafter("lookup", t.spec),
                   policy=FixedK(12))
    got = [tok for tok, _ in g]
    assert g.stats.exact and g.stats.drafted > 0
    assert max(rows) <= n  # never more rows a pass than the check found invariant
    plain = Generation(t, ids, SamplingParams(), max_tokens=40)
    assert [tok for tok, _ in plain] == got  # and the text is plain decoding's


def test_a_stock_library_still_runs_and_says_it_is_not_exact(tmp_path):
    """An app whose llama-cpp-python is the stock build: the same call works, `exact` false
    where that build's batches change the numbers (Gemma without flash attention here)."""
    code = ("import json, edgespec\n"
            "from edgespec.runtime.api import SpeculativeLlama\n"
            "from edgespec import llama_lib\n"
            "llm = SpeculativeLlama(model_path='gemma3-270m', n_ctx=256, draft='lookup', lm_head='full')\n"
            "out = llm.create_completion('The capital of France is', temperature=0, max_tokens=12)\n"
            "print(json.dumps({'exact': out['speculative']['exact'], 'tokens': out['usage']['completion_tokens'],"
            " 'invariant': llama_lib.loaded_is_invariant(), 'rows': llm.engine.invariant_batch()}))\n")
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    env.update(EDGESPEC_LLAMA_LIB="stock", EDGESPEC_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["tokens"] == 12 and not got["invariant"]
    # the stock build's Gemma batches change the numbers (measured: rows < 2), so the run must
    # not claim exactness
    assert got["rows"] < 2 and got["exact"] is False
