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
pass; with sampling, drafts are accepted with probability min(1, p/q) and a rejection resamples
from norm(max(0, p - q)), which keeps the target's distribution exactly.
"""

from __future__ import annotations

import codecs
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Protocol

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.runtime.policies import FixedK
from edgespec.runtime.sampling import SamplingParams, draw, probs, sample

if TYPE_CHECKING:
    from edgespec.runtime.lowrank import LowRankInfo
    from edgespec.targets import TargetSpec


class Target(Protocol):
    """A target engine (LlamaTarget, OrtTarget, the tests' mock): a tokenizer, a KV cache that
    holds `tokens` at positions 0.., batched decodes and exact rollback."""

    spec: TargetSpec  # the target's shape and tokenizer, from its GGUF file
    tokens: list[int]  # tokens whose K/V sit in the cache
    n_ctx: int
    n_threads: int
    draft_k: int  # default for the most tokens drafted per step, greedy decoding
    draft_k_sampled: int  # the same for sampling (verified with the full LM head)
    engine: str  # "llama.cpp", "onnxruntime"
    version: str  # the engine's version (stored measurements are keyed by it)
    model_file: Path  # the file whose content keys measurements cached for this engine
    lowrank: LowRankInfo | None  # the low-rank LM head greedy verification uses, if any

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]: ...
    def token_bytes(self, token: int) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    def prefill(self, tokens: list[int], last_logits: bool = False) -> np.ndarray | None: ...
    def hidden_states(self, tokens: list[int]) -> np.ndarray: ...
    def decode(self, tokens: list[int], hidden: bool = False, all_logits: bool = True,
               copy: bool = True, top_only: bool = False) -> tuple[np.ndarray, np.ndarray | None]: ...
    def truncate(self, n: int) -> None: ...
    def reset(self) -> None: ...
    def close(self) -> None: ...
    # optional: hidden_free(top_only) -> bool, whether a decode computes the hidden states
    # anyway (so reading them costs nothing)


@dataclass
class Draft:
    tokens: list[int]
    # Per draft token, the distribution it was drawn from as (target ids, probs), or None when
    # the proposal was deterministic (a one-hot q). Only sampling reads it.
    q: list[tuple[np.ndarray, np.ndarray] | None] = field(default_factory=list)
    conf: list[float] = field(default_factory=list)  # the drafter's top probability per step
    source: str = ""  # which drafter made it ("lookup", "head"): policies keep apart estimates
    # Seconds per draft step as the policy should count it, where the drafter knows better than
    # the whole call's time: a head that first reads rows waiting since it last drafted reports
    # its step without that catch-up (None: time the call)
    step_s: float | None = None


# The policy's most drafts worth making now from a named source ("lookup", "head"); drafters
# ask before drafting, so a draft step that would be trimmed away is never computed.
Limit = Callable[[str], int]

# The head reads hidden states only while the policy says it may draft within this many passes
HIDDEN_LEAD = 16


class Drafter(Protocol):
    needs_hidden: bool  # whether propose() reads the target's hidden states

    def reset(self) -> None: ...
    # drafters that read hidden states also have drop_hidden(): forget the rows kept so far
    # (the loop skipped some passes' rows)

    def propose(self, context: list[int], hidden: np.ndarray | None, k: int,
                p_min: float = 0.0, limit: Limit | None = None) -> Draft:
        """Up to k tokens to follow `context` (whose last token is pending). `hidden`: the
        target's hidden states [n, E] at the n positions before the pending token that became
        final since the last call (None for drafters that do not read them). Drafters with
        confidences stop once their top probability drops below p_min."""


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
            "exact": self.exact,
        }


def _before(sp: SamplingParams, recent: list[int], drafts: list[int], i: int) -> list[int]:
    """The tokens the penalties of verify row i look back over (none when they are off: the
    decode loop does not copy its history for nothing)."""
    return recent[-sp.penalty_last_n:] + drafts[:i] if sp.penalizes else []


def _ids(sp: SamplingParams, context, drafts: list[int], i: int) -> list[int]:
    """Every token before verify row i's choice, for the logits processors (none without)."""
    return list(context) + drafts[:i] if sp.logits_processor else []


def _accept_greedy(logits: np.ndarray, draft: Draft, sp: SamplingParams, recent: list[int],
                   grammar=None, context=()) -> tuple[int, int]:
    """(accepted count, next token): the target's argmax at each position decides (of the
    processed, biased, penalised, grammar-constrained logits where the request asks for those;
    each row sees the drafts before it). The grammar advances by every emitted token."""
    n = len(draft.tokens)
    for i in range(n + 1):  # row n (after every draft) always decides
        top = sample(logits[i], sp, None, _before(sp, recent, draft.tokens, i), grammar,
                     _ids(sp, context, draft.tokens, i))
        if grammar is not None:
            grammar.accept(top)
        if i == n or top != draft.tokens[i]:
            return i, top


def _accept_sampled(logits: np.ndarray, draft: Draft, sp: SamplingParams,
                    rng: np.random.Generator, recent: list[int], grammar=None,
                    context=()) -> tuple[int, int]:
    for i, d in enumerate(draft.tokens):
        p = probs(logits[i], sp, _before(sp, recent, draft.tokens, i), grammar,
                  _ids(sp, context, draft.tokens, i))
        q = draft.q[i] if i < len(draft.q) else None
        qd = 1.0 if q is None else float(q[1][q[0] == d].sum())
        if qd > 0 and rng.random() < min(1.0, p[d] / qd):
            if grammar is not None:
                grammar.accept(d)
            continue
        residual = p.copy()
        if q is None:
            residual[d] = 0.0
        else:
            np.subtract.at(residual, q[0], q[1])
            np.maximum(residual, 0.0, out=residual)
        if residual.sum() <= 0:  # p == q exactly: any draw from p is right
            residual = p
        tok = draw(residual / residual.sum(), rng)
        if grammar is not None:
            grammar.accept(tok)
        return i, tok
    n = len(draft.tokens)
    tok = sample(logits[n], sp, rng, _before(sp, recent, draft.tokens, n), grammar,
                 _ids(sp, context, draft.tokens, n))
    if grammar is not None:
        grammar.accept(tok)
    return n, tok


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


# Which generation each target's cache belongs to: a generation whose cache another one took
# over (two streams from one model, read in turn) stops with a clear error, not garbage.
_OWNER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Generation:
    """Iterate to stream (token id, text piece) pairs; `stats` fills in as it runs.

    Each step of the loop is one method, in the order of the module doc: `_draft`, `_verify`,
    `_accept`, `_rollback`, `_feedback`, `_emit`.
    """

    def __init__(self, target: Target, prompt: list[int], sampling: SamplingParams,
                 max_tokens: int = 128, drafter: Drafter | None = None, policy=None,
                 stop: list[str] | None = None, prompt_hidden: int = 32,
                 reuse_prefix: bool = True, logprobs: int | None = None, grammar=None,
                 stopping=None):
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
        self.stop = [s for s in (stop or []) if s]
        self.prompt_hidden = prompt_hidden  # prompt positions whose hidden states the head sees
        self.reuse_prefix = reuse_prefix  # keep the cache's common prefix with this prompt
        # logprobs=N: per emitted token, its log-probability under the model (raw logits, as
        # llama-cpp-python reports them) and the N most likely tokens; verification then reads
        # every logit (the full LM head)
        self.want_logprobs = logprobs
        self.grammar = grammar  # runtime.grammar.Grammar: constrains every emitted token
        # llama-cpp-python's stopping criteria: f(input_ids, logits) -> True stops before the
        # token those logits chose (input_ids: every token before it, prompt included)
        self.stopping = stopping
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.want_hidden = bool(drafter and drafter.needs_hidden)
        self._head_source = getattr(drafter, "source", "head")  # the name its head drafts under
        self._reading = False  # whether the last pass read hidden states (see `_read_hidden`)
        # greedy passes that read only argmaxes (the low-rank LM head may answer them)
        self._top_only = (sampling.greedy and not sampling.adjusts_logits and logprobs is None
                          and grammar is None and stopping is None)
        free = getattr(target, "hidden_free", None)
        self._hidden_free = bool(free and free(self._top_only))
        if drafter is not None and hasattr(drafter, "set_sampling"):
            drafter.set_sampling(None if sampling.greedy else sampling.temperature, sampling.seed)
        self.stats = Stats(prompt_tokens=len(prompt))
        # Bit-exact greedy: where the engine's decodes of up to n tokens give each row the
        # numbers of one-token decodes (`invariant_batch`, n >= 2) and verification reads the
        # full LM head, a pass checks at most n rows and the prompt is prefilled as
        # llama_cpp.Llama does it, so the text is plain greedy decoding's, bit for bit.
        self.exact_rows = 0
        lowrank = self._top_only and getattr(target, "lowrank_head", None) is not None
        if sampling.greedy and not lowrank and hasattr(target, "invariant_batch"):
            n = target.invariant_batch()
            self.exact_rows = n if n >= 2 else 0
        self.stats.exact = self.exact_rows > 0
        self._first_logits: np.ndarray | None = None  # exact mode: the prompt's last row
        self.text = ""
        self._shown = 0  # characters of `text` handed out as pieces so far
        self.token_ids: list[int] = []
        self.context: list[int] = []  # every token so far, the pending one included
        self.pending = prompt[-1]  # the newest token: chosen, not yet in the cache
        self._fresh_hidden: list[np.ndarray] = []  # hidden rows the drafter has not seen yet
        self._rng = np.random.default_rng(sampling.seed)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __iter__(self) -> Iterator[tuple[int, str]]:
        st = self.stats
        self._prefill()
        t_start = time.perf_counter()
        try:
            if self._first_logits is not None:  # exact mode: the prefill chose the first token
                logits, self._first_logits = self._first_logits[None, :], None
                st.verify_passes += 1  # the prompt's pass checked it (tokens per pass stay honest)
                _, nxt = self._accept(logits, Draft([]))
                if self.want_logprobs is not None:
                    self._record_logprobs(logits, [nxt])
                if self._stops_at(logits, [nxt]) == 0:
                    return
                yield nxt, self._emit(nxt, "context" if self._room() < 0 else None)
                if st.finish_reason:
                    return
                self.pending = nxt
            while True:
                if _OWNER.get(self.target) is not self:
                    raise EdgespecError("another generation used this model since this one "
                                        "started; finish one stream before reading another")
                k = self._draft_length()
                if k is None:
                    st.finish_reason = "context"
                    return
                draft = self._draft(k)
                tv = time.perf_counter()
                logits, hidden = self._verify(draft)
                self.policy.observe_verify(1 + len(draft.tokens), time.perf_counter() - tv)
                n_acc, nxt = self._accept(logits, draft)
                toks = draft.tokens[:n_acc] + [nxt]
                if self.want_logprobs is not None:
                    self._record_logprobs(logits, toks)
                cut = self._stops_at(logits, toks)
                self._rollback(draft, n_acc, hidden)
                st.verify_s += time.perf_counter() - tv
                self._feedback(draft, n_acc)
                full = self._room() < 0  # no room to check `nxt`: this pass ends the generation
                for i, tok in enumerate(toks):
                    if i == cut:
                        return
                    piece = self._emit(tok, "context" if full and i == len(toks) - 1 else None)
                    yield tok, piece
                    if st.finish_reason:
                        return
                self.pending = nxt
        finally:
            st.decode_s = time.perf_counter() - t_start
            if not st.finish_reason:
                st.finish_reason = "stopped"
            self.policy.finish()

    def _prefill(self) -> None:
        """The prompt but its last token into the cache; the head's prompt rows read on the way.
        What the cache already holds of the prompt's start (the last call's prompt and reply,
        in a chat) is kept, as llama_cpp.Llama does: only the rest is decoded."""
        t, t0 = self.target, time.perf_counter()
        _OWNER[t] = self
        layers = tuple(getattr(self.drafter, "feature_layers", ()) or ())
        if hasattr(t, "set_feature_layers"):
            t.set_feature_layers(layers)  # () for every other drafter: plain hidden states
        elif layers:
            raise EdgespecError("this engine cannot read the layer inputs an EAGLE-3 head needs; "
                                "run it on a llama.cpp target")
        if self.drafter:
            self.drafter.reset()
        self._reading = self._read_hidden()
        self.context = list(self.prompt)
        if self.exact_rows:
            # as llama_cpp.Llama: the whole prompt (less what the cache holds, at least one
            # token) in n_batch chunks, logits of the last row only. The head reads no prompt
            # rows (asking for them would make every row an output, other numbers).
            keep = min(common_prefix(t.tokens, self.prompt),
                       len(self.prompt) - 1) if self.reuse_prefix else 0
            if keep:
                t.truncate(keep)
            else:
                t.reset()
            self.stats.prompt_reused = keep
            self._first_logits = t.prefill(self.prompt[keep:], last_logits=True)
            self.stats.prefill_s = time.perf_counter() - t0
            return
        n_h = min(len(self.prompt) - 1, self.prompt_hidden) if self._reading else 0
        n_plain = len(self.prompt) - 1 - n_h
        keep = common_prefix(t.tokens, self.prompt[:n_plain]) if self.reuse_prefix else 0
        if keep:
            t.truncate(keep)
        else:
            t.reset()
        self.stats.prompt_reused = keep
        t.prefill(self.prompt[keep:n_plain])
        if n_h:
            self._fresh_hidden.append(t.hidden_states(self.prompt[n_plain:-1]))
        self.stats.prefill_s = time.perf_counter() - t0

    def _room(self) -> int:
        """Tokens the cache can still take after the pending one."""
        return self.target.n_ctx - len(self.target.tokens) - 1

    def _draft_length(self) -> int | None:
        """The most tokens to draft now (policy, context room, tokens left); None: context full."""
        room = self._room()
        if room < 0:
            return None
        k = min(self.policy.next_k(), room, self.max_tokens - self.stats.tokens - 1)
        return min(k, self.exact_rows - 1) if self.exact_rows else k

    def _draft(self, k: int) -> Draft:
        """Up to k guesses for the tokens after `pending`, trimmed by the policy."""
        if not self.drafter or k <= 0:
            return Draft([])
        st, td = self.stats, time.perf_counter()
        rows = np.concatenate(self._fresh_hidden) if self._fresh_hidden else None
        self._fresh_hidden = []
        draft = self.drafter.propose(self.context, rows, k, p_min=self.policy.p_min,
                                     limit=self.policy.limit)
        n_made = min(k, len(draft.tokens))
        n = min(n_made, self.policy.trim(draft), self._grammar_allows(draft, n_made))
        draft.tokens, draft.q = draft.tokens[:n], draft.q[:n]
        dt = time.perf_counter() - td
        st.draft_s += dt
        st.draft_steps += n_made
        # a head catching up on rows that waited while it did not draft reports its step time
        # without that one-off reading: counted in, a rarely drafting head would look ever more
        # expensive and draft ever less
        self.policy.observe_draft_time(dt if draft.step_s is None else draft.step_s * n_made,
                                       n_made, draft.source)
        return draft

    def _grammar_allows(self, draft: Draft, n: int) -> int:
        """How many of the first n drafts, in order, the grammar lets through (checked on a
        copy of it). Only one-hot drafts are cut: a draft drawn from a reported q must reach
        verification as drawn (p(d) = 0 rejects it there) for the rejection rule to stay exact."""
        tokens = draft.tokens[:n]
        if self.grammar is None or not tokens or any(q is not None for q in draft.q[:n]):
            return len(tokens)
        g = self.grammar.clone()
        try:
            for i, tok in enumerate(tokens):
                if not g.allows([tok])[0]:
                    return i
                g.accept(tok)
            return len(tokens)
        finally:
            g.close()

    def _read_hidden(self) -> bool:
        """Whether the next pass reads hidden states: only while the head may draft within
        `HIDDEN_LEAD` passes, unless the engine computes them anyway (`hidden_free`: the low-rank
        LM head reads them for every greedy pass). Reading them costs every pass something
        (embeddings mode), so a head the policy holds at zero between rare tries costs nothing
        meanwhile; it restarts from the rows read in the passes before its try (as it does
        after a long pause)."""
        return self.want_hidden and (self._hidden_free or self.policy.soon(self._head_source, HIDDEN_LEAD))

    def _verify(self, draft: Draft) -> tuple[np.ndarray, np.ndarray | None]:
        """One batched target pass over [pending] + drafts: logits (and hidden states) per row,
        views valid until the target's next decode."""
        reading = self._read_hidden()
        if self.want_hidden and not reading and self._reading:
            # a gap: rows from before it must not be read as if they were contiguous with later
            # ones (the head restarts its cache on the rows that follow)
            self._fresh_hidden = []
            self.drafter.drop_hidden()
        self._reading = reading
        if reading:
            self.stats.hidden_passes += 1
        return self.target.decode([self.pending] + draft.tokens, hidden=reading,
                                  all_logits=bool(draft.tokens), copy=False, top_only=self._top_only)

    def _accept(self, logits: np.ndarray, draft: Draft) -> tuple[int, int]:
        """(drafts accepted, the target's own next token)."""
        ctx = self.context if self.sampling.logits_processor else ()
        if self.sampling.greedy:
            return _accept_greedy(logits, draft, self.sampling, self.token_ids, self.grammar, ctx)
        return _accept_sampled(logits, draft, self.sampling, self._rng, self.token_ids,
                               self.grammar, ctx)

    def _record_logprobs(self, logits: np.ndarray, emitted: list[int]) -> None:
        """Row i of the verify pass predicted emitted token i."""
        for row, tok in zip(logits, emitted):
            x = row.astype(np.float64)
            lp = x - x.max()
            lp -= np.log(np.exp(lp).sum())
            n = self.want_logprobs
            top = np.argpartition(-lp, n - 1)[:n] if 0 < n < lp.size else np.arange(min(n, lp.size))
            top = top[np.argsort(-lp[top], kind="stable")]
            self.logprobs.append((float(lp[tok]), [(int(t), float(lp[t])) for t in top]))

    def _stops_at(self, logits: np.ndarray, toks: list[int]) -> int | None:
        """The first of these tokens (row i of `logits` chose token i) that a stopping
        criterion refuses: the generation ends before it ("stop"); None: no criterion fires."""
        if self.stopping is None:
            return None
        for i in range(len(toks)):
            ids = np.asarray(self.context + toks[:i], dtype=np.intc)
            if self.stopping(ids, np.asarray(logits[i], dtype=np.float32)):
                self.stats.finish_reason = "stop"
                return i
        return None

    def _rollback(self, draft: Draft, n_acc: int, hidden: np.ndarray | None) -> None:
        """Keep the hidden states of the accepted rows, then drop the rejected drafts from the
        cache. The copy comes first: a rollback may re-decode and overwrite the engine's buffers."""
        if hidden is not None:
            self._fresh_hidden.append(hidden[:n_acc + 1].copy())
        if n_acc < len(draft.tokens):
            t = self.target
            t.truncate(len(t.tokens) - len(draft.tokens) + n_acc)

    def _feedback(self, draft: Draft, n_acc: int) -> None:
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
        self.policy.update(n, n_acc, draft.source)

    def _emit(self, tok: int, end: str | None = None) -> str:
        """Record one emitted token; the text that may be shown now. Text that could still
        become the start of a stop string is held back until it cannot (or the generation
        ends), so streamed pieces always join to `text`. `end`: a finish reason that this
        token brings (the context is full)."""
        st = self.stats
        st.tokens += 1
        self.token_ids.append(tok)
        self.context.append(tok)
        if self.target.is_eog(tok):
            st.finish_reason = "stop"
        else:
            piece = self._utf8.decode(self.target.token_bytes(tok))
            self.text += piece
            # the earliest stop string this piece completes cuts (llama-cpp-python takes the
            # first listed one found, which can leave another stop string in the text)
            hits = [at for s in self.stop
                    if (at := self.text.find(s, max(0, len(self.text) - len(piece) - len(s)))) >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                st.finish_reason = "stop"
        if not st.finish_reason:
            if st.tokens >= self.max_tokens:
                st.finish_reason = "length"
            elif end:
                st.finish_reason = end
        hold = 0 if st.finish_reason else self._stop_prefix()
        shown = self.text[self._shown:len(self.text) - hold]
        self._shown += len(shown)
        return shown

    def _stop_prefix(self) -> int:
        """The length of the longest end of `text` that a stop string starts with."""
        text, best = self.text, 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
