"""Sampling settings and the target's next-token distribution (numpy only)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from edgespec.errors import EdgespecError


@dataclass
class SamplingParams:
    """What llama.cpp's sampler chain applies, in its order (as llama-cpp-python builds it):
    logit bias, repetition penalties over the last `penalty_last_n` generated tokens, top-k,
    typical, top-p, min-p (these four on the untempered logits), temperature, then the draw.
    Defaults leave the distribution as temperature alone makes it."""

    temperature: float = 0.0  # 0 means greedy (argmax of the biased, penalised logits)
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # nucleus mass kept; 1 keeps everything
    seed: int | None = None  # None or negative (llama.cpp's -1): a random seed
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    typical_p: float = 1.0  # locally typical sampling mass; 1 keeps everything
    repeat_penalty: float = 1.0  # divide positive logits of recent tokens, multiply negative
    frequency_penalty: float = 0.0  # minus this times a recent token's count
    presence_penalty: float = 0.0  # minus this for every recent token
    penalty_last_n: int = 64  # generated tokens the penalties look back over
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # llama-cpp-python's logits processors, first in the chain: f(input_ids, scores) -> scores,
    # input_ids every token before the one chosen (prompt included), scores float32 [V]
    logits_processor: list | None = None

    def __post_init__(self):
        if self.seed is not None and self.seed < 0:
            self.seed = None
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise EdgespecError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise EdgespecError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise EdgespecError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0 or not 0.0 < self.typical_p <= 1.0:
            raise EdgespecError(f"min_p must be in [0, 1] and typical_p in (0, 1], got "
                                f"{self.min_p} and {self.typical_p}")
        if not np.isfinite(self.repeat_penalty) or self.repeat_penalty <= 0:
            raise EdgespecError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if not (np.isfinite(self.frequency_penalty) and np.isfinite(self.presence_penalty)):
            raise EdgespecError("frequency_penalty and presence_penalty must be finite numbers")
        if self.penalty_last_n < 0:
            raise EdgespecError(f"penalty_last_n must be >= 0, got {self.penalty_last_n}")
        try:
            self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()} or None
        except (TypeError, ValueError):
            raise EdgespecError("logit_bias must map token ids to numbers") from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, n_vocab: int) -> None:
        """For commands (not the drop-in, which keeps everything as llama.cpp does): a top_k
        beyond the vocabulary is a typo, not a cut."""
        if self.top_k > n_vocab:
            raise EdgespecError(f"top_k {self.top_k} is larger than the target's vocabulary "
                                f"({n_vocab} tokens); give 0 to keep every token")

    @property
    def adjusts_logits(self) -> bool:
        """Whether a token's logit depends on more than the model (bias or penalties): greedy
        decoding then needs every logit, not only the top ones."""
        return bool(self.logit_bias) or self.penalizes or bool(self.logits_processor)

    @property
    def penalizes(self) -> bool:
        """Whether the repetition penalties are on (they read the recent tokens)."""
        return self.penalty_last_n > 0 and (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                                            or self.presence_penalty != 0.0)


def adjusted(logits: np.ndarray, p: SamplingParams, recent=(), ids=()) -> np.ndarray:
    """Logits after the logits processors (given `ids`, every token before this one), the
    logit bias and the repetition penalties over `recent` (the tokens generated so far; the
    last `penalty_last_n` count). A float32 copy [V], as llama.cpp's samplers hold them."""
    x = np.array(logits, dtype=np.float32)
    if p.logits_processor:
        arr = np.asarray(ids, dtype=np.intc)
        for f in p.logits_processor:
            x[:] = f(arr, x)
    for tok, b in (p.logit_bias or {}).items():
        if 0 <= tok < x.size:
            x[tok] += b
    window = list(recent)[-p.penalty_last_n:] if p.penalizes else []
    if window:
        ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        v = x[ids]
        v = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
        x[ids] = v - counts * p.frequency_penalty - p.presence_penalty
    return x


@dataclass
class Dist:
    """A distribution over token ids: the tokens the chain keeps, in the order llama.cpp's
    candidate array holds them when its final draw runs, and their weights as that draw
    computes them (every other token has probability 0)."""

    ids: np.ndarray  # int64 [n]
    w: np.ndarray  # float32 [n]: expf(logit / temperature - the largest), llama.cpp's dist weights

    @property
    def p(self) -> np.ndarray:
        return self.w.astype(np.float64) / self.w.sum(dtype=np.float64)

    def prob(self, token: int) -> float:
        return float(self.p[self.ids == token].sum())

    def dense(self, n_vocab: int) -> np.ndarray:
        out = np.zeros(n_vocab)
        out[self.ids] = self.p
        return out

    def pick(self, u: float) -> int:
        """The token llama.cpp's dist sampler picks for its uniform draw u: the first whose
        running weight (summed in float64, in this order) reaches u times the total."""
        cum = np.cumsum(self.w, dtype=np.float64)
        return int(self.ids[min(int(np.searchsorted(cum, cum[-1] * u, side="left")), cum.size - 1)])

    def draw(self, rng: np.random.Generator) -> int:
        return self.pick(rng.random())


class LlamaDraws:
    """The uniform draws of llama.cpp's dist sampler for one request: std::mt19937(seed) and
    one std::uniform_real_distribution<double>(0, 1) draw per generated token (two 32-bit
    words, (w1 + w2 * 2^32) / 2^64, as libstdc++'s generate_canonical makes it). Token i of a
    generation is chosen with draw i whatever was drafted, so sampled text depends on the seed
    alone, and equals llama_cpp.Llama's for the same seed (up to float rounding of the logits).
    seed None or 0xFFFFFFFF (llama.cpp's LLAMA_DEFAULT_SEED): a random one; others are taken
    modulo 2^32, as llama.cpp's uint32 seed."""

    def __init__(self, seed: int | None):
        seed = None if seed is None else seed % 2 ** 32
        if seed is None or seed == 0xFFFFFFFF:
            seed = int.from_bytes(os.urandom(4), "little") % 0xFFFFFFFF
        self.seed = seed  # the stream's seed (a random one drawn here), for llama.cpp's own chain
        self._rs = np.random.RandomState(seed)  # the same generator, seeded as std::mt19937(seed)
        self._u = np.empty(0)

    def __getitem__(self, i: int) -> float:
        while i >= self._u.size:
            words = self._rs.randint(0, 2 ** 32, size=128, dtype=np.uint32).astype(np.float64)
            u = (words[0::2] + words[1::2] * 4294967296.0) / 18446744073709551616.0
            self._u = np.concatenate([self._u, np.minimum(u, np.nextafter(1.0, 0.0))])
        return float(self._u[i])


def chain(logits: np.ndarray, p: SamplingParams, recent=(), grammar=None, ids=()) -> Dist:
    """llama.cpp's sampler chain (see SamplingParams; a grammar masks right after the
    penalties, where llama-cpp-python puts it) on one row of logits [V], in float32 as its
    samplers compute.

    Truncates first: the top-k tokens (or, without top-k, the most likely tokens up to what
    top-p and min-p can keep) are found with one pass over the row, and every later cut, the
    temperature and the weights work on those survivors only, as llama.cpp's samplers do; no
    full-vocabulary float64 array is made. Without top-k, top-p's mass is taken over the whole
    vocabulary (one float32 pass). The survivors keep llama.cpp's order: most likely first
    after top-k or top-p, the typical order after typical sampling alone, else token order."""
    x = adjusted(logits, p, recent, ids) if p.adjusts_logits else np.asarray(logits, np.float32)
    if grammar is not None:
        x = grammar.mask(x).astype(np.float32)
    top = x.max()
    if not np.isfinite(top):
        raise EdgespecError("no token is allowed here (every logit is -inf)")
    mass = None  # top-p's denominator when it is not the survivors' own (no top-k)
    if p.top_k and p.top_k < x.size:
        sel = _at_least(x, float(top), p.top_k)
        if sel.size > p.top_k:  # keep the k largest (and any tied with the k-th)
            kth = np.partition(x[sel], -p.top_k)[-p.top_k]
            sel = sel[x[sel] >= kth]
    elif p.typical_p < 1.0 or (p.top_p >= 1.0 and p.min_p <= 0.0):
        sel = np.flatnonzero(np.isfinite(x))  # the cuts that follow need every token
    elif p.top_p >= 1.0:
        sel = np.flatnonzero(x >= top + np.log(np.float32(p.min_p)))  # min-p alone: a floor
    else:
        mass = np.cumsum(np.exp(x - top), dtype=np.float32)[-1]  # summed in token order
        sel = _top_p_room(x, float(top), p, float(mass))
    vals = x[sel]
    if p.top_k or p.top_p < 1.0:  # llama.cpp sorts: most likely first
        order = np.argsort(-vals, kind="stable")
        sel, vals = sel[order], vals[order]
    if p.typical_p < 1.0:
        keep = _typical(_softmax(vals.astype(np.float64)), p.typical_p)
        sel, vals = sel[keep], vals[keep]
        if p.top_p < 1.0:
            order = np.argsort(-vals, kind="stable")
            sel, vals = sel[order], vals[order]
    if p.top_p < 1.0:  # up to top_p of the mass, in float32 as llama.cpp sums it
        e = np.exp(vals - vals.max())
        pr = e / (np.cumsum(e, dtype=np.float32)[-1] if mass is None else mass * np.exp(top - vals.max()))
        n = min(int(np.searchsorted(np.cumsum(pr, dtype=np.float32), np.float32(p.top_p))) + 1, vals.size)
        sel, vals = sel[:n], vals[:n]
    if p.min_p > 0.0:
        keep = vals >= vals.max() + np.log(np.float32(p.min_p))
        sel, vals = sel[keep], vals[keep]
    t = vals / np.float32(max(p.temperature, 1e-8))
    return Dist(sel.astype(np.int64), np.exp(t - t.max()))


def _at_least(x: np.ndarray, top: float, n: int) -> np.ndarray:
    """Ids of a set of tokens that holds the n largest logits of x: those within a margin of
    the top one, the margin widened until at least n are in (one vectorised pass each)."""
    for margin in (8.0, 32.0, 128.0):
        sel = np.flatnonzero(x >= top - margin)
        if sel.size >= n:
            return sel
    return np.flatnonzero(np.isfinite(x))


def _top_p_room(x: np.ndarray, top: float, p: SamplingParams, mass: float) -> np.ndarray:
    """Without top-k: ids of a set of tokens that holds every token top-p (and min-p after
    it) may keep: the most likely ones, widened until they hold top_p of `mass`."""
    floor = top + float(np.log(p.min_p)) if p.min_p > 0.0 else -np.inf
    for margin in (8.0, 32.0, 128.0):
        sel = np.flatnonzero(x >= top - margin)
        if top - margin <= floor or np.exp(x[sel] - top).sum(dtype=np.float64) >= p.top_p * mass:
            return sel
    return np.flatnonzero(np.isfinite(x))


def probs(logits: np.ndarray, p: SamplingParams, recent=(), grammar=None, ids=()) -> np.ndarray:
    """The chain's distribution as a dense [V] float64 array (tests and reports; the decode
    loop keeps the sparse `chain`)."""
    return chain(logits, p, recent, grammar, ids).dense(np.asarray(logits).size)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """The distribution of logits at a temperature, float64."""
    return _softmax(logits.astype(np.float64) / temperature)


def log_softmax(logits: np.ndarray, axis: int = -1, dtype=np.float64) -> np.ndarray:
    """Log-probabilities of logits along `axis` (float64 unless asked otherwise)."""
    x = np.asarray(logits, dtype=dtype)
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def _typical(px: np.ndarray, mass: float) -> np.ndarray:
    """Locally typical sampling on a distribution px (every entry > 0): the positions whose
    surprise is closest to the entropy, up to `mass` of probability (llama.cpp's rule: stop
    once the sum exceeds it)."""
    entropy = -(px * np.log(px)).sum()
    order = np.argsort(np.abs(-np.log(px) - entropy), kind="stable")
    cum = np.cumsum(px[order])
    return order[: int(np.searchsorted(cum, mass, side="right") + 1)]


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator, recent=(),
           grammar=None, ids=()) -> int:
    """One token from the target's logits: argmax when greedy, else a draw from `probs`.
    `grammar`: anything with `allows(tokens)` and `mask(logits)` (see runtime/grammar.py)."""
    if p.greedy:
        x = adjusted(logits, p, recent, ids) if p.adjusts_logits else logits
        top = int(np.argmax(x))
        if grammar is None or grammar.allows([top])[0]:  # masking only removes tokens
            return top
        return int(np.argmax(grammar.mask(x)))
    return chain(logits, p, recent, grammar, ids).draw(rng)
