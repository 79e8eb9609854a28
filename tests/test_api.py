"""Integration: SpeculativeLlama answers like llama_cpp.Llama (same dict shapes, same greedy text)."""

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def pair(request):
    """llama_cpp.Llama with its defaults; edgespec without a draft and with prompt lookup, both
    verifying with the full LM head (where the start-up check says exact, their greedy text is
    plain decoding's bit for bit, tests/test_exact.py)."""
    from llama_cpp import Llama

    from edgespec.runtime.api import SpeculativeLlama
    from edgespec.targets import resolve_target

    path = str(resolve_target(request.param))
    return (Llama(model_path=path, n_ctx=512, verbose=False),
            SpeculativeLlama(model_path=path, n_ctx=512, draft=None, lm_head="full"),
            SpeculativeLlama(model_path=path, n_ctx=512, draft="lookup", lm_head="full"))


def is_chat(llm) -> bool:
    return bool(llm.engine.spec.chat_template)


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
    assert sb[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    if is_chat(spec):  # a base model: llama_cpp.Llama guesses another transcript format
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
    with pytest.raises(NotImplementedError, match="mirostat_mode"):
        spec.create_chat_completion(messages=msgs, max_tokens=4, mirostat_mode=2)
    with pytest.raises(NotImplementedError, match="suffix"):
        spec.create_completion("def f():", suffix="return 1", max_tokens=4)
    with pytest.raises(NotImplementedError, match="echo"):
        spec.create_completion("def f():", logprobs=2, echo=True, max_tokens=4)


def test_sampled_text_without_drafts_is_llama_cpps(pair):
    """Sampled at llama-cpp-python's defaults (T=0.8, top_k 40, top_p 0.95, min_p 0.05) with no
    drafts, the drop-in's text is llama_cpp.Llama's for the same seed: the prompt is prefilled
    as llama_cpp.Llama prefills it and its last row draws the first token, with llama.cpp's own
    chain and draws; a follow-up call that reuses the cache's prefix does so too."""
    ref, plain, _ = pair
    prompts = ["The three laws of motion are", "def add(a, b):", "Once upon a time",
               "Once upon a time there was"]  # the last one reuses the one before's prefix
    for i, p in enumerate(prompts):
        a = ref.create_completion(p, max_tokens=24, seed=7 + i)
        b = plain.create_completion(p, max_tokens=24, seed=7 + i)
        assert b["choices"][0]["text"] == a["choices"][0]["text"], p
    assert b["speculative"]["prompt_reused"] >= len(plain.tokenize(b"Once upon a time")) - 1


def test_sampling_options_seed_and_follow_up_turns(pair):
    _, _, spec = pair
    kw = dict(max_tokens=8, repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1,
              typical_p=0.9, temperature=0.8)
    runs = [spec.create_completion("Once upon a time", seed=s, **kw) for s in (3, 3, 4, 5)]
    texts = [r["choices"][0]["text"] for r in runs]
    assert texts[0] == texts[1] and len(set(texts)) > 1  # a seed repeats its draw, others differ
    for r in runs:
        u = r["usage"]["completion_tokens"]
        assert u == 8 or (u < 8 and r["choices"][0]["finish_reason"] == "stop")
    ids = spec.tokenize(b"Once upon a time")
    top = next(iter(spec.generate(ids, temp=0)))
    biased = spec.create_completion("Once upon a time", max_tokens=1, temperature=0,
                                    logit_bias={str(top): -100.0})
    assert spec.tokenize(biased["choices"][0]["text"].encode(), add_bos=False) != [top]
    assert biased["choices"][0]["text"] != spec.detokenize([top]).decode()  # the bias is applied
    msgs = [{"role": "user", "content": "Name a colour."}]
    first = spec.create_chat_completion(messages=msgs, temperature=0, max_tokens=8)
    msgs += [first["choices"][0]["message"], {"role": "user", "content": "And another?"}]
    second = spec.create_chat_completion(messages=msgs, temperature=0, max_tokens=8)
    sp = second["speculative"]
    assert sp["prompt_reused"] > first["speculative"]["prompt_tokens"] // 2
    assert sp["prompt_reused"] + 1 <= sp["prompt_tokens"]


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
    import itertools

    ref, plain, spec = pair
    assert (spec.n_vocab(), spec.n_ctx(), spec.token_eos(), spec.token_bos(), spec.token_nl()) == \
        (ref.n_vocab(), ref.n_ctx(), ref.token_eos(), ref.token_bos(), ref.token_nl())
    assert spec.tokenize(b"Hello world") == ref.tokenize(b"Hello world")
    tok, rtok = spec.tokenizer(), ref.tokenizer()
    assert tok.encode("Hello world") == rtok.encode("Hello world")
    assert tok.decode(tok.encode("Hello world", add_bos=False)) == "Hello world"
    assert spec.metadata == ref.metadata and "general.architecture" in spec.metadata
    ids = ref.tokenize(b"The capital of France is")
    want = list(itertools.islice(ref.generate(ids, temp=0), 12))
    assert list(itertools.islice(plain.generate(ids, temp=0), 12)) == want
    for llm in (ref, plain):
        llm.create_completion("The capital of France is", temperature=0, max_tokens=6)
    assert plain.n_tokens == ref.n_tokens and list(plain.input_ids) == list(ref.input_ids[:ref.n_tokens])
    assert spec.longest_token_prefix([1, 2, 3], [1, 2, 4]) == ref.longest_token_prefix([1, 2, 3], [1, 2, 4])
    for name, call in [("create_embedding", lambda: spec.create_embedding("text")),
                       ("save_state", spec.save_state), ("eval", lambda: spec.eval([1]))]:
        with pytest.raises(NotImplementedError, match=name):
            call()
    if is_chat(spec):
        from openai.types.chat import ChatCompletion

        out = spec.create_chat_completion_openai_v1(messages=[{"role": "user", "content": "Hi"}],
                                                    temperature=0, max_tokens=4)
        assert isinstance(out, ChatCompletion) and out.choices[0].message.role == "assistant"


def test_logprobs_match_llama_cpps(pair):
    """Log-probabilities of the emitted tokens from the model's full distribution, in
    llama-cpp-python's format, equal up to the two decodes' batch numerics (llama.cpp's logits
    move by up to a few tenths between batch shapes: measured here, mean |diff| 0.07, max 0.19
    on this prompt). The exact arithmetic is checked on the mock target."""
    from llama_cpp import Llama

    _, plain, spec = pair
    ref = Llama(model_path=str(plain.engine.spec.path), n_ctx=512, logits_all=True, verbose=False)
    prompt = "The three primary colours are"
    a = ref.create_completion(prompt, temperature=0, max_tokens=8, logprobs=3)["choices"][0]["logprobs"]
    for llm in (plain, spec):
        b = llm.create_completion(prompt, temperature=0, max_tokens=8, logprobs=3)["choices"][0]["logprobs"]
        assert b["tokens"] == a["tokens"] and b["text_offset"] == a["text_offset"]
        diffs = [abs(x - y) for x, y in zip(a["token_logprobs"], b["token_logprobs"])]
        assert sum(diffs) / len(diffs) < 0.15 and max(diffs) < 0.5
        same_top = sum(set(x) == set(y) for x, y in zip(a["top_logprobs"], b["top_logprobs"]))
        assert same_top >= 6
    msgs = [{"role": "user", "content": "Say hi."}]
    c = spec.create_chat_completion(messages=msgs, temperature=0, max_tokens=6, logprobs=True,
                                    top_logprobs=2)["choices"][0]
    content = c["logprobs"]["content"]
    assert "".join(x["token"] for x in content) == c["message"]["content"]
    assert all(len(x["top_logprobs"]) == 2 and x["logprob"] <= 0 for x in content)


def test_json_mode_and_grammars_constrain_speculative_output_exactly(pair):
    """JSON mode and a GBNF grammar through llama.cpp's grammar sampler: the speculative
    output parses and equals the same request without a draft, and llama_cpp.Llama's
    grammar-constrained greedy output (same prefill, same batches' numbers)."""
    import json as js

    from llama_cpp import LlamaGrammar
    from llama_cpp.llama_grammar import JSON_GBNF

    ref, plain, spec = pair
    if is_chat(spec):
        msgs = [{"role": "user", "content": "Give a JSON object with a name and an age."}]
        outs = [m.create_chat_completion(messages=msgs, temperature=0, max_tokens=48,
                                         response_format={"type": "json_object"})
                for m in (ref, plain, spec)]
        texts = [o["choices"][0]["message"]["content"] for o in outs]
        assert texts[1] == texts[2] == texts[0]
        if outs[1]["choices"][0]["finish_reason"] == "stop":
            assert isinstance(js.loads(texts[1]), dict)
    json_grammar = LlamaGrammar.from_string(JSON_GBNF, verbose=False)
    prompt = "A person described as a JSON object with a name and an age:"
    outs = [m.create_completion(prompt, temperature=0, max_tokens=40, grammar=json_grammar)
            for m in (ref, plain, spec)]
    texts = [o["choices"][0]["text"] for o in outs]
    assert texts[1] == texts[2] == texts[0]
    if outs[1]["choices"][0]["finish_reason"] == "stop":
        assert isinstance(js.loads(texts[1]), dict)
    grammar = LlamaGrammar.from_string('root ::= ("yes" | "no") " because " [a-z ]+ "."',
                                       verbose=False)
    for q in ["Is the sky blue?", "Is fire hot?", "Can fish fly?", "Is water wet?", "Do cats bark?"]:
        got = [m.create_completion(q + " Answer:", temperature=0, max_tokens=20,
                                   grammar=grammar)["choices"][0]["text"] for m in (ref, plain, spec)]
        assert got[0] == got[1] == got[2] and got[0].split(" ")[0] in ("yes", "no")
        assert got[0].split(" ")[1] == "because"


def test_tool_calls_follow_the_named_tools_schema_as_llama_cpp_does(pair):
    """tool_choice naming a function: the reply is a call to it whose arguments follow its
    JSON schema (grammar-constrained), in llama-cpp-python's shape, streamed or not; the
    template sees the tools. Greedy, the arguments are llama_cpp.Llama's."""
    import json as js

    ref, plain, spec = pair
    if not is_chat(spec):
        pytest.skip("a base model without a chat template")
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "days": {"type": "integer"}},
                       "required": ["city", "days"]}}}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    msgs = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
    a = ref.create_chat_completion(messages=msgs, tools=tools, tool_choice=choice, temperature=0,
                                   max_tokens=40)
    b = spec.create_chat_completion(messages=msgs, tools=tools, tool_choice=choice, temperature=0,
                                    max_tokens=40)
    ca, cb = a["choices"][0], b["choices"][0]
    assert cb["finish_reason"] == ca["finish_reason"] == "tool_calls"
    assert set(cb["message"]) == set(ca["message"]) and cb["message"]["content"] is None
    call = cb["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == ca["message"]["tool_calls"][0]["function"]["arguments"]
    args = js.loads(call["function"]["arguments"])
    assert isinstance(args["city"], str) and isinstance(args["days"], int)
    chunks = list(spec.create_chat_completion(messages=msgs, tools=tools, tool_choice=choice,
                                              temperature=0, max_tokens=40, stream=True))
    streamed = "".join(c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                       for c in chunks if c["choices"][0]["delta"].get("tool_calls"))
    assert streamed == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # legacy functions / function_call take the same path
    c = spec.create_chat_completion(messages=msgs, functions=[tools[0]["function"]],
                                    function_call={"name": "get_weather"}, temperature=0,
                                    max_tokens=40)
    assert c["choices"][0]["message"]["function_call"]["arguments"] == call["function"]["arguments"]


def test_logits_processors_and_stopping_criteria_act_as_in_llama_cpp(pair):
    """A logits processor (here: ban the token that would come next most often) and a stopping
    criterion (stop before the 9th new token) change the greedy output exactly as they change
    llama_cpp.Llama's, with prompt lookup drafting."""
    import numpy as np
    from llama_cpp import LogitsProcessorList, StoppingCriteriaList

    ref, plain, spec = pair
    prompt = "One, two, three, four, five, one, two, three,"
    banned = spec.tokenize(b" four", add_bos=False)[0]

    def ban(ids, scores):
        scores[banned] = -np.inf
        return scores

    n_prompt = len(spec.tokenize(prompt.encode()))

    def eight(ids, logits):
        return len(ids) >= n_prompt + 8

    kw = dict(temperature=0, max_tokens=24)
    a = ref.create_completion(prompt, logits_processor=LogitsProcessorList([ban]), **kw)
    b = spec.create_completion(prompt, logits_processor=LogitsProcessorList([ban]), **kw)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert " four" not in b["choices"][0]["text"].split(",")[0:1]
    a = ref.create_completion(prompt, stopping_criteria=StoppingCriteriaList([eight]), **kw)
    b = spec.create_completion(prompt, stopping_criteria=StoppingCriteriaList([eight]), **kw)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert b["choices"][0]["finish_reason"] == a["choices"][0]["finish_reason"] == "stop"
