"""Integration: SpeculativeLlama answers like llama_cpp.Llama (same dict shapes, same greedy text)."""

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pair():
    from llama_cpp import Llama

    from edgespec.runtime.api import SpeculativeLlama
    from edgespec.targets import resolve_target

    path = str(resolve_target("smollm2-135m"))
    return (Llama(model_path=path, n_ctx=512, verbose=False),
            SpeculativeLlama(model_path=path, n_ctx=512, draft=None),
            SpeculativeLlama(model_path=path, n_ctx=512, draft="lookup"))


def test_completion_matches_llama_cpp(pair):
    ref, plain, spec = pair
    a = ref.create_completion("The capital of France is", temperature=0, max_tokens=10)
    b = plain.create_completion("The capital of France is", temperature=0, max_tokens=10)
    assert set(a) <= set(b) and set(a["choices"][0]) == set(b["choices"][0])
    assert b["choices"][0]["text"] == a["choices"][0]["text"]  # one token a pass: same numerics
    assert b["usage"] == a["usage"] and b["choices"][0]["finish_reason"] == "length"
    c = spec.create_completion("The capital of France is", temperature=0, max_tokens=10)
    assert c["speculative"]["tokens"] == 10 and c["object"] == "text_completion"


def test_chat_completion_and_streams_have_llama_cpp_shapes(pair):
    ref, _, spec = pair
    msgs = [{"role": "user", "content": "Name three colours."}]
    a = ref.create_chat_completion(messages=msgs, temperature=0, max_tokens=8)
    b = spec.create_chat_completion(messages=msgs, temperature=0, max_tokens=8)
    assert set(a) <= set(b) and set(a["choices"][0]) == set(b["choices"][0])
    assert b["choices"][0]["message"]["role"] == "assistant" and b["choices"][0]["message"]["content"]
    sa = list(ref.create_chat_completion(messages=msgs, temperature=0, max_tokens=5, stream=True))
    sb = list(spec.create_chat_completion(messages=msgs, temperature=0, max_tokens=5, stream=True))
    assert sb[0]["choices"][0]["delta"] == sa[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert sb[-1]["choices"][0]["finish_reason"] == sa[-1]["choices"][0]["finish_reason"] == "length"
    assert {k for c in sb for k in c} >= {k for c in sa for k in c}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in sb)
    assert text.strip()
    chunks = list(spec.create_completion("Once upon a time", max_tokens=6, stream=True, seed=3))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "speculative" in chunks[-1]
