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
from edgespec.runtime.assets import default_head, file_reads_kv
from edgespec.runtime.decoding import Draft, Drafter, Limit
from edgespec.runtime.formats import CKPT_WEIGHTS, head_arch, read_checkpoint_config
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
        return self._chain(context, hidden, k, p_min, getattr(limit, "go_on", None))

    def _chain(self, context: list[int], hidden: np.ndarray, k: int, p_min: float,
               go_on=None) -> Draft:
        """Feed the new rows, then draft a chain of up to k tokens, each next step only where
        `go_on` (the policy's, see decoding.Limit) says it may pay."""
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
            tok, top, q = self._pick(h.last_logits, j)
            if top < p_min and j > 0:
                break
            drafts.append(tok)
            conf.append(top)
            qs.append(q)
            if j + 1 >= k or not self._more(go_on, conf):
                break
            out, cache = h.forward(self.embed[np.array([tok])], out[-1:], n_ctx - 1 + j,
                                   commit=False, cache=cache)
        # the step the policy should count: one-row forwards; the first one read every waiting
        # row, which costs what it costs once and less the more often the head drafts
        t2 = time.perf_counter()
        if len(drafts) > 1 or len(hidden) <= 2:
            self._time_step((t2 - t1) / (len(drafts) - 1) if len(drafts) > 1 else t1 - t0)
        return Draft(drafts, q=qs, conf=conf, source=self.source, step_s=self._one_row_s)

    def _more(self, go_on, conf: list[float]) -> bool:
        """Whether the chain with these confidences computes its next step (go_on: the
        policy's, None: always); sampling, the policy also sees the draws of its rows."""
        if go_on is None:
            return True
        return go_on(self.source, conf, self.draws_for(len(conf) + 1))

    def draws_for(self, n: int) -> list[float] | None:
        """Sampling, the draws the target's rows for a chain's first n drafts will use; None
        when greedy (or no draws are known)."""
        if self.sampling is None or not self._draws:
            return None
        return [self._draws(i) for i in range(n)]

    def _pick(self, lg: np.ndarray, j: int) -> tuple[int, float, tuple | None]:
        """Draft j of a chain from the head's draft-vocabulary logits: (target token id, the
        head's top probability, the distribution it was drawn from or None when greedy)."""
        if self.sampling is not None:
            q = chain(lg, self.sampling)
            best = q.pick(self._draws(j)) if self._draws else q.draw(self._rng)
            return int(self.ids[best]), float(q.p.max()), (self.ids[q.ids], q.p)
        best = int(np.argmax(lg))
        return int(self.ids[best]), float(1.0 / np.exp(lg - lg[best]).sum()), None

    def _time_step(self, step: float) -> None:
        last = self._one_row_s
        self._one_row_s = step if last is None else last + 0.2 * (step - last)


class SharedKVDrafter(HeadDrafter):
    """Drafts with a shared-KV head (`train --arch shared-kv`): its layers attend the target's
    own keys and values, which the same decode that verifies hands over with each row's hidden
    state (`Engine.set_kv_layers`), so it has no cache of its own to fill and no extra pass.

    It holds, per context position, the target's final hidden state and the keys and values of
    the mapped layers; only rows of final tokens reach it (the decode loop keeps a pass's
    accepted rows before it rolls the cache back), so a rollback never leaves it a rejected
    draft's keys. It reads every pass's rows (`continuous`) and the whole prompt's: a gap
    would leave its queries keys to miss. A chain that starts after position t (the pending
    token at t + 1) reads the hidden state at t and sits at position t + 1 for every step."""

    continuous = True

    def __init__(self, path: str | Path, target_spec, source: str = "head"):
        super().__init__(path, target_spec, source)
        c, t = self.head.c, target_spec
        self.kv_layers = tuple(int(i) for i in c.kv_layers)
        if (c.n_embd != t.n_embd or any(not 0 <= i < t.n_layer for i in self.kv_layers)
                or [t.layer_types[i] for i in self.kv_layers] != list(c.layer_types)
                or ("sliding" in c.layer_types and c.sliding_window != t.sliding_window)
                or (c.n_head_kv, c.head_dim) != (t.n_head_kv, t.head_dim)):
            raise EdgespecError(f"head {path} attends keys and values of {c.layer_types} layers "
                                f"{list(self.kv_layers)} ({c.n_head_kv} x {c.head_dim} wide, hidden "
                                f"width {c.n_embd}), which {t.name} does not have: it is a head for "
                                "another target")
        self.n = 0  # context positions whose rows it holds (0..n-1)
        self._ids: list[int] = []  # the tokens at those positions, as last known
        self._h = np.empty((0, c.n_embd), np.float32)
        self._k = [np.empty((0, c.n_head_kv, c.head_dim), np.float32) for _ in self.kv_layers]
        self._v = [x.copy() for x in self._k]

    def kv_held(self, tokens: list[int]) -> int:
        ids = self._ids
        n = min(self.n, len(ids), len(tokens))
        diff = np.flatnonzero(np.asarray(ids[:n]) != np.asarray(tokens[:n]))
        return int(diff[0]) if len(diff) else n

    def note(self, tokens: list[int]) -> None:
        self._ids = list(tokens[:self.n])

    def reset(self) -> None:
        self.n, self._ids = 0, []

    def resume(self, keep: int) -> None:
        self.n = min(self.n, keep)
        self._ids = self._ids[:self.n]

    def drop_hidden(self) -> None:
        self.n = 0  # rows went missing: the next prompt starts it over

    def _grow(self, n: int) -> None:
        cap = len(self._h)
        if n <= cap:
            return
        cap = max(n, 2 * cap, 256)

        def grown(a):
            out = np.empty((cap,) + a.shape[1:], np.float32)
            out[:self.n] = a[:self.n]
            return out

        self._h = grown(self._h)
        self._k, self._v = [grown(a) for a in self._k], [grown(a) for a in self._v]

    def keep(self, hidden: np.ndarray | None) -> None:
        """Rows [n, n_embd + 2 * kv_width * layers] for the positions after those it holds."""
        if hidden is None or not len(hidden):
            return
        c, e, w = self.head.c, self.head.c.n_embd, self.head.c.kv_width
        if hidden.shape[1] != e + 2 * w * len(self.kv_layers):
            raise RuntimeError(f"shared-KV head got rows {hidden.shape[1]} wide, not "
                               f"{e + 2 * w * len(self.kv_layers)}: the engine reads no keys")
        n0, m = self.n, len(hidden)
        self._grow(n0 + m)
        self._h[n0:n0 + m] = hidden[:, :e]
        for i in range(len(self.kv_layers)):
            at = e + 2 * i * w
            self._k[i][n0:n0 + m] = hidden[:, at:at + w].reshape(m, c.n_head_kv, c.head_dim)
            self._v[i][n0:n0 + m] = hidden[:, at + w:at + 2 * w].reshape(m, c.n_head_kv, c.head_dim)
        self.n = n0 + m

    def propose(self, context: list[int], hidden: np.ndarray | None, k: int,
                p_min: float = 0.0, limit: Limit | None = None) -> Draft:
        self.keep(hidden)
        if limit:
            k = min(k, limit(self.source))
        go_on = getattr(limit, "go_on", None)
        qpos = len(context) - 1  # the pending token's position; the cache holds 0..qpos-1
        if self.n == qpos:
            self._ids.extend(context[len(self._ids):qpos])
        if k <= 0 or self.n != qpos or qpos < 1:
            return Draft([], source=self.source)
        h, t0 = self.head, time.perf_counter()
        keys = [a[:qpos] for a in self._k]
        values = [a[:qpos] for a in self._v]
        x, prev = self.embed[np.asarray(context[-1:])], self._h[qpos - 1:qpos]
        drafts, conf, qs = [], [], []
        for j in range(k):
            prev, lg = h.step(x, prev, qpos, keys, values)
            tok, top, q = self._pick(lg[0], j)
            if top < p_min and j > 0:
                break
            drafts.append(tok)
            conf.append(top)
            qs.append(q)
            if j + 1 < k and not self._more(go_on, conf):
                break
            x = self.embed[np.array([tok])]
        self._time_step((time.perf_counter() - t0) / (j + 1))
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
    # Off: measured on Gemma (scripts/peek_ab.py --compare set-aside) it did not pay; what the
    # policy learns swings more between runs than the switch moves it
    set_aside_peeks = False

    def __init__(self, head: HeadDrafter, lookup: PromptLookup | None = None, min_match: int = 2):
        # lookup only proposes n-grams of min_match or more: the head drafts everywhere else
        self.head, self.min_match = head, min_match
        self.lookup = lookup or PromptLookup(min_ngram=min_match)
        self.single = PromptLookup(max_ngram=1, min_ngram=1) if min_match > 1 else None
        self.name = f"{head.name}+lookup"
        self.source = head.source  # the head's: the decode loop reads hidden states for it
        self.feature_layers = head.feature_layers
        self.kv_layers = getattr(head, "kv_layers", ())
        self.continuous = getattr(head, "continuous", False)

    def reset(self) -> None:
        self.head.reset()
        self.lookup.reset()
        if self.single:
            self.single.reset()

    def resume(self, keep: int) -> None:
        self.lookup.reset()
        if self.single:
            self.single.reset()
        self.head.resume(keep)

    def kv_held(self, tokens: list[int]) -> int:
        return self.head.kv_held(tokens)

    def note(self, tokens: list[int]) -> None:
        self.head.note(tokens)

    def keep(self, hidden: np.ndarray | None) -> None:
        self.head.keep(hidden)

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
        # set_aside_peeks: a head held short may still take a step (a peek, policies.CostAware);
        # where the policy would trim that draft away and would verify a one-token match, the
        # match gets the pass instead (where it would trim both, the head's draft goes on to be
        # trimmed: what the policy learns from it is the head's)
        if self.single is None or (d.tokens and not self._trimmed_away(d, limit)):
            return d
        t0 = time.perf_counter()
        one = self.single.propose(context, None, k, limit=limit)
        if not one.tokens or (d.tokens and not limit.kept(
                one.source, one.conf, self.head.draws_for(len(one.tokens)))):
            return d
        if d.tokens:
            limit.seen(d.source, d.conf)  # the head's set-aside draft still tells where they fall
        # the match's own time: the head's step (set aside or not taken) is not the lookup's cost
        one.step_s = (time.perf_counter() - t0) / len(one.tokens)
        return one

    def _trimmed_away(self, d: Draft, limit) -> bool:
        """Whether the head's draft may be set aside: the switch is on and the policy's preview
        says it would verify none of it."""
        return (self.set_aside_peeks and hasattr(limit, "kept")
                and limit.kept(d.source, d.conf, self.head.draws_for(len(d.tokens))) == 0)


def make_drafter(draft: str | None, spec, kv: bool = False):
    """A drafter from its command-line name: None/"none" (target only), "lookup" (prompt
    lookup), "default" (the head shipped for the target, mixed with prompt lookup), a head file
    or checkpoint folder (mixed with prompt lookup), or "head:default" / "head:PATH" for the
    head alone. `kv`: the engine can hand a head the target's keys and values
    (`Engine.can_hand_kv`), so "default" may be the shipped shared-KV head."""
    if draft in (None, "", "none"):
        return None
    if draft == "lookup":
        return PromptLookup()
    alone = draft.startswith("head:")
    name = draft[len("head:"):] if alone else draft
    if name == "default":
        path = default_head(spec, kv)
        # its own source name: estimates learned for the one head never steer the other
        head = (SharedKVDrafter(path, spec, source="head-kv") if file_reads_kv(path)
                else HeadDrafter(path, spec))
    else:  # its own name: estimates learned for one head never steer another
        where = str(Path(name).resolve()).encode()
        kind = SharedKVDrafter if reads_kv(name) else HeadDrafter
        head = kind(name, spec, source=f"head:{hashlib.sha1(where).hexdigest()[:8]}")
    return head if alone else MixedDrafter(head)


def default_reads_kv(engine) -> bool:
    """Whether "default" may be the shipped shared-KV head on `engine`: one that can hand it the
    target's keys and values and verifies through an LM head of edgespec's own (low-rank or
    batched). On llama.cpp's own full LM head greedy text can be plain decoding's bit for bit
    (docs/design.md), which a head reading every prompt row would give up (the rows it asks
    for change llama.cpp's numbers), so there the default keeps the hidden-state head."""
    own_head = (getattr(engine, "lowrank_head", None) is not None
                or getattr(engine, "batched_head", None) is not None)
    return engine.can_hand_kv() and own_head


def drafter_for(draft: str | None, engine):
    """`make_drafter` for an open engine: "default" is the shipped head that engine can feed."""
    return make_drafter(draft, engine.spec, kv=default_reads_kv(engine))


def reads_hidden(draft: str | None) -> bool:
    """Whether the drafter named `draft` reads the target's hidden states (a head: anything but
    none and prompt lookup)."""
    return draft not in (None, "", "none", "lookup")


def reads_kv(draft: str | None) -> bool:
    """Whether the drafter named `draft` reads the target's keys and values (a shared-KV head's
    checkpoint folder, GGUF or ONNX file): its engine must be opened with the hidden-state probe."""
    if not draft:
        return False
    name = draft[len("head:"):] if draft.startswith("head:") else draft
    p = Path(name).expanduser()
    if p.is_file():
        return file_reads_kv(p)
    if not p.is_dir() or not (p / CKPT_WEIGHTS).exists():
        return False
    return head_arch(read_checkpoint_config(p).get("head") or {}) == "shared-kv"
