"""Chat on a base model (no chat template): the plain User/Assistant transcript, the stop at the
next user turn, and the session's bookkeeping, on a scripted mock target; `edgespec chat`'s
sessions on SmolLM2 against llama_cpp.Llama's chat (the chat-cli bench's rows)."""

import numpy as np
import pytest

from edgespec.runtime.chat import ChatSession, render_chat
from edgespec.runtime.spec import SpecConfig
from mock import MockTarget

PIECES = [" Hi", " there", ".", "\n", "User", ":", " more"]


class Scripted(MockTarget):
    """Answers every prompt with the same token script; token i's text is PIECES[i]."""

    def __init__(self):
        super().__init__(vocab=len(PIECES))
        self.prompt_len = 0

    def tokenize(self, text, add_bos=None, special=True):
        ids = [0] * max(1, len(text) // 4)
        self.prompt_len = len(ids)
        return ids

    def logits_after(self, context):
        out = np.full(self.vocab, -10.0)
        out[min(len(context) - self.prompt_len, self.vocab - 1)] = 10.0
        return out

    def token_bytes(self, token):
        return PIECES[token].encode()


def test_base_model_transcript_stops_at_the_next_user_turn():
    t = Scripted()
    s = ChatSession(t, spec=SpecConfig(policy="fixed"), max_tokens=20)
    assert s.prompt_text() == "\nAssistant:"  # empty history
    s.messages.append({"role": "user", "content": "Hello"})
    assert s.prompt_text() == "User: Hello\nAssistant:"
    s.messages.clear()
    gen = s.reply("Hello")
    assert gen.text == " Hi there." and gen.stats.finish_reason == "stop"
    assert s.messages == [{"role": "user", "content": "Hello"},
                          {"role": "assistant", "content": "Hi there."}]
    s.messages.append({"role": "user", "content": "More?"})
    assert s.prompt_text() == "User: Hello\nAssistant: Hi there.\nUser: More?\nAssistant:"
    s.messages.pop()
    assert "1 replies" in s.stats_line() and "2 messages in history" in s.stats_line()
    s.reset()
    assert s.messages == [] and "0 messages" in s.stats_line()


def test_render_chat_without_template_joins_turns():
    spec = MockTarget().spec
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert render_chat(spec, msgs) == "a\nb\n"
    assert render_chat(spec, msgs, add_generation_prompt=False) == "a\nb"


def test_chat_cli_rows_ask_llama_cpp_for_what_the_chat_command_does():
    """The chat-cli bench's reference runs the sampling values `edgespec chat` resolves its flags
    to (llama.cpp's chat cuts, temperature 0 unless given), read from the command's own parser."""
    from edgespec.measure.workload import CLI_DRAFT, WORKLOADS, chat_cli_args

    plain, warm = WORKLOADS["chat-cli"]
    a = chat_cli_args(plain, CLI_DRAFT, 64, 1024, 2)
    assert (a.draft, a.temperature, a.top_k, a.top_p, a.min_p, a.repeat_penalty) == \
        ("lookup", 0.0, 40, 0.95, 0.05, 1.0)
    assert (a.max_tokens, a.n_ctx, a.threads) == (64, 1024, 2)
    b = chat_cli_args(warm, "default", 64, 1024, 2)
    assert (b.draft, b.temperature, b.top_k) == ("default", 0.8, 40)


@pytest.mark.integration
def test_chat_cli_session_answers_as_llama_cpp_chat_does():
    """`edgespec chat` on SmolLM2 at its defaults (greedy), over two turns of one conversation:
    each side continues its own history and both write the same replies, with no drafts (one
    token a pass: plain decoding's numbers) and with the chat's default drafter (lookup: on the
    batch-invariant build `make test` uses, its batched passes change no number either)."""
    import os

    from edgespec.measure.workload import CLI_DRAFT, WORKLOADS, run_chat_cli

    prompts = [{"kind": "chat", "prompt": "Why is the sky blue?"},
               {"kind": "chat", "prompt": "Name three fruits that are red."}]
    drafts = [CLI_DRAFT, "none"]
    row = run_chat_cli(WORKLOADS["chat-cli"][0], prompts, max_tokens=24, n_ctx=1024, threads=2,
                       draft=drafts)
    assert row["draft"] == "lookup" and row["args"]["temperature"] == 0.0 and row["prompts"] == 2
    ref, ours, none = (row["per_prompt"][k] for k in ("llama_cpp.Llama", "edgespec", "edgespec (draft none)"))
    for a, b, c in zip(ref, ours, none):
        assert len(a["turns"]) == len(b["turns"]) == 2
        assert all(t["tokens"] > 0 and t["seconds"] > 0 for t in a["turns"] + b["turns"])
        assert [t["text"] for t in c["turns"]] == [t["text"] for t in a["turns"]]
        if os.environ.get("EDGESPEC_LLAMA_LIB") == "invariant":
            assert [t["text"] for t in b["turns"]] == [t["text"] for t in a["turns"]]
    assert row["others"]["none"]["same_text_share"] == 1.0
    assert sum(t["speculative"]["verify_passes"] for r in ours for t in r["turns"]) > 0
