"""Plain NumPy divergences: the float64 reference the kernels are tested against. Written for clarity, not speed
(`fsd-local bench --kernels` times the kernels against a vectorised float32 baseline of its own, bench/kernels.py)."""

from __future__ import annotations

import numpy as np

from fsd_local.kernels.divergence import TOPK_DEFAULT


def log_softmax(x, dtype=np.float64):
    x = np.asarray(x, dtype=dtype)
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def _kl(p, lp, lq):
    with np.errstate(invalid="ignore", divide="ignore"):
        t = np.where(p > 0, p * (lp - lq), 0.0)
    return t.sum()


def divergence(name: str, x, y, topk: int = TOPK_DEFAULT, dtype=np.float64) -> float:
    """x: target logits, y: draft logits (same length)."""
    lp, lq = log_softmax(x, dtype), log_softmax(y, dtype)
    p, q = np.exp(lp), np.exp(lq)
    if name.startswith("topk-"):
        idx = np.argsort(-np.asarray(x, dtype=np.float64), kind="stable")[:topk]
        p = np.append(p[idx], max(0.0, 1.0 - p[idx].sum()))
        q = np.append(q[idx], max(0.0, 1.0 - q[idx].sum()))
        with np.errstate(divide="ignore"):
            lp, lq = np.log(p), np.log(q)
        name = name[5:]
    with np.errstate(divide="ignore", invalid="ignore"):
        m = 0.5 * (p + q)
        lm = np.log(m)
        if name == "js":
            d = 0.5 * _kl(p, lp, lm) + 0.5 * _kl(q, lq, lm)
        elif name == "kl":
            d = _kl(p, lp, lq)
        elif name == "rkl":
            d = _kl(q, lq, lp)
        elif name == "tv":
            d = 0.5 * np.abs(p - q).sum()
        elif name == "paper-js":
            d = 0.5 * _kl(m, lm, lp) + 0.5 * _kl(m, lm, lq)
        else:
            raise ValueError(name)
    return float(d)
