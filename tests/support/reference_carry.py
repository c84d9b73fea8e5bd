"""The float64 reference of the carry kernels (kernels/carry.py): a draft's distribution carried onto the target's
vocabulary, written straight from its definition with a loop over the pairs of the map."""

from __future__ import annotations

import numpy as np


def carried_probs(row, target_of, n_target: int) -> np.ndarray:
    """q' over the target's tokens: each draft token's probability added on the target token it is carried to,
    then renormalised over what was carried (all zeros when nothing finite was)."""
    x = np.asarray(row, np.float64)
    finite = np.isfinite(x) | (x == -np.inf)
    if not np.all(finite) or np.all(x == -np.inf):
        return np.full(n_target, np.nan if not np.all(finite) else 0.0)
    p = np.exp(x - x.max())
    q = np.zeros(n_target)
    for d, t in enumerate(target_of):
        if t >= 0:
            q[t] += p[d]
    total = q.sum()
    return q / total if total > 0 else q


def carried_logits(row, target_of, n_target: int) -> np.ndarray:
    """log of the unnormalised carried mass: -inf on the target's own tokens."""
    x = np.asarray(row, np.float64)
    q = np.zeros(n_target)
    m = np.max(x[np.asarray(target_of) >= 0], initial=-np.inf)
    if m == -np.inf:
        return np.full(n_target, -np.inf)
    for d, t in enumerate(target_of):
        if t >= 0:
            q[t] += np.exp(x[d] - m)
    with np.errstate(divide="ignore"):
        return np.log(q) + m
