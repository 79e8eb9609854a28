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


def test_streams_hold_back_stop_strings_and_equal_the_text(pair):
    """Streamed chunks join to the non-streamed text, the stop string never shown, for stops
    that arrive split over tokens."""
    ref, _, spec = pair
    prompt = "List five fruits, one per line:\n1. Apple\n2."
    full = ref.create_completion(prompt, temperature=0, max_tokens=24)["choices"][0]["text"]
    for stop in ["\n4", "\n3. ", full[5:9]]:
        a = spec.create_completion(prompt, temperature=0, max_tokens=24, stop=[stop])
        streamed = "".join(c["choices"][0]["text"] for c in
                           spec.create_completion(prompt, temperature=0, max_tokens=24, stop=[stop],
                                                  stream=True))
        assert streamed == a["choices"][0]["text"] and stop not in streamed


def test_options_it_cannot_honour_are_errors_not_silence(pair):
    _, _, spec = pair
    msgs = [{"role": "user", "content": "Give me JSON."}]
    for kw in ({"response_format": {"type": "json_object"}}, {"grammar": object()},
               {"logprobs": True}, {"mirostat_mode": 2},
               {"tools": [{"type": "function", "function": {"name": "f"}}]}):
        with pytest.raises(NotImplementedError, match=next(iter(kw))):
            spec.create_chat_completion(messages=msgs, max_tokens=4, **kw)
    with pytest.raises(NotImplementedError, match="suffix"):
        spec.create_completion("def f():", suffix="return 1", max_tokens=4)


def test_sampling_options_seed_and_follow_up_turns(pair):
    _, _, spec = pair
    out = spec.create_completion("Once upon a time", max_tokens=8, seed=-1, repeat_penalty=1.3,
                                 frequency_penalty=0.2, presence_penalty=0.1, typical_p=0.9,
                                 logit_bias={"13": -5.0})
    assert out["usage"]["completion_tokens"] >= 1
    msgs = [{"role": "user", "content": "Name a colour."}]
    first = spec.create_chat_completion(messages=msgs, temperature=0, max_tokens=8)
    msgs += [first["choices"][0]["message"], {"role": "user", "content": "And another?"}]
    second = spec.create_chat_completion(messages=msgs, temperature=0, max_tokens=8)
    sp = second["speculative"]
    assert sp["prompt_reused"] > first["speculative"]["prompt_tokens"] // 2


def test_two_streams_from_one_model_raise_instead_of_mixing(pair):
    from edgespec.errors import EdgespecError

    _, _, spec = pair
    a = spec.create_completion("The sea is", max_tokens=12, temperature=0, stream=True)
    next(a)
    b = spec.create_completion("The mountain is", max_tokens=12, temperature=0, stream=True)
    assert "".join(c["choices"][0]["text"] for c in b)
    with pytest.raises(EdgespecError, match="another generation"):
        list(a)


def test_the_rest_of_llamas_surface_works_or_names_itself(pair):
    ref, _, spec = pair
    assert (spec.n_vocab(), spec.n_ctx(), spec.token_eos(), spec.token_bos()) == \
        (ref.n_vocab(), ref.n_ctx(), ref.token_eos(), ref.token_bos())
    assert spec.tokenize(b"Hello world") == ref.tokenize(b"Hello world")
    with pytest.raises(NotImplementedError, match="create_embedding"):
        spec.create_embedding("text")
