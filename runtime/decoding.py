"""Draft-and-verify decoding, with target-only decoding as the zero-draft case.

State between steps: the cache holds every emitted token but the newest one, `pending`; the
drafter gets the target's hidden states up to the position before it (whose logits chose it).
One step:
    drafts = drafter.propose(context, new_hidden, k)      # k guesses for the tokens after pending
    logits = target.decode([pending] + drafts)            # one batched pass: k + 1 positions
    accept the longest prefix of drafts the target agrees with, then take one more token from
    the target at the first disagreement (or a bonus token after a full accept)
    roll the cache back past the rejected drafts
With greedy decoding every emitted token is the target's argmax at its position in the verify
pass; with sampling, every emitted token is the one llama.cpp's sampler draws for its position
from the request's seed (runtime/verify.SampledVerifier), so the target's distribution is kept
exactly and a draft stands where it is that token.
"""

from __future__ import annotations

import codecs
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.runtime.engine import Engine
from edgespec.runtime.policies import FixedK, Step
from edgespec.runtime.sampling import SamplingParams
from edgespec.runtime.verify import Verdict, Verifier, make_verifier

# The engine interface the loop uses (LlamaTarget, OrtTarget, a batch slot, the tests' mock)
Target = Engine


@dataclass
class Draft:
    tokens: list[int]
    # Per draft token, the distribution it was drawn from as (target ids, probs), or None when
    # the proposal was deterministic (a one-hot q). Reported only: sampled verification picks
    # each row with the target's own draw and needs no q (verify.SampledVerifier).
    q: list[tuple[np.ndarray, np.ndarray] | None] = field(default_factory=list)
    conf: list[float] = field(default_factory=list)  # the drafter's top probability per step
    source: str = ""  # which drafter made it ("lookup", "head"): policies keep apart estimates
    # sampling: per draft token, the uniform draw the target's row for it will use (set by the
    # loop; a draft stands where the target's draw picks it, which a low draw makes likelier:
    # the cost policy learns how much, `CostAware.trim`)
    u: list[float] = field(default_factory=list)
    # Seconds per draft step as the policy should count it, where the drafter knows better than
    # the whole call's time: a head that first reads rows waiting since it last drafted reports
    # its step without that catch-up (None: time the call)
    step_s: float | None = None


# The policy's most drafts worth making now from a named source ("lookup", "head"); drafters
# ask before drafting, so a draft step that would be trimmed away is never computed. A limit
# may also answer `go_on(source, conf, u)`: whether a chain with these confidences so far (and
# these draws for its rows, sampling) should compute its next step, `kept(source, conf, u)`: how
# much of such a draft would be verified, and `seen(source, conf)`: a draft set aside unverified
# (PolicyLimit).
Limit = Callable[[str], int]


class PolicyLimit:
    """What a drafter may ask the loop's policy while it drafts (see Limit)."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, source: str) -> int:
        return self.policy.limit(source)

    def go_on(self, source: str, conf: list[float], u: list[float] | None = None) -> bool:
        return self.policy.go_on(source, conf, u)

    def kept(self, source: str, conf: list[float], u: list[float] | None = None) -> int:
        return self.policy.kept(source, conf, u)

    def seen(self, source: str, conf: list[float]) -> None:
        self.policy.seen(source, conf)

# The head reads hidden states only while the policy says it may draft within this many passes
HIDDEN_LEAD = 16


@dataclass
class Stats:
    prompt_tokens: int = 0
    prompt_reused: int = 0  # prompt tokens whose cache entries a previous call left (not decoded)
    tokens: int = 0  # emitted
    verify_passes: int = 0
    drafted: int = 0  # draft tokens sent to verification
    draft_steps: int = 0  # draft tokens computed (a policy may trim some before verifying)
    hidden_passes: int = 0  # verify passes that read hidden states for the head
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted count per draft position
    drafted_at: list[int] = field(default_factory=list)
    # per draft source ("lookup", "head", ...; "none" for passes that verified no draft):
    # [verify passes, drafted, accepted]
    by_source: dict[str, list[int]] = field(default_factory=dict)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # all time after prefill: drafting + verifying + bookkeeping
    draft_s: float = 0.0
    verify_s: float = 0.0
    finish_reason: str = ""
    # greedy text equal to plain greedy decoding's, bit for bit (see Generation.exact_rows)
    exact: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per target verify pass (1.0 for target-only decoding)."""
        return self.tokens / self.verify_passes if self.verify_passes else 0.0

    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "prompt_reused": self.prompt_reused,
            "tokens": self.tokens, "verify_passes": self.verify_passes, "drafted": self.drafted,
            "draft_steps": self.draft_steps, "hidden_passes": self.hidden_passes,
            "accepted": self.accepted, "mean_accepted": round(self.mean_accepted, 4),
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position()],
            "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
            "draft_s": round(self.draft_s, 4), "verify_s": round(self.verify_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3), "finish_reason": self.finish_reason,
            "exact": self.exact, "by_source": {k: list(v) for k, v in self.by_source.items()},
        }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


# Which generation each target's cache belongs to: a generation whose cache another one took
# over (two streams from one model, read in turn) stops with a clear error, not garbage.
_OWNER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Drafter:
    """A drafter's interface, with the defaults of one that reads no hidden states.

    propose(context, hidden, k, p_min, limit): up to k tokens to follow `context` (whose last
    token is pending). `hidden`: the target's hidden states [n, E] at the n positions before
    the pending token that became final since the last call (None for drafters that do not
    read them). `limit(source)`: the policy's most drafts worth making now from that source.
    Drafters with confidences stop once their top probability drops below p_min."""

    needs_hidden = False  # whether propose() reads the target's hidden states
    feature_layers: tuple[int, ...] = ()  # target layers whose inputs it reads too (EAGLE-3)
    kv_layers: tuple[int, ...] = ()  # target layers whose keys and values it reads (shared-KV)
    continuous = False  # it needs every pass's rows and the whole prompt's (no gaps)
    source = ""  # the name its drafts go by when they need hidden states (the head's)

    def propose(self, context: list[int], hidden: np.ndarray | None, k: int,
                p_min: float = 0.0, limit: Limit | None = None) -> Draft:
        raise NotImplementedError

    def reset(self) -> None:
        """A new generation starts."""

    def resume(self, keep: int) -> None:
        """A new generation starts whose first `keep` context positions the target's cache
        kept from the last one (a continuous drafter keeps its rows for them)."""
        self.reset()

    def kv_held(self, tokens: list[int]) -> int:
        """Positions, from 0, of these cache tokens whose rows a continuous drafter holds (rows
        of other tokens at a position, written by another generation, do not count)."""
        return 0

    def note(self, tokens: list[int]) -> None:
        """The cache holds these tokens, the rows handed over so far among them."""

    def keep(self, hidden: np.ndarray | None) -> None:
        """Rows for later (hidden states of final positions, in order): a head reads them when
        it next drafts."""

    def drop_hidden(self) -> None:
        """Forget the hidden rows kept so far (the loop skipped some passes' rows)."""

    def set_sampling(self, sampling: SamplingParams | None, draws=None) -> None:
        """The request samples with these settings (None: greedy); draws(j): the uniform draw
        the target will use for the j-th token drafted now (see verify.SampledVerifier)."""


class HiddenFeed:
    """The target's hidden states on their way to a head drafter. A pass reads them only while
    the policy may let the head draft within `HIDDEN_LEAD` passes, unless the engine computes
    them anyway (`free`: the low-rank LM head reads them for every greedy pass). Reading them
    costs every pass something (embeddings mode), so a head the policy holds at zero between
    rare tries costs nothing meanwhile; after a gap it restarts from the rows read since."""

    def __init__(self, drafter: Drafter | None, policy, free: bool):
        self.want = bool(drafter and drafter.needs_hidden)
        free = free or bool(drafter and drafter.continuous)  # a continuous head reads every pass
        self.drafter, self.policy, self.free = drafter, policy, free
        self.rows: list[np.ndarray] = []  # rows the drafter has not seen yet
        self.reading = False  # whether the last pass read them

    def wanted(self) -> bool:
        return self.want and (self.free or self.policy.soon(self.drafter.source, HIDDEN_LEAD))

    def next_pass(self) -> bool:
        """Whether the next verify pass reads hidden states."""
        reading = self.wanted()
        if self.want and not reading and self.reading:
            # a gap: rows from before it must not be read as if contiguous with later ones
            self.rows = []
            self.drafter.drop_hidden()
        self.reading = reading
        return reading

    def keep(self, hidden: np.ndarray | None, n: int) -> None:
        """The first n rows of a pass (a copy: the engine reuses its buffers)."""
        if hidden is not None:
            self.rows.append(hidden[:n].copy())

    def take(self) -> np.ndarray | None:
        rows = np.concatenate(self.rows) if self.rows else None
        self.rows = []
        return rows


class Generation:
    """Iterate to stream (token id, text piece) pairs; `stats` fills in as it runs.

    The loop prefills the prompt, then repeats `speculative_step` (the module doc) and emits
    its tokens. What varies between requests lives in its parts, built once: the Verifier
    (greedy, sampled, exact; grammar, logprobs, stopping), the policy (how long each draft
    may be) and the drafter.
    """

    def __init__(self, target: Target, prompt: list[int], sampling: SamplingParams,
                 max_tokens: int = 128, drafter: Drafter | None = None, policy=None,
                 stop: list[str] | None = None, prompt_hidden: int = 32,
                 reuse_prefix: bool = True, logprobs: int | None = None, grammar=None,
                 stopping=None, verifier: Verifier | None = None):
        """logprobs=N: per emitted token its log-probability and the N most likely tokens
        (verification then reads every logit). grammar: runtime.grammar.Grammar, constrains
        every emitted token. stopping: llama-cpp-python's criteria, f(input_ids, logits) ->
        True stops before the token those logits chose. verifier: built from these where not
        given (`make_verifier`)."""
        if not prompt:
            raise EdgespecError("empty prompt: give some text to continue")
        if max_tokens < 1:
            raise EdgespecError(f"max_tokens must be >= 1, got {max_tokens}")
        if len(prompt) >= target.n_ctx:
            raise EdgespecError(f"prompt is {len(prompt)} tokens, the context holds {target.n_ctx}; "
                                "shorten it or raise n_ctx")
        self.target, self.prompt, self.sampling = target, prompt, sampling
        self.max_tokens, self.drafter = max_tokens, drafter
        self.policy = policy or FixedK(4 if drafter else 0)
        # exact mode prefills without reading prompt rows, which a continuous head needs
        self.verifier = verifier or make_verifier(target, sampling, grammar, logprobs, stopping,
                                                  exact=not (drafter and drafter.continuous))
        self.hidden = HiddenFeed(drafter, self.policy, target.hidden_free(self.verifier.top_only))
        if self.verifier.exact and drafter is not None and drafter.continuous:
            self.hidden.want = False  # (a verifier given as exact: the head never drafts)
        self.out = TextStream(stop)
        self.prompt_hidden = prompt_hidden  # prompt positions whose hidden states the head sees
        self.reuse_prefix = reuse_prefix  # keep the cache's common prefix with this prompt
        if drafter is not None:
            draws = self.verifier.draws
            drafter.set_sampling(None if sampling.greedy else sampling, None if draws is None else
                                 (lambda j: draws[len(self.token_ids) + j]))
        self.stats = Stats(prompt_tokens=len(prompt), exact=self.verifier.exact)
        self.token_ids: list[int] = []
        self.context: list[int] = []  # every token so far, the pending one included
        self.pending = prompt[-1]  # the newest token: chosen, not yet in the cache

    @property
    def text(self) -> str:
        return self.out.text

    @property
    def logprobs(self) -> list[tuple[float, list[tuple[int, float]]]]:
        return self.verifier.logprobs

    def __iter__(self) -> Iterator[tuple[int, str]]:
        st = self.stats
        first = self._prefill()
        t_start = time.perf_counter()
        try:
            if first is not None:  # the prompt's own pass chose the first token
                st.verify_passes += 1  # (tokens per pass stay honest)
                verdict = self.verifier.verify(first[None, :], [], [], self.context, self.token_ids)
                yield from self._emit_all(verdict)
            while not st.finish_reason:
                if _OWNER.get(self.target) is not self:
                    raise EdgespecError("another generation used this model since this one "
                                        "started; finish one stream before reading another")
                k = self._draft_length()
                if k is None:
                    st.finish_reason = "context"
                    return
                yield from self._emit_all(self.speculative_step(k))
        finally:
            st.decode_s = time.perf_counter() - t_start
            if not st.finish_reason:
                st.finish_reason = "stopped"
            self.policy.finish()
            if self.drafter is not None and self.drafter.continuous and _OWNER.get(self.target) is self:
                # the last pass's rows: a next call that keeps this cache keeps them too
                self.drafter.keep(self.hidden.take())
                self.drafter.note(self.target.tokens)

    def speculative_step(self, k: int) -> Verdict:
        """Draft up to k tokens after `pending`, check [pending] + drafts in one target pass,
        keep the prefix the Verifier accepts and roll the cache back past the rest."""
        st = self.stats
        draft, made, draft_s = self._draft(k)
        tv = time.perf_counter()
        reading = self.hidden.next_pass()
        st.hidden_passes += reading
        logits, hidden = self.target.decode([self.pending] + draft.tokens, hidden=reading,
                                            all_logits=bool(draft.tokens), copy=False,
                                            top_only=self.verifier.top_only)
        decode_s = time.perf_counter() - tv
        verdict = self.verifier.verify(logits, draft.tokens, draft.q, self.context, self.token_ids)
        n, n_acc = len(draft.tokens), verdict.accepted
        self.hidden.keep(hidden, n_acc + 1)  # before the rollback, which may reuse the buffers
        if n_acc < n:
            self.target.truncate(len(self.target.tokens) - n + n_acc)
        st.verify_s += time.perf_counter() - tv
        self._count(draft, n_acc)
        self.policy.observe(Step(draft.source, made, n, n_acc, draft_s, 1 + n, decode_s))
        return verdict

    def _emit_all(self, verdict: Verdict) -> Iterator[tuple[int, str]]:
        """A step's tokens, in order, until one ends the generation."""
        st, toks, cut = self.stats, verdict.tokens, verdict.cut
        if cut == 0:  # a stopping criterion refuses the step's first token
            st.finish_reason = "stop"
            return
        full = self._room() < 0  # no room to check the last token: this step ends the generation
        for i, tok in enumerate(toks[:cut]):
            # the token before a refused one ends the generation ("stop"), as does the last
            # one when the context is full
            end = "stop" if cut is not None and i == cut - 1 else (
                "context" if full and i == len(toks) - 1 else None)
            yield tok, self._emit(tok, end)
            if st.finish_reason:
                return
        self.pending = toks[-1]

    def _prefill(self) -> np.ndarray | None:
        """The prompt but its last token into the cache; the head's prompt rows read on the way.
        What the cache already holds of the prompt's start (the last call's prompt and reply,
        in a chat) is kept, as llama_cpp.Llama does: only the rest is decoded. An exact
        verifier's prompt goes in whole, as llama_cpp.Llama prefills it: its last row's logits
        are returned (they choose the first token)."""
        t, t0 = self.target, time.perf_counter()
        _OWNER[t] = self
        d = self.drafter
        t.set_feature_layers(d.feature_layers if d else ())
        t.set_kv_layers(d.kv_layers if d else ())
        self.context = list(self.prompt)
        exact = self.verifier.exact
        # exact: the head reads no prompt rows (asking for them would make every row an
        # output, with other numbers)
        wanted = self.hidden.wanted()
        reading = wanted and not exact
        # the prompt decoded whole, its last row choosing the first token, as llama_cpp.Llama
        # does it: exact greedy, and sampling where no head reads the prompt's rows
        own_pass = exact or (self.verifier.prompt_logits and not wanted)
        self.hidden.reading = reading
        whole = reading and d.continuous  # a continuous head reads every prompt row
        n_h = min(len(self.prompt) - 1, self.prompt_hidden) if reading and not whole else 0
        n_plain = len(self.prompt) if own_pass else len(self.prompt) - 1 - n_h
        keep = common_prefix(t.tokens, self.prompt[:n_plain]) if self.reuse_prefix else 0
        keep = min(keep, len(self.prompt) - 1)  # at least one token decoded: its logits
        if whole:  # what the cache keeps, the head must hold the rows of
            keep = min(keep, d.kv_held(t.tokens))
            d.resume(keep)
            n_plain, n_h = keep, len(self.prompt) - 1 - keep
        elif d:
            d.reset()
        if keep:
            t.truncate(keep)
        else:
            t.reset()
        self.stats.prompt_reused = keep
        first = None
        if own_pass:
            first = t.prefill(self.prompt[keep:], last_logits=True)
        elif n_h:  # the head's rows from the prompt's own batches
            self.hidden.rows.append(t.prefill_hidden(self.prompt[keep:-1], n_h))
        else:
            t.prefill(self.prompt[keep:n_plain])
        self.stats.prefill_s = time.perf_counter() - t0
        return first

    def _room(self) -> int:
        """Tokens the cache can still take after the pending one."""
        return self.target.n_ctx - len(self.target.tokens) - 1

    def _draft_length(self) -> int | None:
        """The most tokens to draft now: the policy's k, cut to the context's room, the tokens
        left and the rows the verifier may check; None: the context is full."""
        room = self._room()
        if room < 0:
            return None
        k = min(self.policy.k, room, self.max_tokens - self.stats.tokens - 1)
        rows = self.verifier.max_rows
        return min(k, rows - 1) if rows else k

    def _draft(self, k: int) -> tuple[Draft, int, float]:
        """(up to k guesses for the tokens after `pending`, trimmed by the policy and the
        grammar; draft tokens computed; seconds of drafting as the policy should count them)."""
        if not self.drafter or k <= 0:
            return Draft([]), 0, 0.0
        td = time.perf_counter()
        draft = self.drafter.propose(self.context, self.hidden.take(), k, p_min=self.policy.p_min,
                                     limit=PolicyLimit(self.policy))
        made = min(k, len(draft.tokens))
        draws = self.verifier.draws
        if draws is not None:
            at = len(self.token_ids)
            draft.u = [draws[at + j] for j in range(made)]
        n = min(made, self.policy.trim(draft), self.verifier.allows(draft.tokens[:made], draft.q))
        draft.tokens, draft.q = draft.tokens[:n], draft.q[:n]
        dt = time.perf_counter() - td
        self.stats.draft_s += dt
        self.stats.draft_steps += made
        # a head catching up on rows that waited while it did not draft reports its step time
        # without that one-off reading: counted in, a rarely drafting head would look ever more
        # expensive and draft ever less
        return draft, made, dt if draft.step_s is None else draft.step_s * made

    def _count(self, draft: Draft, n_acc: int) -> None:
        st, n = self.stats, len(draft.tokens)
        st.verify_passes += 1
        st.drafted += n
        st.accepted += n_acc
        while len(st.drafted_at) < n:
            st.drafted_at.append(0)
            st.accepted_at.append(0)
        for i in range(n):
            st.drafted_at[i] += 1
            st.accepted_at[i] += int(i < n_acc)
        row = st.by_source.setdefault(draft.source if n else "none", [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + n, row[2] + n_acc

    def _emit(self, tok: int, end: str | None = None) -> str:
        """Record one emitted token; the text that may be shown now (see TextStream). `end`:
        a finish reason that this token brings (the context is full)."""
        st = self.stats
        st.tokens += 1
        self.token_ids.append(tok)
        self.context.append(tok)
        if self.target.is_eog(tok) or self.out.add(self.target.token_bytes(tok)):
            st.finish_reason = "stop"
        elif st.tokens >= self.max_tokens:
            st.finish_reason = "length"
        elif end:
            st.finish_reason = end
        return self.out.shown(final=bool(st.finish_reason))


class TextStream:
    """Emitted tokens' bytes as text. Text that could still become the start of a stop string
    is held back until it cannot (or the generation ends), so streamed pieces always join to
    `text`; the earliest stop string a piece completes cuts the text there (llama-cpp-python
    takes the first listed one found, which can leave another stop string in the text)."""

    def __init__(self, stop: list[str] | None = None):
        self.stop = [s for s in (stop or []) if s]
        self.text = ""
        self._shown = 0  # characters of `text` handed out as pieces so far
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, data: bytes) -> bool:
        """One token's bytes; whether a stop string now ends the text."""
        piece = self._utf8.decode(data)
        self.text += piece
        hits = [at for s in self.stop
                if (at := self.text.find(s, max(0, len(self.text) - len(piece) - len(s)))) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        return bool(hits)

    def shown(self, final: bool) -> str:
        """The text that may be shown now and was not yet."""
        hold = 0 if final else self._stop_prefix()
        piece = self.text[self._shown:len(self.text) - hold]
        self._shown += len(piece)
        return piece

    def _stop_prefix(self) -> int:
        """The length of the longest end of `text` that a stop string starts with."""
        text, best = self.text, 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
