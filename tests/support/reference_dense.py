"""Float64 NumPy references for kernels/dense.py (an untruncated round's rows), written from the definitions in
docs/design.md ("The acceptance rules", "The quality budget"): the processed distribution at a temperature alone,
the SD residual, and the sampled loss of a slot. Clarity, not speed."""

from __future__ import annotations

import math

import numpy as np

from fsd_local.kernels.names import CASCADE, FSD_PAPER, RELAXED, TYPICAL


def processed(x, t: float) -> np.ndarray:
    """p~ = softmax(x / t) over every token (masked tokens, -inf, get 0)."""
    z = np.asarray(x, np.float64) / t
    w = np.exp(z - z.max())
    return w / w.sum()


def raw_lse(x) -> float:
    """The raw (temperature 1) log-partition of x."""
    return float(np.logaddexp.reduce(np.asarray(x, np.float64)))


def residual(x, y, t: float, onehot: int | None = None) -> np.ndarray:
    """norm(max(p~ - q~, 0)), q~ the draft's processed row, or one-hot on token `onehot` (prompt lookup)."""
    p = processed(x, t)
    q = np.zeros_like(p) if onehot is not None else processed(y, t)
    if onehot is not None:
        q[onehot] = 1.0
    r = np.maximum(p - q, 0.0)
    return r / r.sum()


def rescue_set(mode: int, x, tau: float, eps: float, alpha: float, k: int) -> np.ndarray:
    """The tokens a lossy rule rescues at a slot whose rule passed: the divergence rules every token the target
    does not mask; typical, cascade and relaxed those their test on p(t) (the raw softmax) allows."""
    x = np.asarray(x, np.float64)
    p = np.exp(x - raw_lse(x))
    finite = x > -np.inf
    if mode == TYPICAL:
        h = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0))
        return finite & ((1 - p) / (1 - min(eps, alpha * math.exp(-h))) <= tau)
    if mode == CASCADE:
        return finite & (1 - p / p.max() <= tau)
    if mode == RELAXED:
        rank = np.sum(x[None, :] > x[:, None], axis=1) if x.size <= 4096 else _rank(x)
        return finite & (rank < k) & (p.max() - p <= tau)
    return finite


def _rank(x: np.ndarray) -> np.ndarray:
    """How many entries are strictly above each one (ties share their rank)."""
    order = np.sort(x)
    return x.size - np.searchsorted(order, x, side="right")


def sampled_loss(mode: int, x, y, t: float, tau: float, eps=0.09, alpha=0.3, k=10, onehot: int | None = None):
    """(max(0, E_p~[log p] - E_r[log p]), P(rescue)) of a slot: r the distribution the rule emits from there
    (min(p~, q~), the rescued part of (q~ - p~)+, and the rejected mass spread as the residual), p the raw softmax."""
    p = processed(x, t)
    if onehot is not None:
        q = np.zeros_like(p)
        q[onehot] = 1.0
    else:
        q = processed(y, t)
    logp = np.asarray(x, np.float64) - raw_lse(x)
    if mode == FSD_PAPER:
        r, rescued = q, 1.0
    else:
        a = rescue_set(mode, x, tau, eps, alpha, k)
        over, under = np.maximum(q - p, 0.0), np.maximum(p - q, 0.0)
        rescued, rejected = over[a].sum(), over[~a].sum()
        if rescued == 0:
            return 0.0, 0.0
        r = np.minimum(p, q) + np.where(a, over, 0.0) + (rejected * under / under.sum() if under.sum() else 0.0)
    if np.any((r > 0) & (logp == -np.inf)):
        return math.inf, rescued
    with np.errstate(invalid="ignore"):
        return max(0.0, float(np.sum(np.where(p > 0, p * logp, 0.0)) - np.sum(np.where(r > 0, r * logp, 0.0)))), rescued
