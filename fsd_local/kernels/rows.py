"""Reductions over one logit row: max and log-sum-exp (every divergence, sampling and the acceptance rule)."""

import math

import numpy as np
from numba import prange

from fsd_local.kernels.fastmath import INT32_MIN, from_order_key, kernel, order_key, radd, vexp, wide
from fsd_local.kernels.jit_cache import jit

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


@jit
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


@jit
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


ARGMAX_BLOCK = 2048  # argmax's blocks: their maxima in one vectorised pass, then one block scanned


@kernel
def _block_max(x, lo, hi):
    """The order key of max(x[lo:hi]): one vectorised pass over the slice."""
    wide()
    xb = x[lo:hi]  # a slice: see sum_exp
    m = INT32_MIN
    for i in range(xb.shape[0]):
        k = order_key(xb[i])
        m = k if k > m else m
    return m


@jit
def max_argmax(x, n):
    """(max, index of its first occurrence) of x[:n] in one pass: each ARGMAX_BLOCK block's max (vectorised), then a
    scan of the first block holding the largest. With a positive NaN: max NaN and the plain scalar rule's index."""
    best, where = INT32_MIN, 0
    for lo in range(0, n, ARGMAX_BLOCK):
        m = _block_max(x, lo, min(lo + ARGMAX_BLOCK, n))
        if m > best:
            best, where = m, lo
    mx = from_order_key(best)
    if mx == mx:
        for i in range(where, min(where + ARGMAX_BLOCK, n)):
            if x[i] == mx:
                return mx, i
    best_i = 0
    for i in range(1, n):
        if x[i] > x[best_i]:
            best_i = i
    return mx, best_i


@jit(parallel=True)
def max_argmax_rows(P, m, n, mx, top):
    """max_argmax of rows P[:m], on every core numba has: between two decodes llama.cpp's threads are idle, and a
    verify batch's rows are read at the memory speed of all of them rather than one's."""
    for r in prange(m):
        mx[r], top[r] = max_argmax(P[r], n)


PARALLEL_MIN = 65536  # rows this long are split over the cores (below, a thread's start costs more than it saves)
PARALLEL_PARTS = 8


@jit(parallel=True)
def _part_max(x, n, keys, starts):
    step = (n + PARALLEL_PARTS - 1) // PARALLEL_PARTS
    for p in prange(PARALLEL_PARTS):
        lo = p * step
        best, where = INT32_MIN, lo
        for b in range(lo, min(lo + step, n), ARGMAX_BLOCK):
            k = _block_max(x, b, min(b + ARGMAX_BLOCK, lo + step, n))
            if k > best:
                best, where = k, b
        keys[p], starts[p] = best, where


@jit
def _from_parts(x, n, keys, starts):
    """max_argmax of x[:n] from its parts' maxima (order keys) and the starts of their best blocks: the largest
    part's block scanned for the first entry equal to the max (a NaN max: the whole row, the scalar rule)."""
    best, where = keys[0], starts[0]
    for p in range(1, PARALLEL_PARTS):
        if keys[p] > best:
            best, where = keys[p], starts[p]
    mx = from_order_key(best)
    if mx == mx:
        for i in range(where, min(where + ARGMAX_BLOCK, n)):
            if x[i] == mx:
                return mx, i
    return max_argmax(x, n)


@jit
def max_argmax_wide(x, n):
    """max_argmax of one long row read by every core (a draft's row of a 150-260k vocabulary): the block maxima of
    PARALLEL_PARTS parts in parallel, then one block scanned."""
    if n < PARALLEL_MIN:
        return max_argmax(x, n)
    keys = np.empty(PARALLEL_PARTS, np.int32)
    starts = np.empty(PARALLEL_PARTS, np.int64)
    _part_max(x, n, keys, starts)
    return _from_parts(x, n, keys, starts)


@kernel
def _block_copy_max(x, y, lo, hi):
    """_block_max of x[lo:hi], copying the slice into y[lo:hi] in the same pass."""
    wide()
    xb, yb = x[lo:hi], y[lo:hi]
    m = INT32_MIN
    for i in range(xb.shape[0]):
        v = xb[i]
        yb[i] = v
        k = order_key(v)
        m = k if k > m else m
    return m


@jit(parallel=True)
def _part_copy_max(x, y, n, keys, starts):
    step = (n + PARALLEL_PARTS - 1) // PARALLEL_PARTS
    for p in prange(PARALLEL_PARTS):
        lo = p * step
        best, where = INT32_MIN, lo
        for b in range(lo, min(lo + step, n), ARGMAX_BLOCK):
            k = _block_copy_max(x, y, b, min(b + ARGMAX_BLOCK, lo + step, n))
            if k > best:
                best, where = k, b
        keys[p], starts[p] = best, where


@jit
def copy_max_argmax(x, n, y):
    """max_argmax of x[:n] while copying it into y[:n] in the same pass: a draft's row that the acceptance kernel
    reads after the draft's next decode has overwritten llama.cpp's buffer is copied by the pass that picks its
    token (one read of the row, not two). Long rows are split over the cores as in max_argmax_wide."""
    if n < PARALLEL_MIN:
        copy_row(x, n, y)
        return max_argmax(y, n)
    keys = np.empty(PARALLEL_PARTS, np.int32)
    starts = np.empty(PARALLEL_PARTS, np.int64)
    _part_copy_max(x, y, n, keys, starts)
    return _from_parts(y, n, keys, starts)


@kernel
def copy_row(x, n, y):
    """y[:n] = x[:n] as one vectorised loop (numba's slice assignment checks for overlap and may copy twice)."""
    wide()
    xb, yb = x[:n], y[:n]
    for i in range(xb.shape[0]):
        yb[i] = xb[i]


@jit(parallel=True)
def _part_lse(x, n, mx, s):
    step = (n + PARALLEL_PARTS - 1) // PARALLEL_PARTS
    for p in prange(PARALLEL_PARTS):
        lo, hi = min(p * step, n), min(p * step + step, n)
        m = row_max(x[lo:hi], hi - lo) if hi > lo else np.float32(-np.inf)
        mx[p] = m
        s[p] = sum_exp(x[lo:hi], hi - lo, m) if m > -np.inf and m < np.inf else (0.0 if m == -np.inf else np.nan)


@jit
def row_lse_wide(x, n):
    """row_lse of one long row read by every core: each part's max and sum of exp (one read of the part; its
    second pass finds it in the core's cache), combined. Short rows: row_lse."""
    if n < PARALLEL_MIN:
        return row_lse(x, n)
    mx = np.empty(PARALLEL_PARTS, np.float32)
    s = np.empty(PARALLEL_PARTS)
    _part_lse(x, n, mx, s)
    m = np.float32(-np.inf)
    for p in range(PARALLEL_PARTS):
        if not (mx[p] == mx[p] and s[p] == s[p]):
            return np.nan
        m = max(m, mx[p])
    if m == -np.inf:
        return -np.inf
    total = 0.0
    for p in range(PARALLEL_PARTS):
        if s[p] > 0.0:
            total += s[p] * math.exp(float(mx[p]) - float(m))
    return float(m) + math.log(total)
