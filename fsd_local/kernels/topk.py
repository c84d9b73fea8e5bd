"""Top-k selection without sorting a whole row: the top-k divergences (divergence.py) and the top-k / top-p
filters of sampling (sampling.py) both use it."""
import numpy as np
from numba import njit

from fsd_local.kernels.fastmath import kernel, wide
from fsd_local.kernels.rows import row_max


@kernel
def count_at_least(x, n, t):
    """How many of x[:n] are >= t: one vectorised compare-and-add pass (int32 lanes)."""
    wide()
    c = np.int32(0)
    for i in range(n):
        c += np.int32(1) if x[i] >= t else np.int32(0)
    return c


@njit(cache=True)
def gather_sorted(x, n, t):
    """Indices of the entries of x[:n] that are >= t, largest value first (stable for ties)."""
    idx = np.empty(count_at_least(x, n, t), np.int64)
    j = 0
    for i in range(n):
        if x[i] >= t:
            idx[j] = i
            j += 1
    return idx[np.argsort(-x[idx], kind="mergesort")]


@njit(cache=True)
def top_threshold(x, n, mx, k):
    """A logit t with k <= count(x >= t) <= 4k where ties allow, found by counting passes only: double the
    distance below the max until k entries are in, then bisect it down. Sorting then touches <= 4k entries
    instead of everything near the top (tens of thousands on flat rows)."""
    lo, hi = np.float32(0.0), np.float32(0.25)
    while count_at_least(x, n, mx - hi) < k:
        lo, hi = hi, hi * np.float32(2.0)
        if hi > np.float32(1e30):
            return np.float32(-np.inf)  # fewer than k finite entries: take everything
    for _ in range(30):
        if count_at_least(x, n, mx - hi) <= 4 * k:
            break
        mid = np.float32(0.5) * (lo + hi)
        if count_at_least(x, n, mx - mid) >= k:
            hi = mid
        else:
            lo = mid
    return mx - hi


@njit(cache=True)
def top_indices(x, n, k):
    """Indices of the k largest entries of x[:n], largest first (ties broken by lower index)."""
    k = min(k, n)
    t = top_threshold(x, n, row_max(x, n), k)
    if t == -np.inf:
        return np.argsort(-x[:n], kind="mergesort")[:k]
    return gather_sorted(x, n, t)[:k]
