"""Draft-length policies (DraftPlanner and its variants): how many drafted tokens go into each
verify pass.

fixed       always k drafts.
confidence  draft up to k, stop once the head's top probability falls below p_min (llama.cpp's
            rule for its draft models).
cost        draft up to k, then keep the prefix length that maximises expected tokens per second:
            (1 + sum_j prod_{i<=j} p_i) / (c(j + 1) + draft time), where p_i are the head's
            confidences and c(n) is the target's cost of verifying n tokens on this machine,
            learned online from the decode loop's own timings (`VerifyCost`), starting from a
            stored curve (keyed by CPU model, threads, engine and version, target file content
            and LM head) or, the first time, a short measurement. The curve and the learned
            acceptance are handed to the policy by `make_policy` (its constructor does no I/O);
            `PolicyStore` keeps them for the next generation.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from edgespec.errors import EdgespecError
from edgespec import cache

POLICIES = ("fixed", "confidence", "cost")
MAX_DRAFT = 16  # the most drafts one verify pass checks; more never pays on a CPU


def ema_into(table: dict, key, x: float, ema: float) -> None:
    """A running mean per key: the first value as it is, then an exponential moving average."""
    old = table.get(key)
    table[key] = x if old is None else old + ema * (x - old)


@dataclass
class Step:
    """What one decode step tells the policy: the draft it asked for and how it fared."""

    source: str  # the draft's source ("lookup", "head", ...; "" for unnamed drafters)
    made: int  # draft tokens computed
    drafted: int  # of those, sent to verification (after trimming)
    accepted: int
    draft_s: float  # seconds of drafting, as the policy should count them
    rows: int  # tokens in the verify pass (1 + drafted)
    verify_s: float


class DraftPlanner:
    """How long each draft may be. The decode loop asks a planner three things each step:
    `limit` (how many tokens may this source draft; the drafter asks before drafting), `trim`
    (how much of the draft to verify) and `observe` (how the step went); `soon` tells it whether
    hidden states are worth reading, `finish` that a generation ended. The defaults are the
    fixed policy's: up to k drafts, always."""

    name = "fixed"

    def __init__(self, k: int):
        if k < 0:
            raise EdgespecError(f"draft length must be >= 0, got {k}")
        self.k = k  # the most drafts any source may make in one step
        self.p_min = 0.0  # drafters with confidences stop below this top probability

    def limit(self, source: str) -> int:
        """The most drafts `source` should make this pass (asked before drafting: a draft
        step not worth verifying is not worth computing)."""
        return self.k

    def trim(self, draft) -> int:
        return len(draft.tokens)

    def go_on(self, source: str, conf: list[float], u: list[float] | None = None) -> bool:
        """Whether a drafter whose chain so far has these confidences (and, sampling, whose
        next rows have these draws) should compute its next draft step."""
        return True

    def seen(self, source: str, conf: list[float]) -> None:
        """A scored draft that a drafter made and then set aside, unverified (see `kept`)."""

    def kept(self, source: str, conf: list[float], u: list[float] | None = None) -> int:
        """How much of a draft with these confidences `trim` would verify, asked by a drafter
        that has another draft to offer where this one would be trimmed away (no side
        effects)."""
        return len(conf)

    def observe(self, step: Step) -> None:
        pass

    def soon(self, source: str, passes: int) -> bool:
        """Whether `source` may draft within the next `passes` passes (a drafter that reads
        the target's hidden states needs them only then)."""
        return self.k > 0

    def finish(self) -> None:
        """A generation ended."""


class FixedK(DraftPlanner):
    """Always up to k drafts."""


class Confidence(DraftPlanner):
    name = "confidence"

    def __init__(self, k: int, p_min: float = 0.4):
        super().__init__(k)
        self.p_min = p_min


COST_FILE = "verify_cost.json"
ACCEPTANCE_FILE = "draft_acceptance.json"
# A drafter's confidence (its top probability) is not the chance the target accepts the draft:
# a head distilled from the target is as unsure as the target, yet under greedy verification
# only the argmax has to agree (measured on Gemma: drafts at confidence 0.3-0.4 accepted 49% of
# the time, at 0.5-0.6 71%). The cost policy learns, per source, the acceptance of each
# confidence bin; until a bin has seen drafts it takes the confidence at its word.
CALIB_BINS = 10
CALIB_PRIOR = 4.0  # pseudo-drafts per bin, accepted as often as their confidence says
CALIB_CAP = 256.0  # past this many drafts a bin halves its counts: recent ones weigh more
FREE_STEP = 0.01  # a draft step under this share of a one-token pass costs next to nothing
# Sampling: a draft stands where the target's draw for its row picks it (verify.SampledVerifier),
# and llama.cpp's dist walks the candidates from the most likely one, so a draft of the likely
# token is accepted under a low draw and rarely under a high one. Per source, the policy keeps
# the acceptance of drafts by the quantile of their draw (U_BINS bins of [0, 1)) and scales a
# draft's expected acceptance by its bin's rate over the source's overall rate (U_PRIOR
# pseudo-drafts per bin at the overall rate): a chain is verified as far as its draws make
# paying likely. Greedy drafts carry no draws and are judged as before.
U_BINS = 5
U_PRIOR = 8.0
# A scored source that costs a real step (a head) is asked to draft one token, a peek, on passes
# where its running acceptance says a draft would not pay but its confidences say some would: a
# head is often sure where it is right, and each peeked draft is then trimmed by its own score.
# The policy keeps, per source, how the first drafts' confidences fall when the source is asked
# (CALIB_BINS bins), and peeks while the drafts it expects to keep gain more than a step costs;
# until PEEK_SEEN first drafts have been seen it peeks to learn that.
PEEK_SEEN = 24


def verify_head(engine, top_only: bool) -> str:
    """The LM head a verify pass uses: "full", or the low-rank head's key for greedy passes."""
    return engine.lowrank.key if top_only and engine.lowrank else "full"


def verify_cost_curve(engine, k_max: int = 8, repeats: int = 7, top_only: bool = True) -> list[float]:
    """Median ms of one decode of k tokens with logits at every position, k = 1..k_max
    (top_only: as greedy verification asks for them). Leaves the engine's cache empty."""
    engine.reset()
    ids = engine.tokenize("A short context so that the cache is not empty: " * 4)
    engine.prefill(ids)
    base = len(engine.tokens)
    out = []
    for k in range(1, k_max + 1):
        times = []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            engine.decode([ids[i % len(ids)] for i in range(k)], hidden=True, copy=False, top_only=top_only)
            if r:  # the first run warms up
                times.append(1000 * (time.perf_counter() - t0))
            engine.truncate(base)
        out.append(round(float(np.median(times)), 3))
    engine.reset()
    return out


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (what a stored cost curve was measured on)."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cost_key(engine, top_only: bool) -> str:
    """What a verify-cost curve depends on: the CPU, the threads, the engine and its version,
    the target file (by content) and the LM head verification uses."""
    return (f"{cpu_model()}|t{engine.n_threads}|{engine.engine} {engine.version}"
            f"|{cache.file_identity(engine.model_file)}|{verify_head(engine, top_only)}")


class VerifyCost:
    """c(n), the seconds of one verify pass over n tokens, learned online.

    Starts from a prior curve (stored or measured). Each length keeps its last `window` timings
    from the decode loop; its estimate is their median once there are a few (one noisy pass
    moves it little, a lasting change of the machine takes over within a window). Lengths with
    too few timings are interpolated between observed ones (past the longest, extended along
    its slope unless the scaled prior is lower), or else follow the prior scaled by how the
    observed lengths compare with theirs: a machine that got busier makes every length dearer
    at once. The cost policy tries a longer draft now and then, so longer lengths get timings.

    With `STALE` set, a length no pass has been timed at for that many passes (of any length)
    forgets its timings and goes by its neighbours and the prior again: a busy stretch that made
    a length look dear keeps it so otherwise, since the policy stops verifying lengths it thinks
    too dear and no new timing corrects them (`timed` turns false again, so the policy's tries
    reach that far once more). Off as shipped: after a made busy stretch that left the long
    lengths stuck dear, forgetting them won back longer passes but no speed
    (scripts/stale_cost_ab.py: past four rows a pass costs about what its extra tokens gain)."""

    MIN_OBS = 3
    STALE: int | None = None  # passes after which a length's timings go stale; None: never

    def __init__(self, prior: list[float], window: int = 16, key: str | None = None):
        if not prior or min(prior) <= 0:
            raise ValueError("a verify-cost prior needs positive times")
        self.prior, self.key = list(prior), key
        self.obs = [deque(maxlen=window) for _ in prior]
        self.est: list[float | None] = [None] * len(prior)  # per length, its timings' median
        self.curve = list(prior)
        self.passes = 0  # passes timed so far, of any length
        self.last = [0] * len(prior)  # per length, the pass it was last timed at

    def __len__(self) -> int:
        return len(self.prior)

    def __getitem__(self, i: int) -> float:  # i = n - 1
        return self.curve[i]

    def observe(self, n: int, seconds: float) -> None:
        if 1 <= n <= len(self.prior) and seconds > 0:
            self.passes += 1
            o = self.obs[n - 1]
            o.append(seconds)
            self.last[n - 1] = self.passes
            moved = len(o) >= self.MIN_OBS
            if moved:  # only this length's median moves
                self.est[n - 1] = statistics.median(o)
            if self.STALE is not None:
                for i, old in enumerate(self.obs):
                    if old and self.passes - self.last[i] > self.STALE:
                        old.clear()
                        moved = moved or self.est[i] is not None
                        self.est[i] = None
            if moved:
                self._update()

    def _update(self) -> None:
        est = self.est
        seen = [i for i, e in enumerate(est) if e is not None]
        scale = statistics.median(est[i] / self.prior[i] for i in seen) if seen else 1.0
        curve = []
        for i, (e, p) in enumerate(zip(est, self.prior)):
            lo = max((j for j in seen if j < i), default=None)
            hi = min((j for j in seen if j > i), default=None)
            if e is not None:
                curve.append(e)
            elif lo is not None and hi is not None:  # between two observed lengths: interpolate
                curve.append(est[lo] + (est[hi] - est[lo]) * (i - lo) / (hi - lo))
            elif lo is not None and len(seen) >= 2:  # past the longest observed: its slope
                a, b = seen[-2], seen[-1]
                slope = max(0.0, (est[b] - est[a]) / (b - a))
                curve.append(min(p * scale, est[b] + slope * (i - b)))
            else:
                curve.append(p * scale)
        self.curve = curve

    def timed(self, n: int) -> bool:
        """Whether passes over n tokens have been timed enough to go by their own median."""
        return not 1 <= n <= len(self.prior) or self.est[n - 1] is not None

    def learned(self) -> list[float]:
        """The curve to store as the next prior: observed lengths as observed, others scaled."""
        return [round(x, 6) for x in self.curve]


# The curves being learned in this process, by cache root and key: one engine's successive
# generations share one curve and its recent timings.
_LIVE: dict[tuple[str, str], VerifyCost] = {}


def measure_verify_cost(engine, n_max: int, repeats: int = 5, top_only: bool = True) -> VerifyCost:
    """The verify-cost curve for n = 1..n_max: the one this process is learning for this
    machine, engine, target and LM head, else the stored prior, else a short measurement;
    learned online after."""
    key = cost_key(engine, top_only)
    live_key = (str(cache.cache_root()), key)
    live = _LIVE.get(live_key)
    if live is not None and len(live) >= n_max:
        return live
    stored = cache.read_json(COST_FILE).get(key)
    if isinstance(stored, list) and len(stored) >= n_max and all(
            isinstance(x, (int, float)) and x > 0 for x in stored[:n_max]):
        curve = VerifyCost(stored, key=key)
    else:
        saved = list(engine.tokens)
        costs = [ms / 1000 for ms in verify_cost_curve(engine, n_max, repeats, top_only)]
        engine.prefill(saved)
        store_verify_cost(key, costs)
        curve = VerifyCost(costs, key=key)
    _LIVE[live_key] = curve
    return curve


def store_verify_cost(key: str, curve: list[float]) -> None:
    """Keep a curve as the prior for its key (the longest one known wins where lengths differ)."""
    old = cache.read_json(COST_FILE).get(key)
    if isinstance(old, list) and len(old) > len(curve):
        curve = list(curve) + old[len(curve):]
    cache.put_json(COST_FILE, key, curve)  # a read-only cache only costs a re-measure


class CostAware(DraftPlanner):
    """Pick each source's draft length before drafting from running per-position acceptance
    estimates, then trim the drafted chain with the head's own confidences; both maximise
    expected tokens per second. Estimates start optimistic (prior 0.8) so a fresh generation
    drafts at once and learns from what gets accepted (EMA 0.2); each draft source has its own.

    A source whose estimates say "shorter than could pay" still drafts, now and then, as far as
    any draft could pay were every token right at the learned costs (verified untrimmed), so
    its acceptance at those positions and the cost of those lengths keep being measured and can
    recover (drafts tend to be right or wrong as a whole: one such try lifts every position at
    once; lengths no draft could pay for at their timed costs are not tried, unless those
    timings go stale: VerifyCost.STALE). The wait between tries starts at
    `probe_every` passes and doubles after each try that leaves the next draft position well
    short of paying (its acceptance
    estimate under 0.8 of the break-even one, up to `max_probe_every`): a source that never
    pays costs next to nothing, one near the edge keeps being tried.

    A source that scores its drafts and costs next to nothing to ask (prompt lookup: `_free`)
    is never held back before drafting: each of its drafts is trimmed by what its scores were
    accepted at, and a score band trimmed to nothing gets a one-token try now and then (the
    same waits, doubling while the band stays well short of paying)."""

    name = "cost"

    def __init__(self, k: int, verify_cost: list[float] | VerifyCost, draft_step_s: float = 0.002,
                 prior: float = 0.8, ema: float = 0.2, probe_every: int = 16,
                 max_probe_every: int = 256, state: dict | None = None,
                 store: PolicyStore | None = None):
        """verify_cost: c(1..k+1), a measured curve or a live one (`measure_verify_cost`).
        state: what an earlier generation learned (`PolicyStore.load`); store: where `finish`
        keeps what this one learned (None: nowhere)."""
        super().__init__(k)
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self._every: dict[str, int] = {}  # per source, passes between tries
        self._wait: dict[str, int] = {}  # per source, passes held short since its last try
        self._trying: dict[str, tuple[int, int]] = {}  # source -> (tried length, best before)
        if len(verify_cost) < k + 1:
            raise ValueError("verify_cost needs k + 1 entries")
        # c[n - 1]: the cost of verifying n tokens, learned from the loop's timings as it runs
        self.c = verify_cost if hasattr(verify_cost, "observe") else VerifyCost(verify_cost)
        self.draft_step_s = draft_step_s  # seconds per draft step, until a source is timed
        self.step_s: dict[str, float] = {}  # per draft source, its measured seconds per step
        # tokens other requests sharing each verify pass emit in it (runtime/batching.py: the
        # pass's rate is theirs plus this request's); 0 when this request decodes alone
        self.others = 0.0
        self.prior = prior
        # per draft source, P(draft j accepted | drafts before it accepted); each generation
        # starts from the `state` the last one with the same store left
        self.store = store
        self.accs: dict[str, list[float]] = {}
        # per source, [accepted, drafted] per confidence bin; the confidences of each source's
        # last trimmed draft wait here for its verification
        self.calib: dict[str, list[list[float]]] = {}
        self._conf: dict[str, list[float]] = {}
        self._scored: set[str] = set()  # sources whose drafts carry confidences
        # sampling: per source, [accepted, drafted] per draw bin; the draws of each source's
        # last trimmed draft wait here for its verification
        self.by_draw: dict[str, list[list[float]]] = {}
        self._u: dict[str, list[float]] = {}
        # per scored source that costs a step, how its first drafts' confidences fall when it
        # is asked (CALIB_BINS counts; see PEEK_SEEN)
        self.first: dict[str, list[float]] = {}
        for source, entry in (state.items() if isinstance(state, dict) else ()):
            self._restore(str(source), entry)
        self.ema = ema

    def _restore(self, source: str, entry) -> None:
        """One source's state as the last generation left it: acceptance estimates and where
        its tries stood (so a source that never pays stays rarely tried across prompts)."""
        entry = entry if isinstance(entry, dict) else {"acc": entry}
        acc = entry.get("acc")
        if isinstance(acc, list) and all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in acc):
            self.accs[source] = (list(acc) + [self.prior] * self.k)[:self.k]
        for name, into in (("every", self._every), ("wait", self._wait)):
            v = entry.get(name)
            if isinstance(v, int) and 0 <= v <= self.max_probe_every:
                into[source] = max(v, self.probe_every) if name == "every" else v
        cal = entry.get("calib")
        if (isinstance(cal, list) and len(cal) == CALIB_BINS
                and all(isinstance(c, list) and len(c) == 2 and all(isinstance(x, (int, float)) for x in c)
                        and 0 <= c[0] <= c[1] <= CALIB_CAP for c in cal)):
            self.calib[source] = [[float(a), float(n)] for a, n in cal]
        by = entry.get("draws")
        if (isinstance(by, list) and len(by) == U_BINS
                and all(isinstance(c, list) and len(c) == 2 and all(isinstance(x, (int, float)) for x in c)
                        and 0 <= c[0] <= c[1] <= CALIB_CAP for c in by)):
            self.by_draw[source] = [[float(a), float(n)] for a, n in by]
        first = entry.get("first")
        if (isinstance(first, list) and len(first) == CALIB_BINS
                and all(isinstance(x, (int, float)) and 0 <= x <= CALIB_CAP for x in first)):
            self.first[source] = [float(x) for x in first]

    @property
    def acc(self) -> list[float]:
        """The estimates of drafts with no named source (single-source drafters)."""
        return self.accs[""]

    def acc_for(self, source: str) -> list[float]:
        """The acceptance estimates of one draft source (the prior until it drafts)."""
        return self._acc(source)

    def _acc(self, source: str) -> list[float]:
        if source not in self.accs:
            self.accs[source] = [self.prior] * self.k
        return self.accs[source]

    def _step(self, source: str) -> float:
        return self.step_s.get(source, self.draft_step_s)

    def _best(self, probs: list[float], source: str = "") -> int:
        best_k, best = 0, (1.0 + self.others) / self.c[0]
        expected, survive, step = 1.0 + self.others, 1.0, self._step(source)
        for j, p in enumerate(probs, 1):
            survive *= p
            expected += survive
            rate = expected / (self.c[j] + j * step)
            if rate > best:
                best_k, best = j, rate
        return best_k

    def _reach(self, source: str = "") -> int:
        """How far a draft could pay were every token right; until the longest pass has been
        timed, the curve there is only a prior (perhaps measured on a busy machine): all k."""
        return self._best([1.0] * self.k, source) if self.c.timed(self.k + 1) else self.k

    def soon(self, source: str, passes: int) -> bool:
        # a source held short drafts again at its next try, no sooner than the passes it still
        # waits (its wait counts only the passes it is asked in)
        if self.k <= 0 or self._best(self._acc(source), source) > 0:
            return self.k > 0  # no drafting at all, or the source drafts now
        if self._reach(source) == 0:
            return False  # no draft could pay: never tried
        # (no peeks counted here: a peek is made where the rows are at hand anyway, never a
        # reason to read them)
        return self._probe_every(source) - self._wait.get(source, 0) <= passes

    def _probe_every(self, source: str) -> int:
        """Passes between tries of a source held short."""
        return self._every.get(source, self.probe_every)

    def _free(self, source: str) -> bool:
        """A source whose drafts are scored and cost next to nothing to make (prompt lookup):
        asking it to draft costs nothing, so it is never held back before drafting; `trim`
        judges each of its drafts by its scores."""
        return source in self._scored and self._step(source) < FREE_STEP * self.c[0]

    def limit(self, source: str) -> int:
        if self._free(source):
            return self._reach(source)
        best = self._best(self._acc(source), source)
        reach = self._reach(source)
        if best >= reach:
            return best
        wait = self._wait.get(source, 0) + 1
        if wait < self._probe_every(source):
            self._wait[source] = wait
            # a peek: the first step is computed, the chain goes on while `go_on` says so
            return reach if best == 0 and self._peeks(source) else best
        self._wait[source] = 0
        self._trying[source] = (best + 1, best)
        return reach

    def _peeks(self, source: str) -> bool:
        """Whether a scored source held short should still compute its first draft (see
        PEEK_SEEN): the drafts trimming would keep, by how the source's first confidences
        fall, gain more per pass than the step costs (each kept draft gains its expected
        tokens at the one-token rate, less its longer pass)."""
        if source not in self._scored or self._free(source):
            return False
        seen = self.first.get(source)
        n = sum(seen) if seen else 0.0
        if n < PEEK_SEEN:
            return True
        base, c0, c1, step = 1.0 + self.others, self.c[0], self.c[1], self._step(source)
        gain = 0.0
        for b, m in enumerate(seen):
            if m > 0:
                a = self.calibrated(source, [(b + 0.5) / CALIB_BINS])[0]
                if (base + a) / (c1 + step) > base / c0:  # what `trim` keeps
                    gain += m * ((base + a) * c0 / base - c1)
        return gain / n > step

    def go_on(self, source: str, conf: list[float], u: list[float] | None = None) -> bool:
        """A scored source's chain goes on while a next draft as sure as its last would be
        verified (its calibrated acceptance, by draw where sampling); a try drafts whole."""
        if source in self._trying or not conf or self._free(source):
            return True
        n = len(conf) + 1
        if n > self.k:
            return False
        cal = self.calibrated(source, list(conf) + [conf[-1]], list(u[:n]) if u else None)
        return self._best(cal, source) >= n

    def calibrated(self, source: str, conf: list[float], u: list[float] | None = None) -> list[float]:
        """The acceptance the policy expects of drafts with these confidences (see CALIB_BINS),
        and with these draws where the request samples (see U_BINS)."""
        table = self.calib.get(source)
        out = []
        for c in conf:
            hits, n = table[_bin(c)] if table else (0.0, 0.0)
            out.append((hits + CALIB_PRIOR * c) / (n + CALIB_PRIOR))
        return self._by_draw(source, out, u) if u else out

    def _by_draw(self, source: str, acc: list[float], u: list[float]) -> list[float]:
        """Expected acceptances scaled by how drafts under each draw were accepted (U_BINS)."""
        table = self.by_draw.get(source)
        if not table:
            return acc
        hits, n = sum(c[0] for c in table), sum(c[1] for c in table)
        if n <= 0 or hits <= 0:
            return acc
        rate = hits / n
        out = list(acc)
        for j, x in enumerate(u[:len(acc)]):
            h, m = table[_u_bin(x)]
            out[j] = min(1.0, acc[j] * ((h + U_PRIOR * rate) / (m + U_PRIOR)) / rate)
        return out

    def seen(self, source: str, conf: list[float]) -> None:
        # every first draft of a costly scored source counts where its first drafts fall (the
        # peeks' evidence), verified or set aside
        if not conf:
            return
        self._scored.add(source)
        if not self._free(source):
            seen = self.first.setdefault(source, [0.0] * CALIB_BINS)
            seen[_bin(conf[0])] += 1.0
            if sum(seen) > CALIB_CAP:
                seen[:] = [x / 2 for x in seen]

    def kept(self, source: str, conf: list[float], u: list[float] | None = None) -> int:
        if source in self._trying or not conf:
            return len(conf)
        return min(len(conf), self._best(self.calibrated(source, conf, u), source))

    def trim(self, draft) -> int:
        source = draft.source
        if draft.conf:
            self._conf[source] = draft.conf
            self.seen(source, draft.conf)
        if source in self._trying:
            return len(draft.tokens)  # a try is verified whole
        acc = self._acc(source)
        u = draft.u
        if u:
            self._u[source] = u
        if not draft.conf:
            return self._best(self._by_draw(source, acc[:len(draft.tokens)], u) if u
                              else acc[:len(draft.tokens)], source)
        cal = self.calibrated(source, draft.conf, u)
        best = self._best(cal, source)
        if not self._free(source):
            # the positions trimmed away are never verified, so their acceptance estimates
            # would keep the prior and `limit` would go on asking for drafts its scores then
            # throw away (a head whose every step is computed for nothing): they learn what
            # the scores expect of them instead
            for j in range(best, min(len(cal), len(acc))):
                acc[j] += self.ema * (cal[j] - acc[j])
        if best == 0 and draft.tokens and self._free(source):
            # a free source's tries: now and then its first token is checked anyway, so a score
            # band that once did not pay keeps being measured and can recover
            wait = self._wait.get(source, 0) + 1
            if wait >= self._probe_every(source):
                self._wait[source] = 0
                self._trying[source] = (1, 0)
                return 1
            self._wait[source] = wait
        return best

    def update(self, drafted: int, accepted: int, source: str = "") -> None:
        acc = self._acc(source)
        for j in range(min(drafted, accepted + 1)):
            hit = 1.0 if j < accepted else 0.0
            acc[j] += self.ema * (hit - acc[j])
        conf = self._conf.pop(source, None)
        if conf:  # each verified draft teaches its confidence bin
            _teach(self.calib.setdefault(source, [[0.0, 0.0] for _ in range(CALIB_BINS)]),
                   [_bin(c) for c in conf], drafted, accepted)
        u = self._u.pop(source, None)
        if u:  # ... and, sampling, its draw's bin
            _teach(self.by_draw.setdefault(source, [[0.0, 0.0] for _ in range(U_BINS)]),
                   [_u_bin(x) for x in u], drafted, accepted)
        tried, self._trying = self._trying, {}  # a try whose source did not draft lapses
        if source in tried and conf and self._free(source):
            # a free source's one-token try: tries go on as often while its band nears paying
            every = self._every.get(source, self.probe_every)
            near = self._best([min(1.0, self.calibrated(source, conf[:1])[0] / 0.8)], source) > 0
            self._every[source] = self.probe_every if near else min(2 * every, self.max_probe_every)
        elif source in tried:
            length, before = tried[source]
            every = self._every.get(source, self.probe_every)
            need = self._break_even(acc, length, source)
            if self._best(acc, source) > before or acc[length - 1] >= 0.8 * need:
                self._every[source] = self.probe_every  # it pays, or it nearly does: keep trying
            elif self.c.timed(drafted + 1):  # a try only counts once its pass length is timed
                self._every[source] = min(2 * every, self.max_probe_every)

    def _break_even(self, acc: list[float], n: int, source: str = "") -> float:
        """The acceptance the n-th draft needs for n drafts to pay as well as n - 1 (above 1:
        it never can at this verify cost)."""
        expected, survive = 1.0 + self.others, 1.0
        for p in acc[:n - 1]:
            survive *= p
            expected += survive
        step = self._step(source)
        longer = self.c[n] + n * step
        shorter = self.c[n - 1] + (n - 1) * step
        return expected * (longer / shorter - 1.0) / max(survive, 1e-9)

    def observe(self, step: Step) -> None:
        self.observe_draft_time(step.draft_s, step.made, step.source)
        self.observe_verify(step.rows, step.verify_s)
        self.update(step.drafted, step.accepted, step.source)

    def observe_draft_time(self, seconds: float, steps: int, source: str = "") -> None:
        """A draft of `steps` tokens from `source` took `seconds` (sources differ a lot: a
        prompt lookup costs microseconds, a head step milliseconds)."""
        if steps:
            ema_into(self.step_s, source, seconds / steps, self.ema)

    def observe_verify(self, n: int, seconds: float) -> None:
        self.c.observe(n, seconds)

    def finish(self) -> None:
        """Keep what this generation learned (verify cost, acceptance) for the next one."""
        if self.store is not None:
            self.store.save(self)

    def state(self) -> dict:
        """What the next generation starts from (see `_restore`)."""
        return {s: {"acc": [round(a, 4) for a in acc], "every": self._every.get(s, self.probe_every),
                    "wait": self._wait.get(s, 0),
                    **({"calib": [[round(a, 2), round(n, 2)] for a, n in self.calib[s]]}
                       if s in self.calib else {}),
                    **({"draws": [[round(a, 2), round(n, 2)] for a, n in self.by_draw[s]]}
                       if s in self.by_draw else {}),
                    **({"first": [round(x, 2) for x in self.first[s]]} if s in self.first else {})}
                for s, acc in self.accs.items()}


class PolicyStore:
    """Where a cost policy's learned state lives between generations: edgespec's cache, under
    one key per machine, engine, target file, LM head and decoding kind."""

    def __init__(self, key: str):
        self.key = key

    def load(self) -> dict | None:
        return cache.read_json(ACCEPTANCE_FILE).get(self.key)

    def save(self, policy: CostAware) -> None:
        if policy.c.key:
            store_verify_cost(policy.c.key, policy.c.learned())
        if policy.accs:
            cache.put_json(ACCEPTANCE_FILE, self.key, policy.state())


class MemoryStore(PolicyStore):
    """A policy's learned acceptance state kept in this process only, from a fresh start (what a
    new install starts from): the bench gives each of its rows one, so no row starts from what
    earlier runs or the other rows learned on this machine, and rows drafting with the same head
    do not share estimates. The verify-cost curve is still kept where PolicyStore keeps it (it
    is the machine's, not the row's)."""

    def __init__(self):
        super().__init__("")
        self.state: dict | None = None

    def load(self) -> dict | None:
        return self.state

    def save(self, policy: CostAware) -> None:
        if policy.c.key:
            store_verify_cost(policy.c.key, policy.c.learned())
        if policy.accs:
            self.state = policy.state()


def _teach(table: list[list[float]], bins: list[int], drafted: int, accepted: int) -> None:
    """Count each verified draft position (accepted or the first rejected) into its bin's
    [accepted, drafted]; a bin past CALIB_CAP drafts halves its counts (recent ones weigh more)."""
    for j in range(min(drafted, accepted + 1, len(bins))):
        cell = table[bins[j]]
        cell[0] += 1.0 if j < accepted else 0.0
        cell[1] += 1.0
        if cell[1] > CALIB_CAP:
            cell[0], cell[1] = cell[0] / 2, cell[1] / 2


def _bin(conf: float) -> int:
    return min(max(int(conf * CALIB_BINS), 0), CALIB_BINS - 1)


def _u_bin(u: float) -> int:
    return min(max(int(u * U_BINS), 0), U_BINS - 1)


def make_policy(name: str, k: int, engine=None, greedy: bool = True, store: PolicyStore | None = None):
    """The draft-length policy `name` for up to k drafts per step (see `SpecConfig.draft_k`,
    the one place that decides k). The cost policy gets its verify-cost curve (this process's
    live one, the stored one, or a short measurement on `engine`) and the state the last
    generation with the same key left, here, before it is built. greedy: verification as
    greedy decoding asks for it (low-rank LM head) or as sampling does. store: where the cost
    policy's learned state comes from and goes (default: edgespec's cache, per machine, engine,
    target, LM head and decoding kind; a MemoryStore keeps it in this process)."""
    if name == "fixed":
        return FixedK(k)
    if name == "confidence":
        return Confidence(k)
    if name == "cost":
        if engine is None:
            raise ValueError("the cost policy needs the target engine to measure verify cost")
        own = engine.cost_policy(k, greedy)  # a slot of a batched engine (runtime/batching.py)
        if own is not None:
            return own
        cost = measure_verify_cost(engine, k + 1, top_only=greedy)
        if store is None:
            store = PolicyStore(f"{cost.key}|{'greedy' if greedy else 'sampled'}")
        return CostAware(k, cost, state=store.load(), store=store)
    raise EdgespecError(f"unknown draft policy '{name}'; choose from {', '.join(POLICIES)}")
