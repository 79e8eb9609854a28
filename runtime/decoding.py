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
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.runtime.policies import FixedK
from edgespec.runtime.sampling import SamplingParams, draw, probs, sample


class Target(Protocol):
    tokens: list[int]
    n_ctx: int

    def prefill(self, tokens: list[int]) -> None: ...
    def decode(self, tokens: list[int], hidden: bool = False, all_logits: bool = True,
               copy: bool = True, top_only: bool = False) -> tuple[np.ndarray, np.ndarray | None]: ...
    def truncate(self, n: int) -> None: ...
    def reset(self) -> None: ...
    def is_eog(self, token: int) -> bool: ...
    def token_bytes(self, token: int) -> bytes: ...


@dataclass
class Draft:
    tokens: list[int]
    # Per draft token, the distribution it was drawn from as (target ids, probs), or None when
    # the proposal was deterministic (a one-hot q). Only sampling reads it.
    q: list[tuple[np.ndarray, np.ndarray] | None] = field(default_factory=list)
    conf: list[float] = field(default_factory=list)  # the drafter's top probability per step
    source: str = ""  # which drafter made it ("lookup", "head"): policies keep apart estimates


class Drafter(Protocol):
    needs_hidden: bool  # whether propose() reads the target's hidden states

    def reset(self) -> None: ...

    def propose(self, context: list[int], hidden: np.ndarray | None, k: int,
                p_min: float = 0.0) -> Draft:
        """Up to k tokens to follow `context` (whose last token is pending). `hidden`: the
        target's hidden states [n, E] at the n positions before the pending token that became
        final since the last call (None for drafters that do not read them). Drafters with
        confidences stop once their top probability drops below p_min."""


@dataclass
class Stats:
    prompt_tokens: int = 0
    tokens: int = 0  # emitted
    verify_passes: int = 0
    drafted: int = 0  # draft tokens sent to verification
    draft_steps: int = 0  # draft tokens computed (a policy may trim some before verifying)
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted count per draft position
    drafted_at: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # all time after prefill: drafting + verifying + bookkeeping
    draft_s: float = 0.0
    verify_s: float = 0.0
    finish_reason: str = ""

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
            "prompt_tokens": self.prompt_tokens, "tokens": self.tokens,
            "verify_passes": self.verify_passes, "drafted": self.drafted,
            "draft_steps": self.draft_steps,
            "accepted": self.accepted, "mean_accepted": round(self.mean_accepted, 4),
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position()],
            "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
            "draft_s": round(self.draft_s, 4), "verify_s": round(self.verify_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3), "finish_reason": self.finish_reason,
        }


def _accept_greedy(logits: np.ndarray, drafts: list[int]) -> tuple[int, int]:
    """(accepted count, next token): the target's argmax at each position decides."""
    for i, d in enumerate(drafts):
        top = int(np.argmax(logits[i]))
        if top != d:
            return i, top
    return len(drafts), int(np.argmax(logits[len(drafts)]))


def _accept_sampled(logits: np.ndarray, draft: Draft, sp: SamplingParams,
                    rng: np.random.Generator) -> tuple[int, int]:
    for i, d in enumerate(draft.tokens):
        p = probs(logits[i], sp)
        q = draft.q[i] if i < len(draft.q) else None
        qd = 1.0 if q is None else float(q[1][q[0] == d].sum())
        if qd > 0 and rng.random() < min(1.0, p[d] / qd):
            continue
        residual = p.copy()
        if q is None:
            residual[d] = 0.0
        else:
            np.subtract.at(residual, q[0], q[1])
            np.maximum(residual, 0.0, out=residual)
        if residual.sum() <= 0:  # p == q exactly: any draw from p is right
            residual = p
        return i, draw(residual / residual.sum(), rng)
    return len(draft.tokens), sample(logits[len(draft.tokens)], sp, rng)


class Generation:
    """Iterate to stream (token id, text piece) pairs; `stats` fills in as it runs."""

    def __init__(self, target: Target, prompt: list[int], sampling: SamplingParams,
                 max_tokens: int = 128, drafter: Drafter | None = None, policy=None,
                 stop: list[str] | None = None, prompt_hidden: int = 32):
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
        self.stats = Stats(prompt_tokens=len(prompt))
        self.text = ""
        self.token_ids: list[int] = []

    def __iter__(self) -> Iterator[tuple[int, str]]:
        t, st, sp = self.target, self.stats, self.sampling
        rng = np.random.default_rng(sp.seed)
        want_hidden = bool(self.drafter and self.drafter.needs_hidden)
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        t0 = time.perf_counter()
        t.reset()
        n_h = min(len(self.prompt) - 1, self.prompt_hidden) if want_hidden else 0
        n_plain = len(self.prompt) - 1 - n_h
        t.prefill(self.prompt[:n_plain])
        fresh_hidden = []  # hidden rows the drafter has not seen yet
        if self.drafter:
            self.drafter.reset()
        if n_h:
            fresh_hidden.append(t.hidden_states(self.prompt[n_plain:-1]))
        st.prefill_s = time.perf_counter() - t0
        pending = self.prompt[-1]
        context = list(self.prompt)  # every token so far, pending included
        t_start = time.perf_counter()
        try:
            while True:
                room = t.n_ctx - len(t.tokens) - 1
                if room < 0:
                    st.finish_reason = "context"
                    return
                k = min(self.policy.next_k(), room, self.max_tokens - st.tokens - 1)
                draft = Draft([])
                if self.drafter and k > 0 and (fresh_hidden or not want_hidden):
                    td = time.perf_counter()
                    rows = np.concatenate(fresh_hidden) if fresh_hidden else None
                    fresh_hidden = []
                    draft = self.drafter.propose(context, rows, k, p_min=self.policy.p_min)
                    n_made = min(k, len(draft.tokens))
                    n = min(n_made, self.policy.trim(draft))
                    draft.tokens, draft.q = draft.tokens[:n], draft.q[:n]
                    dt = time.perf_counter() - td
                    st.draft_s += dt
                    st.draft_steps += n_made
                    self.policy.observe_draft_time(dt, n_made)
                tv = time.perf_counter()
                base = len(t.tokens)
                logits, hid = t.decode([pending] + draft.tokens, hidden=want_hidden,
                                       all_logits=bool(draft.tokens), copy=False,
                                       top_only=sp.greedy)
                if sp.greedy:
                    n_acc, nxt = _accept_greedy(logits, draft.tokens)
                else:
                    n_acc, nxt = _accept_sampled(logits, draft, sp, rng)
                if n_acc < len(draft.tokens):
                    t.truncate(base + 1 + n_acc)
                st.verify_s += time.perf_counter() - tv
                st.verify_passes += 1
                self._count(len(draft.tokens), n_acc)
                self.policy.update(len(draft.tokens), n_acc, draft.source)
                if hid is not None:
                    fresh_hidden.append(hid[:n_acc + 1].copy())
                for tok in draft.tokens[:n_acc] + [nxt]:
                    context.append(tok)
                    piece = self._emit(tok, utf8)
                    yield tok, piece
                    if st.finish_reason:
                        return
                pending = nxt
        finally:
            st.decode_s = time.perf_counter() - t_start
            if not st.finish_reason:
                st.finish_reason = "stopped"

    def _count(self, drafted: int, accepted: int) -> None:
        st = self.stats
        st.drafted += drafted
        st.accepted += accepted
        while len(st.drafted_at) < drafted:
            st.drafted_at.append(0)
            st.accepted_at.append(0)
        for i in range(drafted):
            st.drafted_at[i] += 1
            st.accepted_at[i] += int(i < accepted)

    def _emit(self, tok: int, utf8) -> str:
        st = self.stats
        st.tokens += 1
        self.token_ids.append(tok)
        if self.target.is_eog(tok):
            st.finish_reason = "stop"
            return ""
        piece = utf8.decode(self.target.token_bytes(tok))
        self.text += piece
        for s in self.stop:
            at = self.text.find(s, max(0, len(self.text) - len(piece) - len(s)))
            if at >= 0:
                cut = len(self.text) - at
                self.text = self.text[:at]
                piece = piece[:max(0, len(piece) - cut)]
                st.finish_reason = "stop"
                return piece
        if st.tokens >= self.max_tokens:
            st.finish_reason = "length"
        return piece
