"""Verifiers: from one verify pass's rows, which drafts stand and the target's next token.

A Verifier is built once per request (`make_verifier`) from the sampling settings, grammar,
logprobs and stopping criteria; the decode loop hands it each pass's logits and draft and
gets a `Verdict` back. Variants:
    GreedyVerifier   the target's argmax at each row decides (of the processed, biased,
                     penalised, grammar-constrained logits where the request asks for those)
    ExactVerifier    greedy, at most `max_rows` rows a pass, on an engine whose batches of that
                     many rows give one-token numbers: the text is plain greedy decoding's
    SampledVerifier  each row's token is the one llama.cpp's sampler draws for that position
                     (its chain, its dist draw from the request's seed); a draft stands where
                     it is that token
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.runtime.sampling import LlamaDraws, SamplingParams, chain, log_softmax, sample


@dataclass
class Verdict:
    accepted: int  # drafts the target agreed with
    tokens: list[int]  # the accepted drafts, then the target's own next token
    cut: int | None = None  # the first of `tokens` a stopping criterion refuses (None: none)


class Verifier:
    top_only = False  # rows need only their top token (the low-rank LM head may answer them)
    draws = None  # sampling: the request's uniform draws, by generated-token position
    max_rows = 0  # the most rows one pass may check (0: no cap)
    exact = False  # text equal to plain greedy decoding's, bit for bit
    # the first token is chosen from the logits of the prompt's own last row, the prompt
    # prefilled whole as llama_cpp.Llama prefills it (where no head reads its rows)
    prompt_logits = False

    def __init__(self, sampling: SamplingParams, grammar=None, logprobs: int | None = None,
                 stopping=None):
        self.sampling, self.grammar, self.stopping = sampling, grammar, stopping
        # logprobs=N: per emitted token, its log-probability under the model (raw logits, as
        # llama-cpp-python reports them) and the N most likely tokens
        self.want_logprobs = logprobs
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []

    def verify(self, logits: np.ndarray, drafts: list[int], q: list, context: list[int],
               emitted: list[int]) -> Verdict:
        """Row i of `logits` follows `context` (every token so far, the pending one last) and
        drafts[:i]; `emitted`: the tokens generated so far (what the penalties look back over)."""
        n_acc, nxt = self.accept(logits, drafts, q, context, emitted)
        toks = drafts[:n_acc] + [nxt]
        if self.want_logprobs is not None:
            self._record_logprobs(logits, toks)
        return Verdict(n_acc, toks, self._stops_at(logits, toks, context))

    def accept(self, logits, drafts, q, context, emitted) -> tuple[int, int]:
        raise NotImplementedError

    def allows(self, drafts: list[int], q: list) -> int:
        """How many of these drafts, in order, the grammar lets through (checked on a copy of
        it): a draft the grammar forbids cannot be the token a row chooses."""
        if self.grammar is None or not drafts:
            return len(drafts)
        g = self.grammar.clone()
        try:
            for i, tok in enumerate(drafts):
                if not g.allows([tok])[0]:
                    return i
                g.accept(tok)
            return len(drafts)
        finally:
            g.close()

    # -- what every variant shares ------------------------------------------------------------
    def _recent(self, emitted: list[int], drafts: list[int], i: int) -> list[int]:
        """The tokens the penalties of row i look back over (none when they are off: the
        loop's history is not copied for nothing)."""
        sp = self.sampling
        return emitted[-sp.penalty_last_n:] + drafts[:i] if sp.penalizes else []

    def _ids(self, context, drafts: list[int], i: int) -> list[int]:
        """Every token before row i's choice, for the logits processors (none without)."""
        return list(context) + drafts[:i] if self.sampling.logits_processor else []

    def _take(self, tok: int) -> int:
        if self.grammar is not None:
            self.grammar.accept(tok)
        return tok

    def _record_logprobs(self, logits: np.ndarray, emitted: list[int]) -> None:
        """Row i of the verify pass predicted emitted token i."""
        n = self.want_logprobs
        for row, tok in zip(logits, emitted):
            lp = log_softmax(row)
            top = np.argpartition(-lp, n - 1)[:n] if 0 < n < lp.size else np.arange(min(n, lp.size))
            top = top[np.argsort(-lp[top], kind="stable")]
            self.logprobs.append((float(lp[tok]), [(int(t), float(lp[t])) for t in top]))

    def _stops_at(self, logits: np.ndarray, toks: list[int], context: list[int]) -> int | None:
        """The first of these tokens (row i chose token i) that a stopping criterion refuses."""
        if self.stopping is None:
            return None
        for i in range(len(toks)):
            ids = np.asarray(context + toks[:i], dtype=np.intc)
            if self.stopping(ids, np.asarray(logits[i], dtype=np.float32)):
                return i
        return None


class GreedyVerifier(Verifier):
    def __init__(self, sampling: SamplingParams, grammar=None, logprobs: int | None = None,
                 stopping=None, top_only: bool = False):
        super().__init__(sampling, grammar, logprobs, stopping)
        self.top_only = top_only

    def accept(self, logits, drafts, q, context, emitted) -> tuple[int, int]:
        n = len(drafts)
        for i in range(n + 1):  # row n (after every draft) always decides
            top = self._take(sample(logits[i], self.sampling, None, self._recent(emitted, drafts, i),
                                    self.grammar, self._ids(context, drafts, i)))
            if i == n or top != drafts[i]:
                return i, top


class ExactVerifier(GreedyVerifier):
    """Greedy on an engine whose decodes of up to `rows` tokens give each row the numbers of
    one-token decodes (`Engine.invariant_batch`); verification reads llama.cpp's own LM head, a
    pass checks at most `rows` rows and the prompt is prefilled as llama_cpp.Llama does it."""

    exact = True
    prompt_logits = True

    def __init__(self, sampling: SamplingParams, rows: int, **kw):
        super().__init__(sampling, **kw)
        self.max_rows = rows


class SampledVerifier(Verifier):
    """Row i chooses the token llama.cpp's sampler would choose for the generation's token n + i
    (n tokens generated before the pass): the chain's survivors, then its dist draw with the
    request's draw n + i (`LlamaDraws`). A draft stands where it is that token. Every token is
    thus a draw from the target's distribution with the draw llama_cpp.Llama uses at that
    position: the text depends on the seed alone, not on what was drafted, and a one-hot
    draft d is accepted with probability p(d), as the rejection rule would accept it."""

    def __init__(self, sampling: SamplingParams, grammar=None, logprobs: int | None = None,
                 stopping=None, target=None):
        """target: the engine, whose own sampler chain (in C, the same draws) picks the rows
        where it can (`Engine.native_sampler`; not with a grammar)."""
        super().__init__(sampling, grammar, logprobs, stopping)
        self.draws = LlamaDraws(sampling.seed)
        self.native = (target.native_sampler(sampling, self.draws.seed)
                       if target is not None and grammar is None else None)
        # the first token drawn from the prompt's own pass, as llama_cpp.Llama draws it: with
        # the same draws, a generation that drafts nothing is then llama_cpp.Llama's text
        self.prompt_logits = bool(target is not None and target.prefill_logits)

    def accept(self, logits, drafts, q, context, emitted) -> tuple[int, int]:
        n, at = len(drafts), len(emitted)
        for i in range(n + 1):  # row n (after every draft) always decides
            if self.native is not None:  # row i of the last decode's output rows, counted
                tok = self.native.pick(i - len(logits))  # from the end (a prompt's last row)
            else:
                d = chain(logits[i], self.sampling, self._recent(emitted, drafts, i), self.grammar,
                          self._ids(context, drafts, i))
                tok = self._take(d.pick(self.draws[at + i]))
            if i == n or tok != drafts[i]:
                return i, tok


def make_verifier(target, sampling: SamplingParams, grammar=None, logprobs: int | None = None,
                  stopping=None, exact: bool = True) -> Verifier:
    """The verifier for one request on `target`. Greedy rows that need only their top token go
    to the low-rank LM head where the engine has one; other greedy requests on llama.cpp's own
    LM head are exact where the engine's small batches keep one-token numbers (measured once
    per engine; `exact` False: never)."""
    kw = {"grammar": grammar, "logprobs": logprobs, "stopping": stopping}
    if not sampling.greedy:
        return SampledVerifier(sampling, target=target, **kw)
    top_only = (not sampling.adjusts_logits and logprobs is None and grammar is None
                and stopping is None)
    # exact mode caps a pass at the rows whose numbers match one-token decodes: worth it where
    # every row costs nearly a decode anyway (llama.cpp's own LM head), not with the low-rank or
    # batched head, whose rows are cheap (a cap of 2 or 3 rows halved the greedy speedup)
    if exact and not (top_only and target.lowrank_head is not None) and target.batched_head is None:
        rows = target.invariant_batch()
        if rows >= 2:
            return ExactVerifier(sampling, rows, top_only=top_only, **kw)
    return GreedyVerifier(sampling, top_only=top_only, **kw)
