"""Chat on a base model (no chat template): the plain User/Assistant transcript, the stop at the
next user turn, and the session's bookkeeping, on a scripted mock target."""

import numpy as np

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
