"""Divergences of the target's p against a one-hot draft q = e_d (prompt lookup's drafts): tv, rkl and js in closed
form from log p(d), kl and paper-js (+inf or 0) from one vectorised count, the top-k forms over the top k bins;
they agree with the general float32 kernels on an exact one-hot row (docs/design.md, "The acceptance rules")."""

import math

import numpy as np

from fsd_local.kernels.divergence import divergence_id
from fsd_local.kernels.fastmath import EXP_MIN
from fsd_local.kernels.jit_cache import jit
from fsd_local.kernels.names import JS, KL, PAPER_JS, RKL, TOPK_DEFAULT, TOPK_KL, TOPK_TV, TV
from fsd_local.kernels.rows import row_lse
from fsd_local.kernels.topk import count_at_least, top_indices

LN2 = 0.6931471805599453


@jit
def js_of_logprob(lp):
    """JS(p, e_d) from lp = log p(d) alone (float64): the closed form without cancellation near p(d) = 1."""
    if lp >= 0.0:
        return 0.0
    e = -math.expm1(lp)  # 1 - p(d), exact to rounding even when p(d) ~ 1
    t = e * LN2 - math.log1p(-0.5 * e)
    if e < 1.0:  # p(d) > 0: P ln(2P/(1+P)); its limit at P = 0 is 0 (and 0 * log1p(-1) would be NaN)
        t += (1.0 - e) * math.log1p(-e / (2.0 - e))
    return 0.5 * t


@jit
def has_mass_off(x, lx, d, n):
    """True when some i != d has a non-zero float32 probability (x[i] - lx >= EXP_MIN): one vectorised count."""
    t = np.float32(lx + EXP_MIN)
    c = count_at_least(x, n, t)
    if x[d] >= t:
        c -= 1
    return c > 0


@jit
def _topk_onehot(kind, x, lx, d, n, k):
    """The general kernel's k+1 bins (target's top k, then one rest bin, not renormalised) with q one-hot."""
    idx = top_indices(x, n, k)
    kk = idx.shape[0]
    p = np.empty(kk + 1)
    q = np.zeros(kk + 1)
    sp = 0.0
    hit = kk  # the rest bin unless d is among the top k
    for j in range(kk):
        p[j] = math.exp(float(x[idx[j]]) - lx)
        sp += p[j]
        if idx[j] == d:
            hit = j
    p[kk] = max(0.0, 1.0 - sp)
    q[hit] = 1.0
    acc = 0.0
    for j in range(kk + 1):
        a, b = p[j], q[j]
        if kind == TOPK_TV:
            acc += 0.5 * abs(a - b)
        elif kind == TOPK_KL:
            if a > 0.0:
                acc += a * math.log(a) if b > 0.0 else np.inf  # b is 1 or 0
        else:
            m = 0.5 * (a + b)
            if a > 0.0:
                acc += 0.5 * a * (math.log(a) - math.log(m))
            if b > 0.0:
                acc += 0.5 * b * (math.log(b) - math.log(m))
    return acc


@jit
def divergence_onehot(kind, x, lx, d, n, topk):
    """Divergence of kind `kind` (divergence.DIVERGENCES order) between target row x (first n entries,
    log-partition lx from `row_lse`) and the one-hot draft distribution at token d. Never negative;
    NaN on bad input (NaN lx, an all -inf row, d outside [0, n))."""
    if not lx == lx or lx == -np.inf or d < 0 or d >= n:
        return np.nan
    lp = min(float(x[d]) - lx, 0.0)  # log p(d); rounding of lx can put it a hair above 0
    if kind == TV:
        v = -math.expm1(lp)
    elif kind == RKL:
        v = -lp
    elif kind == JS:
        v = js_of_logprob(lp)
    elif kind == KL or kind == PAPER_JS:
        v = np.inf if has_mass_off(x, lx, d, n) else 0.0
    else:
        v = _topk_onehot(kind, x, lx, d, n, topk)
    return max(v, 0.0) if v == v else np.nan


def compute_onehot(name: str, target_logits, d: int, topk: int = TOPK_DEFAULT) -> float:
    """Convenience for one row (tests, benchmarks): the divergence `name` of the target row against e_d."""
    x = np.ascontiguousarray(target_logits, dtype=np.float32)
    n = x.shape[0]
    return float(divergence_onehot(divergence_id(name), x, row_lse(x, n), int(d), n, topk))
