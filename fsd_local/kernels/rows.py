"""Reductions over one logit row: max and log-sum-exp (every divergence, sampling and the acceptance rule)."""

import math

import numpy as np
from numba import njit

from fsd_local.kernels.fastmath import INT32_MIN, from_order_key, kernel, order_key, radd, vexp, wide

# float32 partial sums over blocks of this many entries, added in float64: the SIMD partial sums stay short
# (BLOCK / 64 entries each), so the float32 rounding of a 262,144-entry row stays at the 1e-7 level
BLOCK = 4096


@kernel
def row_max(x, n):
    """max of x[:n] (NaN if any entry is a positive NaN), through order-preserving integer keys so it
    vectorises. (A negative NaN sorts below -inf here; row_lse still returns NaN for it, through exp.)"""
    wide()
    m = INT32_MIN
    for i in range(n):
        k = order_key(x[i])
        m = k if k > m else m
    return from_order_key(m)


@kernel
def sum_exp(x, n, shift):
    """sum of exp(x[:n] - shift) for a float32 shift; NaN if any entry is NaN."""
    wide()
    shift = np.float32(shift)
    total = 0.0
    for lo in range(0, n, BLOCK):
        # a slice and range(len): x[i] for i in range(lo, hi) keeps numba's negative-index wraparound
        # (LLVM cannot prove i >= 0), which LLVM vectorises as gathers instead of plain loads
        xb = x[lo : min(lo + BLOCK, n)]
        s = np.float32(0.0)
        for i in range(xb.shape[0]):
            s = radd(s, vexp(xb[i] - shift))
        total += float(s)
    return total


@njit(cache=True)
def row_lse(x, n):
    """log sum exp of x[:n]; -inf for an all -inf row, NaN if any entry is NaN (or +inf)."""
    m = row_max(x, n)
    if m == -np.inf:
        return -np.inf
    s = sum_exp(x, n, m)
    return float(m) + math.log(s) if s == s else np.nan


@kernel
def _entropy_sums(x, n, shift):
    """(sum of w, sum of w * (x - shift)) over x[:n], w = exp(x - shift), shift float32; -inf entries add 0."""
    wide()
    shift = np.float32(shift)
    s_total = 0.0
    t_total = 0.0
    for lo in range(0, n, BLOCK):
        xb = x[lo : min(lo + BLOCK, n)]  # a slice, as in sum_exp
        s = np.float32(0.0)
        t = np.float32(0.0)
        for i in range(xb.shape[0]):
            z = xb[i] - shift
            w = vexp(z)
            s = radd(s, w)
            t = radd(t, w * z if w > np.float32(0.0) else np.float32(0.0))  # 0 * -inf would be NaN
        s_total += float(s)
        t_total += float(t)
    return s_total, t_total


@njit(cache=True)
def row_entropy(x, n, lx):
    """Entropy H(p) in nats of p = softmax(x[:n]), given lx = row_lse(x, n): one vectorised pass. With shift c
    (lx rounded to float32), S = sum exp(x - c) and T = sum exp(x - c) (x - c), H = log S - T / S exactly, for
    any c; c = lx keeps every term <= 1. NaN for a NaN or all -inf row (lx NaN or -inf); never negative."""
    if not lx == lx or lx == -np.inf or lx == np.inf:
        return np.nan
    s, t = _entropy_sums(x, n, np.float32(lx))
    if not (s > 0.0 and t == t):
        return np.nan
    return max(math.log(s) - t / s, 0.0)


ARGMAX_BLOCK = 512  # the block size of argmax's search for the maximum once its value is known


@kernel
def _holds(x, lo, hi, v):
    """1 if v occurs in x[lo:hi], else 0: one vectorised compare-and-or pass over the slice."""
    wide()
    xb = x[lo:hi]  # a slice: see sum_exp
    c = np.int32(0)
    for i in range(xb.shape[0]):
        c |= np.int32(1) if xb[i] == v else np.int32(0)
    return c


@njit(cache=True)
def max_argmax(x, n):
    """(max, index of its first occurrence) of x[:n] at memory speed: the vectorised max pass, then vectorised
    tests of blocks up to the one that holds the max, and a scan of that block. A row with a positive NaN has
    max NaN, and the index the plain scalar rule gives (the first entry no later one exceeds)."""
    mx = row_max(x, n)
    if mx == mx:
        for lo in range(0, n, ARGMAX_BLOCK):
            hi = min(lo + ARGMAX_BLOCK, n)
            if _holds(x, lo, hi, mx):
                for i in range(lo, hi):
                    if x[i] == mx:
                        return mx, i
    best = 0
    for i in range(1, n):
        if x[i] > x[best]:
            best = i
    return mx, best
