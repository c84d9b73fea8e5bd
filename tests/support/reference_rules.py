"""Float64 NumPy references for `rules.py`: each rule written straight from its definition (docs/design.md,
"The acceptance rules"), for the tests. Clarity, not speed."""

from __future__ import annotations

import math

import numpy as np

from fsd_local.kernels.names import RELAXED_K_DEFAULT, TYPICAL_ALPHA_DEFAULT, TYPICAL_EPS_DEFAULT
from support.reference import log_softmax


def entropy(x) -> float:
    lp = log_softmax(x)
    p = np.exp(lp)
    with np.errstate(invalid="ignore"):
        return float(-np.sum(np.where(p > 0, p * lp, 0.0)))


def critical_tau(
    mode: str,
    x,
    d: int,
    divergence: float | None = None,
    eps: float = TYPICAL_EPS_DEFAULT,
    alpha: float = TYPICAL_ALPHA_DEFAULT,
    k: int = RELAXED_K_DEFAULT,
) -> float:
    """The smallest tau at which `mode` rescues draft token d against target logits x (+inf: never; for
    fsd-entropy, `divergence` is D(p, q) at the slot). NaN for rows with NaN."""
    x = np.asarray(x, np.float64)
    if np.isnan(x).any() or np.isposinf(x).any():
        return math.nan
    if mode == "fsd-entropy":
        g = 1.0 - math.exp(-entropy(x))
        assert divergence is not None
        return divergence / g if g > 0 else (0.0 if divergence == 0 else math.inf)
    if x[d] == -np.inf:
        return math.inf  # the target masks d: never rescued
    p = np.exp(log_softmax(x))
    if mode == "typical":  # p(d) > 1 - tau (1 - m)  <=>  tau > (1 - p(d)) / (1 - m)
        m = min(eps, alpha * math.exp(-entropy(x)))
        return (1.0 - p[d]) / (1.0 - m)
    if mode == "cascade":  # p(d) >= (1 - tau) max p
        return 1.0 - p[d] / p.max()
    if mode == "relaxed":  # d among the top k, p(d) >= max p - tau
        if np.sum(x > x[d]) >= k:
            return math.inf
        return p.max() - p[d]
    raise ValueError(mode)


def rescues(mode: str, x, d: int, tau: float, **kw) -> bool:
    """Whether `mode` rescues d at tau (tau = 0 never: the rules only act where tau > 0)."""
    c = critical_tau(mode, x, d, **kw)
    if not tau > 0 or math.isnan(c):
        return False
    return tau > c if mode == "typical" else tau >= c
