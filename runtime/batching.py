"""Several generations on one target: one cache, one batched decode per step.

    batcher = Batcher(LlamaTarget("gemma3-270m", n_ctx=4 * 2048, n_seq=4), n_slots=4)
    slot = batcher.slot(0)        # a Target of its own: `Generation` runs on it unchanged

Each slot is a view of the shared engine with its own sequence id, its own token list and
its own share of the context. A slot's decode does not run at once: it waits until every
slot that is generating has handed in its next decode (or `max_wait` passes), and the last
one to arrive runs them all in one `decode_parts` call, so the drafts of every active request
are verified in one batched pass (prompt prefills of requests that just arrived ride along).
Rollbacks and resets of one sequence take the engine between batches.

The cost policy of a slot (`SlotCostAware`) chooses its draft length from the measured cost of
the whole batch: extending this slot's draft by one token adds a row to a pass every active
request waits for, so it pays only if the tokens it is expected to add outweigh the time it
adds for all of them. As more requests share the pass, drafting falls toward plain decoding.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from edgespec.errors import EdgespecError
from edgespec.runtime.engine import Engine
from edgespec.runtime.policies import (CostAware, PolicyStore, VerifyCost, cost_key, ema_into,
                                       measure_verify_cost)


@dataclass
class Part:
    """One sequence's share of a batched decode."""

    seq: int
    start: int  # position of its first token
    tokens: list[int]
    outputs: str  # "none" (prompt prefill), "last", "all"
    hidden: bool = False  # hidden states of every row wanted
    logits: bool = True  # logits of the output rows wanted
    top_only: bool = False  # only each row's argmax is read (the low-rank LM head may answer)
    lead: int = 0  # the first `lead` tokens are prompt prefill: no outputs, nothing returned


class _Request:
    __slots__ = ("part", "result", "error", "t")

    def __init__(self, part: Part):
        self.part, self.result, self.error, self.t = part, None, None, time.perf_counter()


class Batcher:
    """Combines the decodes of `n_slots` slots of one engine (see the module doc). The engine
    needs `decode_parts(parts)`, `seq_rollback(seq, kept)`, `seq_clear(seq)` and `n_seq`."""

    def __init__(self, engine, n_slots: int, max_wait: float = 0.05):
        if n_slots < 1:
            raise EdgespecError(f"--parallel must be >= 1, got {n_slots}")
        if engine.n_seq < n_slots:
            raise EdgespecError(f"the engine holds {engine.n_seq} sequences, "
                                f"not {n_slots}")
        self.engine, self.n_slots, self.max_wait = engine, n_slots, max_wait
        self.n_ctx = engine.n_ctx // n_slots  # each slot's share of the cells
        self._cond = threading.Condition()
        self._queue: dict[int, _Request] = {}
        self._active: set[int] = set()
        self._busy = False  # a batch (or a rollback) holds the engine
        self._free_at = time.perf_counter()
        self.last_rows: dict[int, int] = {}  # seq -> verify rows in the last batch
        self.emitted: dict[int, float] = {}  # seq -> tokens it emits per pass (running mean)
        self.batches = 0
        self.rows = 0
        self.decode_s = 0.0  # time the engine spent in batched decodes
        self._last_step = None  # the last batch, if a pure verify batch: (start, rows, greedy, active)
        self._drafting = 0.0  # seconds slots spent drafting since the last batch started
        self.step_s: dict[str, float] = {}  # per draft source, seconds per draft step (shared)
        # seconds of one batch of n verify rows, for greedy (True) and sampled verification
        self.costs: dict[bool, VerifyCost] = {}
        self.slots = [SlotTarget(self, i) for i in range(n_slots)]

    def slot(self, i: int) -> SlotTarget:
        return self.slots[i]

    # -- who is generating ------------------------------------------------------------------
    def activate(self, seq: int) -> None:
        with self._cond:
            self._active.add(seq)

    def deactivate(self, seq: int) -> None:
        """A slot's generation ended: the others stop waiting for it."""
        with self._cond:
            self._active.discard(seq)
            self.last_rows.pop(seq, None)
            self._cond.notify_all()

    # -- batched decodes --------------------------------------------------------------------
    def run(self, part: Part):
        """Queue `part`, wait for its batch; (logits, hidden, candidates) as decode_parts gives."""
        req = _Request(part)
        with self._cond:
            if part.seq in self._queue:
                raise RuntimeError(f"slot {part.seq} queued two decodes at once")
            self._queue[part.seq] = req
            self._cond.notify_all()
            while req.result is None and req.error is None:
                if self._busy:
                    self._cond.wait()
                    continue
                missing = self._active - set(self._queue)
                oldest = min(r.t for r in self._queue.values())
                due = max(oldest, self._free_at) + self.max_wait
                now = time.perf_counter()
                if missing and now < due:
                    self._cond.wait(due - now)
                    continue
                self._lead()
        if req.error is not None:
            raise req.error
        return req.result

    def _lead(self) -> None:
        """Run every queued part in one batch (called holding the condition; released while
        the engine works)."""
        batch = list(self._queue.values())
        self._queue.clear()
        self._busy = True
        t0 = time.perf_counter()
        self._time_step(t0)
        self._cond.release()
        try:
            results = self.engine.decode_parts([r.part for r in batch])
            error = None
        except BaseException as e:  # every waiter gets it
            results, error = None, e
        dt = time.perf_counter() - t0
        self._cond.acquire()
        self._busy = False
        self._free_at = time.perf_counter()
        if error is None:
            verify = [r.part for r in batch if r.part.outputs != "none" and r.part.logits]
            kinds = {p.top_only for p in verify}
            # a pure verify batch is timed as a step (see `_time_step`)
            self._last_step = ((t0, sum(len(p.tokens) for p in verify), kinds.pop(), frozenset(self._active))
                          if len(verify) == len(batch) and len(kinds) == 1 else None)
            self.last_rows = {p.seq: len(p.tokens) for p in verify}
            self.batches += 1
            self.decode_s += dt
            self.rows += sum(len(r.part.tokens) for r in batch)
        for i, r in enumerate(batch):
            if error is None:
                r.result = results[i]
            else:
                r.error = error
        self._cond.notify_all()

    def _time_step(self, now: float) -> None:
        """The cost of a step of n verify rows is what every request waits for: the batched
        decode, then each slot's work on its rows (acceptance, exact logits, emitting), from
        the start of one batch to the start of the next, less the time slots spent drafting
        (the cost policy counts that per draft token). Only steps whose set of generating
        slots did not change count (a request that arrives or leaves is not a row cost)."""
        step, self._last_step = self._last_step, None
        drafting, self._drafting = self._drafting, 0.0
        if step is None or step[3] != frozenset(self._active):
            return
        cost = self.costs.get(step[2])
        if cost is not None:
            cost.observe(step[1], max(1e-6, now - step[0] - drafting))

    def note_draft(self, source: str, seconds: float, steps: int, ema: float = 0.2) -> None:
        """A slot drafted `steps` tokens from `source` in `seconds` (shared by every slot and
        request: a new request starts from what the others measured)."""
        with self._cond:
            self._drafting += seconds
            if steps:
                ema_into(self.step_s, source, seconds / steps, ema)

    @contextmanager
    def exclusive(self):
        """The engine to oneself between batches (rollbacks, resets)."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            self._busy = True
        try:
            yield self.engine
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    # -- the cost of a batch -----------------------------------------------------------------
    def prepare_cost(self, k: int, greedy: bool = True, seq: int = 0) -> VerifyCost:
        """The batch cost curve for up to n_slots * (k + 1) rows: the single-sequence
        verify-cost curve (stored, else measured on slot `seq`: call it before serving, when
        the batch is quiet), extended along its slope, then learned from every batch."""
        rows = self.n_slots * (k + 1)
        cost = self.costs.get(greedy)
        if cost is None or len(cost) < rows:
            base = list(measure_verify_cost(self.slot(seq), k + 1, top_only=greedy).curve[:k + 1])
            self.deactivate(seq)  # measuring prefilled it; its generation (if any) starts later
            slope = max(0.0, (base[-1] - base[0]) / max(1, len(base) - 1))
            prior = base + [base[-1] + slope * (n - len(base)) for n in range(len(base) + 1, rows + 1)]
            self.costs[greedy] = cost = VerifyCost(prior)
        return cost

    def others(self, seq: int) -> tuple[int, float]:
        """(rows, tokens emitted per pass) of the other generating requests: their rows in
        the last batch (1 for one that has not verified yet) and their running mean."""
        with self._cond:
            rest = [s for s in self._active if s != seq]
            rows = sum(self.last_rows.get(s, 1) for s in rest)
            made = sum(self.emitted.get(s, 1.0) for s in rest)
        return rows, made

    def note_emitted(self, seq: int, n: int, ema: float = 0.2) -> None:
        ema_into(self.emitted, seq, float(n), ema)


class _SlotCostView:
    """A slot's view of the batch cost: c[n - 1] = the cost of a batch with this slot's n rows
    next to the other requests' rows of the last batch."""

    key = None  # nothing stored: the shared curve is learned per server run

    def __init__(self, cost: VerifyCost, k: int):
        self.cost, self.k = cost, k
        self.offset = 0

    def __len__(self) -> int:
        return self.k + 1

    def __getitem__(self, i: int) -> float:
        return self.cost[min(self.offset + i, len(self.cost) - 1)]

    def timed(self, n: int) -> bool:
        return self.cost.timed(min(self.offset + n, len(self.cost)))

    def observe(self, n: int, seconds: float) -> None:
        pass  # the batcher times whole batches; a slot's own wait says nothing

    def learned(self) -> list[float]:
        return []


class SlotCostAware(CostAware):
    """The cost policy of one slot: maximise the tokens per second of the whole batch, this
    slot's draft length given the others' (see the module doc). `cost`: the batch cost curve
    (`Batcher.prepare_cost`), handed in."""

    def __init__(self, batcher: Batcher, seq: int, k: int, cost: VerifyCost,
                 state: dict | None = None, store: PolicyStore | None = None):
        self.view = _SlotCostView(cost, k)
        super().__init__(k, self.view, state=state, store=store)
        self.batcher, self.seq = batcher, seq
        self._see_others()

    def _see_others(self) -> None:
        """The other requests' rows and tokens per pass, as the batcher last saw them."""
        rows, made = self.batcher.others(self.seq)
        self.view.offset, self.others = rows, made

    def limit(self, source: str) -> int:
        self._see_others()
        return super().limit(source)

    def trim(self, draft) -> int:
        self._see_others()
        return super().trim(draft)

    def kept(self, source: str, conf: list[float], u: list[float] | None = None) -> int:
        self._see_others()
        return super().kept(source, conf, u)

    def update(self, drafted: int, accepted: int, source: str = "") -> None:
        super().update(drafted, accepted, source)
        self.batcher.note_emitted(self.seq, accepted + 1)

    def _step(self, source: str) -> float:
        return self.batcher.step_s.get(source, self.draft_step_s)

    def _probe_every(self, source: str) -> int:
        # a try lengthens a pass every other request waits for: tried that much more rarely
        return super()._probe_every(source) * (1 + round(self.others))

    def observe_draft_time(self, seconds: float, steps: int, source: str = "") -> None:
        self.batcher.note_draft(source, seconds, steps)


class SlotTarget(Engine):
    """One slot of a Batcher: the Target protocol over sequence `seq` of the shared engine."""

    def __init__(self, batcher: Batcher, seq: int):
        eng = batcher.engine
        self.batcher, self.seq, self.engine_ = batcher, seq, eng
        self.spec, self.engine, self.version = eng.spec, eng.engine, eng.version
        self.model_file, self.lowrank = eng.model_file, eng.lowrank
        self.n_threads, self.n_batch = eng.n_threads, eng.n_batch
        self.draft_k, self.draft_k_sampled = eng.draft_k, eng.draft_k_sampled
        self.n_ctx = batcher.n_ctx
        self.tokens: list[int] = []
        self._lead = 0  # prompt tokens at the end of `tokens` not decoded yet
        self.feature_layers: tuple[int, ...] = ()
        head = eng.lowrank_head
        # this slot's exact-logit rows (one reused buffer each: valid until its next decode)
        self._top = None
        if head is not None:
            from edgespec.runtime.lowrank import TopRows

            self._top = TopRows(head.top.rows, head.n_vocab, q8_x=head.top.q8_x)

    # the tokenizer is the engine's
    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        return self.engine_.tokenize(text, add_bos, special)

    def token_bytes(self, token: int) -> bytes:
        return self.engine_.token_bytes(token)

    def is_eog(self, token: int) -> bool:
        return self.engine_.is_eog(token)

    def describe_lm_head(self, greedy: bool = True) -> str:
        return self.engine_.describe_lm_head(greedy)

    def hidden_free(self, top_only: bool) -> bool:
        return self.engine_.hidden_free(top_only)

    def set_feature_layers(self, layers: tuple[int, ...] = ()) -> None:
        if tuple(layers):
            raise EdgespecError("heads that read the target's layer inputs (EAGLE-3) run one "
                                "request at a time; serve them with --parallel 1")

    def set_kv_layers(self, layers: tuple[int, ...] = ()) -> None:
        if tuple(layers):
            raise EdgespecError("heads that read the target's keys and values (shared-KV) run one "
                                "request at a time; serve them with --parallel 1")

    def cost_policy(self, k: int, greedy: bool) -> SlotCostAware:
        cost = self.batcher.prepare_cost(k, greedy, self.seq)
        store = PolicyStore(f"{cost_key(self, greedy)}|{'greedy' if greedy else 'sampled'}")
        return SlotCostAware(self.batcher, self.seq, k, cost, state=store.load(), store=store)

    # -- the cache ---------------------------------------------------------------------------
    # Prompt tokens are not decoded when prefilled: the last `_lead` of `tokens` wait, and go
    # with this slot's next decode as its first rows (one batch round for a new request
    # instead of two, which every other request would wait through).
    def _room(self, n: int) -> None:
        if len(self.tokens) + n > self.n_ctx:
            raise EdgespecError(f"context is full ({self.n_ctx} tokens per slot); use a larger "
                                "n_ctx or a shorter prompt")

    def _flush(self, room: int) -> None:
        """Decode waiting prompt tokens on their own until at most `room` of them wait."""
        while self._lead > max(0, room):
            at = len(self.tokens) - self._lead
            chunk = self.tokens[at:at + min(self._lead, self.n_batch)]
            self.batcher.run(Part(self.seq, at, chunk, "none", logits=False))
            self._lead -= len(chunk)

    def _run(self, tokens: list[int], outputs: str, hidden: bool = False, logits: bool = True,
             top_only: bool = False):
        self._room(len(tokens))
        self._flush(self.n_batch - len(tokens))
        lead, at = self._lead, len(self.tokens) - self._lead
        out = self.batcher.run(Part(self.seq, at, self.tokens[at:] + list(tokens), outputs, hidden,
                                    logits, top_only, lead))
        self._lead = 0
        self.tokens.extend(tokens)
        return out

    def prefill(self, tokens: list[int]) -> None:
        """A generation starts here (`Generation._prefill`): from now on every batch waits
        for this slot's decodes, until the server's `Batcher.deactivate`."""
        self.batcher.activate(self.seq)
        self._room(len(tokens))
        self.tokens.extend(tokens)
        self._lead += len(tokens)

    def hidden_states(self, tokens: list[int]) -> np.ndarray:
        out = [self._run(tokens[s:s + self.n_batch], "all", hidden=True, logits=False)[1]
               for s in range(0, len(tokens), self.n_batch)]
        return np.concatenate(out) if out else np.empty((0, self.spec.n_embd), np.float32)

    def decode(self, tokens: list[int], hidden: bool = False, all_logits: bool = True,
               copy: bool = True, top_only: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        if not tokens:
            raise ValueError("decode needs at least one token")
        if len(tokens) > self.n_batch:
            raise ValueError(f"decode takes at most n_batch={self.n_batch} tokens")
        every = all_logits or hidden
        logits, hid, cand = self._run(tokens, "all" if every else "last", hidden, True, top_only)
        if logits is None:  # the low-rank LM head: exact logits at this slot's candidates
            logits = self._top(cand, hid)
        return logits, (hid if hidden else None)

    def truncate(self, n: int) -> None:
        if n >= len(self.tokens):
            return
        cached = len(self.tokens) - self._lead
        if n >= cached:  # only waiting prompt tokens go
            self._lead = n - cached
            del self.tokens[n:]
            return
        self._lead = 0
        kept = self.tokens[:n]
        with self.batcher.exclusive() as eng:
            eng.seq_rollback(self.seq, kept)
        self.tokens = kept

    def reset(self) -> None:
        with self.batcher.exclusive() as eng:
            eng.seq_clear(self.seq)
        self.tokens, self._lead = [], 0

    def close(self) -> None:
        pass  # the engine belongs to the batcher's owner
