"""Top-k selection without sorting a row, for the top-k divergences and sampling's top-k / top-p filters: the maxima
of blocks of BLOCK entries in one vectorised pass, bisection for the k-th largest, and only the blocks that can
hold the top k read again; only the entries at or above the k-th largest (k, plus ties) are sorted."""

import numpy as np

from fsd_local.kernels.fastmath import INT32_MIN, from_order_key, kernel, order_key, wide
from fsd_local.kernels.jit_cache import jit

BLOCK = 64


@kernel
def count_at_least(x, n, t):
    """How many of x[:n] are >= t: one vectorised compare-and-add pass (int32 lanes)."""
    wide()
    c = np.int32(0)
    for i in range(n):
        c += np.int32(1) if x[i] >= t else np.int32(0)
    return c


@kernel
def count_greater(x, n, t):
    """How many of x[:n] are > t: the rank of a token with logit t, counted in one vectorised pass."""
    wide()
    c = np.int32(0)
    for i in range(n):
        c += np.int32(1) if x[i] > t else np.int32(0)
    return c


@kernel
def block_max_keys(x, n, out):
    """out[b] = order key of max(x[b*BLOCK : (b+1)*BLOCK]) for the ceil(n / BLOCK) blocks of x[:n]."""
    wide()
    nb = n // BLOCK
    xr = x[: nb * BLOCK].reshape((nb, BLOCK))  # 2-D indices from two range() loops: plain vector loads
    for b in range(nb):
        m = INT32_MIN
        for i in range(BLOCK):
            k = order_key(xr[b, i])
            m = k if k > m else m
        out[b] = m
    if nb * BLOCK < n:
        m = INT32_MIN
        for i in range(nb * BLOCK, n):
            k = order_key(x[i])
            m = k if k > m else m
        out[nb] = m


@kernel
def _count_keys(keys, m, t):
    wide()
    c = np.int32(0)
    for i in range(m):
        c += np.int32(1) if keys[i] >= t else np.int32(0)
    return c


@jit
def kth_largest_key(keys, m, k):
    """The k-th largest of keys[:m] (1 <= k <= m), by bisection over the int32 key range: ~32 counting
    passes over keys, which are few."""
    lo, hi = np.int64(INT32_MIN), np.int64(2147483647) + 1  # count(>= lo) >= k > count(>= hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _count_keys(keys, m, np.int32(mid)) >= k:
            lo = mid
        else:
            hi = mid
    return np.int32(lo)


@jit
def _gather_blocks(x, n, bk, t):
    """Indices of the entries of x[:n] that are >= t, in index order, reading only blocks whose maximum
    (bk, from block_max_keys) reaches t."""
    tk = order_key(np.float32(t))
    nb = bk.shape[0]
    hit = 0
    for b in range(nb):
        hit += 1 if bk[b] >= tk else 0
    idx = np.empty(hit * BLOCK, np.int64)
    j = 0
    for b in range(nb):
        if bk[b] >= tk:
            for i in range(b * BLOCK, min(b * BLOCK + BLOCK, n)):
                if x[i] >= t:
                    idx[j] = i
                    j += 1
    return idx[:j]


@jit
def _sorted(x, idx):
    """idx reordered by x, largest first, stable (lower index first among ties)."""
    return idx[np.argsort(-x[idx], kind="mergesort")]


@jit
def gather_sorted(x, n, t):
    """Indices of the entries of x[:n] that are >= t, largest value first (stable for ties)."""
    bk = np.empty((n + BLOCK - 1) // BLOCK, np.int32)
    block_max_keys(x, n, bk)
    return _sorted(x, _gather_blocks(x, n, bk, t))


@jit
def top_indices(x, n, k):
    """Indices of the k largest entries of x[:n], largest first (ties broken by lower index)."""
    if min(k, n) <= 0:
        return np.empty(0, np.int64)
    bk = np.empty((n + BLOCK - 1) // BLOCK, np.int32)
    block_max_keys(x, n, bk)
    return top_from_blocks(x, n, k, bk)


@jit
def top_from_blocks(x, n, k, bk):
    """top_indices given the block maxima bk of x[:n] (block_max_keys): the caller may have read the row's max
    off them already (the max of the block maxima)."""
    k = min(k, n)
    if k <= 0:
        return np.empty(0, np.int64)
    k_blocks = min(k, bk.shape[0])
    t = from_order_key(kth_largest_key(bk, bk.shape[0], k_blocks))  # >= k entries are >= t
    cand = _gather_blocks(x, n, bk, t)
    if cand.shape[0] < k or t == -np.inf:  # NaN rows, or fewer than k finite entries: sort everything
        return np.argsort(-x[:n], kind="mergesort")[:k]
    if cand.shape[0] > k:  # keep the entries at or above the k-th largest candidate (k, plus ties)
        keys = np.empty(cand.shape[0], np.int32)
        for j in range(cand.shape[0]):
            keys[j] = order_key(x[cand[j]])
        tk = from_order_key(kth_largest_key(keys, keys.shape[0], k))
        kept = 0
        for j in range(cand.shape[0]):
            if x[cand[j]] >= tk:
                cand[kept] = cand[j]
                kept += 1
        cand = cand[:kept]
    return _sorted(x, cand)[:k]
