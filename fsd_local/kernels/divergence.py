"""Divergences between the target's and the draft's next-token distributions from raw logit rows and their
log-partitions, float32 per entry with a split (hi, lo) log-partition; NaN or +inf anywhere gives NaN, which
the acceptance rule rejects (docs/design.md, "Divergences")."""

import math

import numpy as np
from numba import njit, prange

from fsd_local.kernels.fastmath import EXP_MIN, kernel, log_mid, radd, vexp, vexp_finite, wide
from fsd_local.kernels.jit_cache import jit
from fsd_local.kernels.names import DIVERGENCES, JS, KL, PAPER_JS, RKL, TOPK_DEFAULT, TOPK_JS, TOPK_KL, TOPK_TV, TV  # noqa: F401
from fsd_local.kernels.rows import BLOCK, PARALLEL_MIN, PARALLEL_PARTS, row_lse  # noqa: F401  (row_lse: callers pair it with divergence)
from fsd_local.kernels.topk import top_indices

T_CAP = -EXP_MIN  # |lp - lq| capped here (inf where one row masks a token): exp(-t) stays in range


@njit(inline="always", fastmath={"contract", "nsz", "arcp"}, error_model="numpy")
def _pair(x, hx, lox, y, hy, loy, c):
    """(log p, log q, log p - log q) of one entry, float32; each difference is taken where it is exact."""
    a = x - hx
    b = y - hy
    return a - lox, b - loy, (a - b) - c


@kernel
def _js(x, hx, lox, y, hy, loy, c, n):
    """sum over entries of p log(p/m) + q log(q/m), m = (p+q)/2. Per entry, with M = max(p, q), t = |log p -
    log q| and e = exp(-t) = min/max, this is M * g, g = -(1+e) log((1+e)/2) - t e = (1 - e^2) R(e) - t e
    (fastmath.log_mid): two exps and one polynomial, no division, exactly 0 where p == q."""
    wide()
    total = 0.0
    for lo in range(0, n, BLOCK):
        xb, yb = x[lo : min(lo + BLOCK, n)], y[lo : min(lo + BLOCK, n)]  # see rows.sum_exp
        acc = np.float32(0.0)
        for i in range(xb.shape[0]):
            lp, lq, d = _pair(xb[i], hx, lox, yb[i], hy, loy, c)
            big = vexp(max(lp, lq))
            t = abs(d)
            t = t if t < T_CAP else T_CAP  # inf (one side masked) and NaN (both masked, big == 0) alike
            e = vexp_finite(-t)  # exp(-87.33) is tiny and normal: t e ~ 0, g ~ ln 2
            g = -(np.float32(1.0) + e) * log_mid(e) - t * e
            acc = radd(acc, big * g if big > np.float32(0.0) else np.float32(0.0))
        total += float(acc)
    return total


@kernel
def _paper_js(x, hx, lox, y, hy, loy, c, n):
    """sum of m (2 log m - log p - log q); per entry M (1+e)/2 * (2 log((1+e)/2) + t), notation of _js
    (t uncapped: +inf where one row masks a token the other keeps, as in the reference)."""
    wide()
    total = 0.0
    for lo in range(0, n, BLOCK):
        xb, yb = x[lo : min(lo + BLOCK, n)], y[lo : min(lo + BLOCK, n)]  # see rows.sum_exp
        acc = np.float32(0.0)
        for i in range(xb.shape[0]):
            lp, lq, d = _pair(xb[i], hx, lox, yb[i], hy, loy, c)
            big = vexp(max(lp, lq))
            t = abs(d)
            e = vexp(-t)
            h = np.float32(0.5) + np.float32(0.5) * e
            v = (big * h) * (np.float32(2.0) * log_mid(e) + t)
            acc = radd(acc, v if big > np.float32(0.0) else np.float32(0.0))
        total += float(acc)
    return total


@kernel
def _kl(x, hx, lox, y, hy, loy, c, n):
    """KL(p_x || p_y)."""
    wide()
    total = 0.0
    for lo in range(0, n, BLOCK):
        xb, yb = x[lo : min(lo + BLOCK, n)], y[lo : min(lo + BLOCK, n)]  # see rows.sum_exp
        acc = np.float32(0.0)
        for i in range(xb.shape[0]):
            lp, lq, d = _pair(xb[i], hx, lox, yb[i], hy, loy, c)
            p = vexp(lp)
            acc = radd(acc, p * d if p > np.float32(0.0) else np.float32(0.0))
        total += float(acc)
    return total


@kernel
def _tv(x, hx, lox, y, hy, loy, c, n):
    wide()
    total = 0.0
    for lo in range(0, n, BLOCK):
        xb, yb = x[lo : min(lo + BLOCK, n)], y[lo : min(lo + BLOCK, n)]  # see rows.sum_exp
        acc = np.float32(0.0)
        for i in range(xb.shape[0]):
            lp, lq, d = _pair(xb[i], hx, lox, yb[i], hy, loy, c)
            acc = radd(acc, abs(vexp(lp) - vexp(lq)))
        total += float(acc)
    return total


@jit
def _topk(kind, x, lx, y, ly, n, k):
    idx = top_indices(x, n, k)
    kk = idx.shape[0]
    p = np.empty(kk + 1)
    q = np.empty(kk + 1)
    sp = 0.0
    sq = 0.0
    for j in range(kk):
        p[j] = math.exp(float(x[idx[j]]) - lx)
        q[j] = math.exp(float(y[idx[j]]) - ly)
        sp += p[j]
        sq += q[j]
    p[kk] = max(0.0, 1.0 - sp)  # the remaining mass, one bin, not renormalised
    q[kk] = max(0.0, 1.0 - sq)
    acc = 0.0
    for j in range(kk + 1):
        a, b = p[j], q[j]
        if kind == TOPK_TV:
            acc += 0.5 * abs(a - b)
        elif kind == TOPK_KL:
            if a > 0.0:
                acc += a * (math.log(a) - math.log(b)) if b > 0.0 else np.inf
        else:
            m = 0.5 * (a + b)
            if a > 0.0:
                acc += 0.5 * a * (math.log(a) - math.log(m))
            if b > 0.0:
                acc += 0.5 * b * (math.log(b) - math.log(m))
    return acc


# The largest value each divergence can take (by code, DIVERGENCES' order): a threshold at or above it rescues at
# every slot, which a sampled budget uses to decide a slot without computing its divergence (kernels/accept.py).
# JS and TV are bounded (ln 2, 1), over the full vocabulary and over the top-k bins alike; KL and the paper's JS
# form are not.
BOUNDS = np.array([math.log(2.0), np.inf, np.inf, 1.0, math.log(2.0), np.inf, 1.0, np.inf])
assert len(BOUNDS) == len(DIVERGENCES)


@jit
def _full(kind, x, hx, lox, y, hy, loy, c, n):
    """A full-vocabulary divergence of x[:n] and y[:n] given their split log-partitions (divergence's)."""
    if kind == JS:
        return 0.5 * _js(x, hx, lox, y, hy, loy, c, n)
    if kind == KL:
        return _kl(x, hx, lox, y, hy, loy, c, n)
    if kind == RKL:
        return _kl(y, hy, loy, x, hx, lox, -c, n)
    if kind == TV:
        return 0.5 * _tv(x, hx, lox, y, hy, loy, c, n)
    return 0.5 * _paper_js(x, hx, lox, y, hy, loy, c, n)


@jit(parallel=True)
def _full_parts(kind, x, hx, lox, y, hy, loy, c, n, out):
    """_full of each of PARALLEL_PARTS parts of the rows, on every core: a sum over entries splits at any point."""
    step = (n + PARALLEL_PARTS - 1) // PARALLEL_PARTS
    for p in prange(PARALLEL_PARTS):
        lo, hi = min(p * step, n), min(p * step + step, n)
        out[p] = _full(kind, x[lo:hi], hx, lox, y[lo:hi], hy, loy, c, hi - lo) if hi > lo else 0.0


@jit
def divergence(kind, x, lx, y, ly, n, topk):
    """Divergence of kind `kind` between target row x and draft row y over their first n entries.
    lx, ly: log-partition of each row over those n entries (row_lse). Never negative; NaN on bad input."""
    if not (lx == lx and ly == ly) or lx == -np.inf or ly == -np.inf:
        return np.nan
    if kind == JS or kind == KL or kind == RKL or kind == TV or kind == PAPER_JS:
        hx, hy = np.float32(lx), np.float32(ly)  # lx = hx + lox to float64 accuracy, lox tiny
        lox, loy = np.float32(lx - float(hx)), np.float32(ly - float(hy))
        c = np.float32((lx - float(hx)) - (ly - float(hy)))
        if n >= PARALLEL_MIN:  # a long row: its parts on every core
            parts = np.empty(PARALLEL_PARTS)
            _full_parts(kind, x, hx, lox, y, hy, loy, c, n, parts)
            d = 0.0
            for p in range(PARALLEL_PARTS):
                d += parts[p]
        else:
            d = _full(kind, x, hx, lox, y, hy, loy, c, n)
    else:
        d = _topk(kind, x, lx, y, ly, n, topk)
    return max(d, 0.0) if d == d else np.nan


def divergence_id(name: str) -> int:
    try:
        return DIVERGENCES.index(name)
    except ValueError:
        from fsd_local.errors import ConfigError

        raise ConfigError(f"unknown divergence {name!r}; choose one of {', '.join(DIVERGENCES)}") from None


def compute(name: str, target_logits, draft_logits, topk: int = TOPK_DEFAULT) -> float:
    """Convenience for one pair of rows (tests, benchmarks, apps): the divergence named `name`."""
    x = np.ascontiguousarray(target_logits, dtype=np.float32)
    y = np.ascontiguousarray(draft_logits, dtype=np.float32)
    n = min(x.shape[0], y.shape[0])
    return float(divergence(divergence_id(name), x, row_lse(x, n), y, row_lse(y, n), n, topk))
