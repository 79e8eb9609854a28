"""Drafters for the decode loop: the trained MTP head (numpy) and training-free prompt lookup.

A drafter gets, at each step, the whole context (its last token is the pending one, not yet in
the target's cache) and the target's hidden states for positions that became final since the
last call, and proposes up to k tokens: fewer where the policy's `limit(source)` says a longer
draft from that source would not pay (asked before drafting, so unpaid draft steps cost nothing).
"""

from __future__ import annotations

import hashlib
import time

from pathlib import Path

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.runtime.assets import default_head
from edgespec.runtime.decoding import Draft, Drafter, Limit
from edgespec.runtime.heads import load_head
from edgespec.runtime.sampling import SamplingParams, chain
from edgespec.targets import embedding_rows


class PromptLookup(Drafter):
    """N-gram lookup in the context (as llama.cpp's lookup decoding): find the latest earlier
    occurrence of the context's last n tokens (n from max_ngram down to min_ngram) and propose
    the tokens that followed it.

    Each drafted token carries a score of the match behind it (`Draft.conf`): with m the length
    of the match (the n-gram, extended backwards while the tokens before both occurrences agree,
    up to `MATCH_CAP`), the j-th token scores (m + j) / (m + j + 2). It is not a probability: the
    cost policy learns what each score band is accepted at (a long match is being copied and is
    usually right to its end; a one-token match often is not)."""

    needs_hidden = False
    MATCH_CAP = 32

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.last_match = 0  # n-gram length behind the latest proposal (0: none)
        # the draft source: matches of 2 or more tokens are accepted more often than 1-token
        # ones, so the policy keeps their estimates apart
        if min_ngram == 1:
            self.name = "lookup" if max_ngram > 1 else "lookup1"
        else:
            self.name = f"lookup{min_ngram}+"
        self.reset()

    def reset(self) -> None:
        self._toks: list[int] = []  # the context indexed so far
        self._index: dict[tuple, int] = {}  # n-gram -> its latest start, for n-grams followed by a token

    def _update(self, context: list[int]) -> None:
        """Index every n-gram of `context` that some token follows (the context only grows
        within a generation: new tokens cost a few dict writes, not a scan)."""
        n0 = len(self._toks)
        if n0 > len(context) or context[:n0] != self._toks:
            self.reset()
            n0 = 0
        idx = self._index
        # n-grams ending at position e (e <= len - 2) are followed by a token
        for e in range(max(0, n0 - 1), len(context) - 1):
            for n in range(self.min_ngram, min(self.max_ngram, e + 1) + 1):
                idx[tuple(context[e - n + 1:e + 1])] = e - n + 1
        self._toks.extend(context[len(self._toks):])

    def propose(self, context: list[int], hidden, k: int, p_min: float = 0.0,
                limit: Limit | None = None) -> Draft:
        """The policy's limit is asked only when there is something to propose, so its tries
        land on passes where the context repeats."""
        self._update(context)
        n_ctx = len(context)
        self.last_match = 0
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            s = self._index.get(tuple(context[n_ctx - n:]))
            if s is not None:
                self.last_match = n
                k = min(k, limit(self.name)) if limit else k
                back = 0  # tokens before both occurrences that agree too
                while (back < self.MATCH_CAP and s - 1 - back >= 0
                       and context[s - 1 - back] == context[n_ctx - n - 1 - back]):
                    back += 1
                m = n + back
                toks = list(context[s + n:s + n + max(k, 0)])
                return Draft(toks, conf=[(m + j) / (m + j + 2) for j in range(len(toks))],
                             source=self.name)
        return Draft([], source=self.name)


def single_thread_blas() -> None:
    """The head's matrices are small; OpenBLAS threads would only spin-wait between calls and
    steal the cores llama.cpp's threads need."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")


class HeadDrafter(Drafter):
    """Drafts with a trained MTP head next to its target: greedy chain, confidence stop.

    Rows that arrive while the head is not drafting wait; when it next drafts it reads at most
    the last `max_catch_up` of them (restarting its cache there, as at a prompt, whose last 32
    positions it reads), so a long pause never makes one draft step cost a long prefill."""

    needs_hidden = True
    max_catch_up = 32
    source = "head"  # the name the policy keeps this head's estimates under

    def __init__(self, path: str | Path, target_spec, source: str = "head"):
        """`path`: a head GGUF or ONNX file (`edgespec export gguf|onnx`) or a training
        checkpoint folder. `source`: the name its drafts carry (`make_drafter` gives each head
        other than the shipped one a name of its own, so two heads never share estimates)."""
        self.source = source
        self.head, info = load_head(path)
        if info.fingerprint != target_spec.tokenizer_fingerprint:
            raise EdgespecError(f"head {path} was trained for target '{info.target}' (fingerprint "
                                f"{info.fingerprint}), not for {target_spec.name} "
                                f"({target_spec.tokenizer_fingerprint})")
        self.ids = info.draft_ids
        if len(self.ids) and (self.ids.min() < 0 or self.ids.max() >= target_spec.n_vocab):
            raise EdgespecError(f"head {path}: its draft vocabulary holds ids outside the "
                                f"target's {target_spec.n_vocab} tokens")
        # an EAGLE-3 head reads three of the target's layer inputs with each hidden state
        self.feature_layers = tuple(getattr(info.config, "target_layers", ()) or ())
        self.embed = embedding_rows(target_spec)
        self.name = str(path)
        self.pending: list[np.ndarray] = []  # hidden rows not yet fed to the head
        self.sampling: SamplingParams | None = None  # sampled decoding: drafts drawn from the head
        self._rng = np.random.default_rng()
        self._draws = None  # sampled decoding: the target's uniform draw for draft j
        self._one_row_s: float | None = None  # a one-row draft step, seconds (running mean)
        single_thread_blas()

    def set_sampling(self, sampling: SamplingParams | None, draws=None) -> None:
        """Sampled decoding: draft j is the token the head's own distribution, cut and tempered
        as the request cuts the target's (top-k, typical, top-p, min-p, temperature), gives
        for `draws(j)`, the uniform draw the target's row for that token will use
        (verify.SampledVerifier): where the head's distribution is near the target's, both
        pick the same token from the same draw. The target's choice never depends on the
        draft, so any draft keeps its law. draws None: the head's own random stream. sampling
        None: greedy chains."""
        if sampling is None or sampling.greedy:
            self.sampling = None
            return
        self.sampling = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k,
                                       top_p=sampling.top_p, min_p=sampling.min_p,
                                       typical_p=sampling.typical_p)
        seed = sampling.seed
        self._rng = np.random.default_rng(None if seed is None else [seed, 7])
        self._draws = draws

    def reset(self) -> None:
        self.head.reset()
        self.pending = []

    def drop_hidden(self) -> None:
        """Forget the rows kept so far: the next draft restarts the head's cache on the rows
        that arrive after (they are not contiguous with these)."""
        self.pending = []

    def keep(self, hidden: np.ndarray | None) -> None:
        """Hidden rows for later: the head reads them, in one batch, when it next drafts."""
        if hidden is not None and len(hidden):
            self.pending.append(hidden)  # the decode loop hands over fresh arrays
            while len(self.pending) > 1 and sum(map(len, self.pending[1:])) >= self.max_catch_up:
                self.pending.pop(0)

    def propose(self, context: list[int], hidden: np.ndarray | None, k: int,
                p_min: float = 0.0, limit: Limit | None = None) -> Draft:
        """`hidden`: target hidden states [n, E] for the n positions before the pending token
        that the head has not seen yet (pair: hidden at m, token at m + 1)."""
        self.keep(hidden)
        if limit:
            k = min(k, limit(self.source))
        if k <= 0 or not self.pending:
            return Draft([], source=self.source)
        hidden = np.concatenate(self.pending)[-self.max_catch_up:]
        self.pending = []
        return self._chain(context, hidden, k, p_min)

    def _chain(self, context: list[int], hidden: np.ndarray, k: int, p_min: float) -> Draft:
        """Feed the new rows, then draft a greedy chain of up to k tokens."""
        h = self.head
        n_ctx = len(context)
        pos0 = n_ctx - 1 - len(hidden)
        if pos0 != h.n:  # a new prompt, or rows were skipped: restart the cache at these rows
            h.reset()
        t0 = time.perf_counter()
        out, _ = h.forward(self.embed[np.asarray(context[pos0 + 1:n_ctx])], hidden, pos0,
                           commit=True)
        t1 = time.perf_counter()
        drafts, conf, qs, cache = [], [], [], (h.k, h.v)
        for j in range(k):
            lg = h.last_logits
            if self.sampling is not None:
                q = chain(lg, self.sampling)
                best = q.pick(self._draws(j)) if self._draws else q.draw(self._rng)
                top = float(q.p.max())
            else:
                best = int(np.argmax(lg))
                top = float(1.0 / np.exp(lg - lg[best]).sum())
            if top < p_min and j > 0:
                break
            tok = int(self.ids[best])
            drafts.append(tok)
            conf.append(top)
            qs.append((self.ids[q.ids], q.p) if self.sampling is not None else None)
            if j + 1 < k:
                out, cache = h.forward(self.embed[np.array([tok])], out[-1:], n_ctx - 1 + j,
                                       commit=False, cache=cache)
        # the step the policy should count: one-row forwards; the first one read every waiting
        # row, which costs what it costs once and less the more often the head drafts
        t2 = time.perf_counter()
        if len(drafts) > 1 or len(hidden) <= 2:
            step = (t2 - t1) / (len(drafts) - 1) if len(drafts) > 1 else t1 - t0
            last = self._one_row_s
            self._one_row_s = step if last is None else last + 0.2 * (step - last)
        return Draft(drafts, q=qs, conf=conf, source=self.source, step_s=self._one_row_s)


class MixedDrafter(Drafter):
    """Prompt lookup where the context repeats itself, the head everywhere else, and a one-token
    lookup match where the policy holds the head back.

    When the context's last `min_match` or more tokens occurred before, the tokens that followed
    them are the draft (free to make, and often right: greedy text and code repeat). Otherwise
    the head drafts, where the policy lets it (its acceptance estimates say a draft pays). Where
    it does not, the tokens that followed the last occurrence of the context's last token are
    the draft (source "lookup1", with estimates of its own): a policy that learned the head does
    not pay on this text no longer leaves those passes undrafted, as lookup alone would not.
    The head only reads the target's hidden states when it drafts: rows that arrive meanwhile
    are kept and fed to it in one batch, so its cache stays complete."""

    needs_hidden = True

    def __init__(self, head: HeadDrafter, lookup: PromptLookup | None = None, min_match: int = 2):
        # lookup only proposes n-grams of min_match or more: the head drafts everywhere else
        self.head, self.min_match = head, min_match
        self.lookup = lookup or PromptLookup(min_ngram=min_match)
        self.single = PromptLookup(max_ngram=1, min_ngram=1) if min_match > 1 else None
        self.name = f"{head.name}+lookup"
        self.source = head.source  # the head's: the decode loop reads hidden states for it
        self.feature_layers = head.feature_layers

    def reset(self) -> None:
        self.head.reset()
        self.lookup.reset()
        if self.single:
            self.single.reset()

    def set_sampling(self, sampling: SamplingParams | None, draws=None) -> None:
        self.head.set_sampling(sampling, draws)

    def drop_hidden(self) -> None:
        self.head.drop_hidden()

    def propose(self, context: list[int], hidden, k: int, p_min: float = 0.0,
                limit: Limit | None = None) -> Draft:
        self.head.keep(hidden)
        d = self.lookup.propose(context, None, k, limit=limit)
        if d.tokens and self.lookup.last_match >= self.min_match:
            return d
        d = self.head.propose(context, None, k, p_min, limit)
        if d.tokens or self.single is None:
            return d
        return self.single.propose(context, None, k, limit=limit)


def make_drafter(draft: str | None, spec):
    """A drafter from its command-line name: None/"none" (target only), "lookup" (prompt
    lookup), "default" (the head shipped for the target, mixed with prompt lookup), a head file
    or checkpoint folder (mixed with prompt lookup), or "head:default" / "head:PATH" for the
    head alone."""
    if draft in (None, "", "none"):
        return None
    if draft == "lookup":
        return PromptLookup()
    alone = draft.startswith("head:")
    name = draft[len("head:"):] if alone else draft
    if name == "default":
        head = HeadDrafter(default_head(spec), spec)
    else:  # its own name: estimates learned for one head never steer another
        where = str(Path(name).resolve()).encode()
        head = HeadDrafter(name, spec, source=f"head:{hashlib.sha1(where).hexdigest()[:8]}")
    return head if alone else MixedDrafter(head)
