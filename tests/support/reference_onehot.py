"""Float64 references for `onehot.py`: the general NumPy reference applied to an exact one-hot draft row, and
the closed forms written out independently, so the kernels are checked against both. Clarity, not speed."""

from __future__ import annotations

import math

import numpy as np

from fsd_local.kernels.divergence import TOPK_DEFAULT
from support.reference import divergence as reference_divergence
from support.reference import log_softmax


def onehot_row(n: int, d: int) -> np.ndarray:
    """Draft logits whose softmax is exactly e_d: -inf everywhere except 0 at d."""
    y = np.full(n, -np.inf, np.float32)
    y[d] = 0.0
    return y


def divergence(name: str, x, d: int, topk: int = TOPK_DEFAULT) -> float:
    """The general float64 reference (`reference.divergence`) against the exact one-hot row at d."""
    x = np.asarray(x)
    return reference_divergence(name, x, onehot_row(x.shape[0], d), topk)


def closed_form(name: str, x, d: int) -> float:
    """The full-vocabulary closed forms in float64 (module docstring of onehot.py), from P = p(d)."""
    lp_all = log_softmax(x)
    lp = float(lp_all[d])
    P = math.exp(lp)
    if name == "tv":
        return 1.0 - P
    if name == "rkl":
        return -lp
    if name == "js":
        a = (1.0 - P) * math.log(2.0) + (P * math.log(2.0 * P / (P + 1.0)) if P > 0 else 0.0)
        return 0.5 * a + 0.5 * math.log(2.0 / (P + 1.0))
    if name in ("kl", "paper-js"):
        off = np.exp(np.delete(lp_all, d))
        return math.inf if np.any(off > 0) else 0.0
    raise ValueError(name)
