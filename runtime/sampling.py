"""Sampling settings and the target's next-token distribution (numpy only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgespec.errors import EdgespecError


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # nucleus mass kept; 1 keeps everything
    seed: int | None = None  # None or negative (llama.cpp's -1): a random seed

    def __post_init__(self):
        if self.seed is not None and self.seed < 0:
            self.seed = None
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise EdgespecError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise EdgespecError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise EdgespecError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution that sampling draws from: temperature, then top-k, then top-p. [V] float64."""
    x = logits.astype(np.float64) / max(p.temperature, 1e-8)
    if p.top_k and p.top_k < x.size:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        x = np.where(x >= kth, x, -np.inf)
    x = np.exp(x - x.max())
    x /= x.sum()
    if p.top_p < 1.0:
        x = _top_p(x, p.top_p)
    return x


def _top_p(x: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p; renormalise.

    Sorts only the top few hundred tokens when they already hold the mass (the usual case):
    a full argsort of a 262k vocabulary per token would cost more than a decode.
    """
    m = min(x.size, 512)
    while True:
        top = np.argpartition(-x, m - 1)[:m] if m < x.size else np.arange(x.size)
        order = top[np.argsort(-x[top], kind="stable")]
        cum = np.cumsum(x[order])
        if cum[-1] >= top_p or m == x.size:
            keep = order[: int(np.searchsorted(cum, top_p) + 1)]
            break
        m = min(x.size, m * 8)
    cut = np.zeros_like(x)
    cut[keep] = x[keep]
    return cut / cut.sum()


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    """One token from the target's logits: argmax when greedy, else a draw from `probs`."""
    if p.greedy:
        return int(np.argmax(logits))
    return draw(probs(logits, p), rng)


def draw(dist: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw; avoids rng.choice's O(V) validation on a 262k vocabulary."""
    cdf = np.cumsum(dist)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), dist.size - 1))
