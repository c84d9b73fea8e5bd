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
