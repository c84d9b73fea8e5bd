"""Processed sampling distributions: temperature, then top-k, top-p, min-p, each kept as (mx, cutoff, lz) over
the raw row x, p~_i = exp((x_i - mx) / T - lz) for x_i >= cutoff, else 0; no row is copied or sorted whole."""

import math

import numpy as np
from numba import njit

from fsd_local.kernels.dense import draw, summarise
from fsd_local.kernels.fastmath import from_order_key, kernel, radd, vexp, wide
from fsd_local.kernels.jit_cache import jit
from fsd_local.kernels.rows import copy_max_argmax, copy_row, max_argmax, row_max
from fsd_local.kernels.topk import BLOCK as TOPK_BLOCK
from fsd_local.kernels.topk import block_max_keys, count_at_least, gather_sorted, top_from_blocks, top_indices

BLOCK = 1024  # inverse-CDF sampling scans block sums (vectorised) before one scalar block


@kernel
def _kept_mass(x, n, mx, inv_t, cutoff):
    wide()
    mx, inv_t, cutoff = np.float32(mx), np.float32(inv_t), np.float32(cutoff)  # float32 all through
    s = np.float32(0.0)
    for i in range(n):
        w = vexp((x[i] - mx) * inv_t)
        s = radd(s, w if x[i] >= cutoff else np.float32(0.0))
    return s


@jit
def _cutoff(x, n, mx, inv_t, top_k, top_p):
    """Lowest logit kept by top-k then top-p (renormalised over the top-k set), exact. Only candidates near
    the top are sorted: top-k takes them from `top_indices`; top-p widens a cut below the max (counting
    mass, one vectorised pass each) until the cut holds top_p of the mass, so it contains the nucleus."""
    if top_k > 0:
        cand = top_indices(x, n, top_k)
        z_all = np.float32(0.0)  # top-p renormalises over the top-k set: its own mass, below
    else:
        z_all = _kept_mass(x, n, mx, inv_t, np.float32(-np.inf))
        delta = np.float32(1.0)  # in units of the tempered logits
        while delta < np.float32(1e30) and _kept_mass(x, n, mx, inv_t, mx - delta / inv_t) < top_p * z_all:
            delta *= np.float32(2.0)
        cand = gather_sorted(x, n, mx - delta / inv_t if delta < np.float32(1e30) else np.float32(-np.inf))
    if cand.shape[0] == 0:
        return np.float32(-np.inf)
    w = np.exp((x[cand].astype(np.float64) - mx) * inv_t)
    if top_p < 1.0:
        cum = np.cumsum(w)
        total = cum[-1] if top_k > 0 else float(z_all)
        for j in range(cand.shape[0]):
            if cum[j] >= top_p * total:
                return x[cand[j]]
    return x[cand[-1]]


@jit
def processed(x, n, temperature, top_k, top_p, min_p):
    """(mx, cutoff, lz) of the processed distribution of x[:n] at temperature > 0."""
    mx = row_max(x, n)
    inv_t = np.float32(1.0 / temperature)
    cutoff = np.float32(-np.inf)
    if top_k > 0 or top_p < 1.0:
        cutoff = _cutoff(x, n, mx, inv_t, top_k, top_p)
    if min_p > 0.0:  # p~_i >= min_p * p~_max  <=>  (x_i - mx)/T >= log(min_p)
        cutoff = max(cutoff, np.float32(mx + math.log(min_p) * temperature))
    z = _kept_mass(x, n, mx, inv_t, cutoff)
    return mx, cutoff, math.log(z) if z > 0 else np.nan


@jit
def prob(x, i, temperature, mx, cutoff, lz):
    """p~_i of a processed distribution."""
    if not (x[i] >= cutoff):
        return 0.0
    return math.exp((float(x[i]) - mx) / temperature - lz)


@kernel
def _block_mass(x, lo, hi, mx, inv_t, cutoff, lz):
    wide()
    mx, inv_t, cutoff, lz = np.float32(mx), np.float32(inv_t), np.float32(cutoff), np.float32(lz)
    xb = x[lo:hi]  # a slice: x[i] over range(lo, hi) would vectorise as gathers (rows.sum_exp)
    s = np.float32(0.0)
    for i in range(xb.shape[0]):
        w = vexp((xb[i] - mx) * inv_t - lz)
        s = radd(s, w if xb[i] >= cutoff else np.float32(0.0))
    return s


@jit
def sample(x, n, temperature, mx, cutoff, lz, u):
    """Inverse-CDF draw from the processed distribution with uniform u in [0, 1)."""
    inv_t = np.float32(1.0 / temperature)
    mxf, lzf = np.float32(mx), np.float32(lz)
    target = u * float(_block_mass(x, 0, n, mxf, inv_t, cutoff, lzf))  # the float32 total, not 1.0
    cum = 0.0
    last = -1
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        b = float(_block_mass(x, lo, hi, mxf, inv_t, cutoff, lzf))
        if cum + b <= target:
            cum += b
            if b > 0:
                last = hi - 1
            continue
        for i in range(lo, hi):
            if x[i] >= cutoff:
                cum += float(vexp((x[i] - mxf) * inv_t - lzf))
                last = i
                if cum > target:
                    return i
    # rounding left u past the last kept token: return the last token with mass
    while last >= 0 and not (x[last] >= cutoff):
        last -= 1
    return last if last >= 0 else argmax(x, n)


@kernel
def _residual_mass(x, y, lo, hi, inv_t, px, py):
    # px, py = (mx, cutoff, lz) of target / draft, float32
    wide()
    inv_t = np.float32(inv_t)
    xb, yb = x[lo:hi], y[lo:hi]  # slices: see _block_mass
    mxp, cp, lzp, mxq, cq, lzq = px[0], px[1], px[2], py[0], py[1], py[2]
    s = np.float32(0.0)
    for i in range(xb.shape[0]):
        p = vexp((xb[i] - mxp) * inv_t - lzp)
        q = vexp((yb[i] - mxq) * inv_t - lzq)
        p = p if xb[i] >= cp else np.float32(0.0)
        q = q if yb[i] >= cq else np.float32(0.0)
        s = radd(s, max(p - q, np.float32(0.0)))
    return s


@jit
def sample_residual(x, y, n, temperature, px, py, u):
    """Draw from norm(max(p~ - q~, 0)) (the SD replacement). px/py: float32 (mx, cutoff, lz) triples.
    Falls back to p~ when the residual has no mass (p~ == q~ up to rounding)."""
    inv_t = np.float32(1.0 / temperature)
    total = float(_residual_mass(x, y, 0, n, inv_t, px, py))
    if not total > 1e-12:
        return sample(x, n, temperature, px[0], px[1], px[2], u)
    target = u * total
    cum = 0.0
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        b = float(_residual_mass(x, y, lo, hi, inv_t, px, py))
        if cum + b <= target:
            cum += b
            continue
        for i in range(lo, hi):
            r = float(_residual_mass(x, y, i, i + 1, inv_t, px, py))
            cum += r
            if r > 0 and cum > target:
                return i
    return sample(x, n, temperature, px[0], px[1], px[2], u)


@jit
def argmax(x, n):
    best = 0
    bv = x[0]
    for i in range(1, n):
        if x[i] > bv:
            bv = x[i]
            best = i
    return best


@jit
def pick(x, n, temperature, top_k, top_p, min_p, u, out_stats, want_top=True):
    """One token from row x: argmax when temperature <= 0, else a draw from the processed distribution.
    Writes (mx, cutoff, lz) to out_stats and returns (token, p~(token), p~ of the most likely token).
    Greedy rows report softmax probabilities at temperature 1 (the draft's p_min test), if want_top."""
    if temperature <= 0.0:
        t = argmax(x, n)
        if not want_top:  # greedy needs no probabilities unless the draft's p_min test asks for them
            return t, 1.0, 1.0
        mx = x[t]
        z = _kept_mass(x, n, mx, np.float32(1.0), np.float32(-np.inf))
        out_stats[0], out_stats[1], out_stats[2] = mx, -np.inf, math.log(z)
        return t, 1.0, 1.0 / float(z)
    mx, cutoff, lz = processed(x, n, temperature, top_k, top_p, min_p)
    out_stats[0], out_stats[1], out_stats[2] = mx, cutoff, lz
    t = sample(x, n, temperature, mx, cutoff, lz, u)
    return t, prob(x, t, temperature, mx, cutoff, lz), math.exp(-lz)


# ---------------------------------------------------------------------------------------------- the kept set
# Truncation (top-k, top-p, min-p) leaves a processed distribution a few dozen tokens: everything the round
# needs of it (its normaliser, a draw, the SD replacement) is then computed over those tokens alone, found with
# one or two passes over the row, instead of exp passes over the whole vocabulary. `kept` is a caller's buffer
# of up to KEPT_MAX indices; a row whose kept set is larger, or untruncated, falls back to the dense functions
# above (the same distribution, the same draws up to float rounding: both walk the tokens in index order).
KEPT_MAX = 4096


@jit
def _kept_indices(x, n, cutoff, top, kept):
    """Fill kept with the indices i of x[:n] with x[i] >= cutoff, in index order, and return how many; -1 when
    there are more than kept holds. `top`: candidates known to contain them all (top-k's), or empty."""
    m = 0
    # top holds every entry above its last one; entries tied with that one may lie outside it: count them
    if top.shape[0] > 0 and (cutoff > x[top[top.shape[0] - 1]] or count_at_least(x, n, cutoff) <= top.shape[0]):
        for j in range(top.shape[0]):
            if x[top[j]] >= cutoff:
                kept[m] = top[j]
                m += 1
        kept[:m].sort()
        return m
    if count_at_least(x, n, cutoff) > kept.shape[0]:
        return -1
    for i in gather_sorted(x, n, cutoff):
        kept[m] = i
        m += 1
    kept[:m].sort()
    return m


@jit
def processed_kept(x, n, temperature, top_k, top_p, min_p, kept):
    """(mx, cutoff, lz, m) of the processed distribution of x[:n] (as `processed`), with its kept tokens in
    kept[:m] (index order); m = -1 when the distribution is not truncated to at most KEPT_MAX tokens (then lz
    was computed over the whole row)."""
    inv_t = np.float32(1.0 / temperature)
    cutoff = np.float32(-np.inf)
    top = np.empty(0, np.int64)
    if 0 < top_k <= kept.shape[0]:  # one pass: the blocks' maxima give the row's max and the top-k's candidates
        bk = np.empty((n + TOPK_BLOCK - 1) // TOPK_BLOCK, np.int32)
        block_max_keys(x, n, bk)
        mx = from_order_key(np.max(bk))
        top = top_from_blocks(x, n, top_k, bk)
        cutoff = x[top[top.shape[0] - 1]] if top.shape[0] > 0 else cutoff
        if top_p < 1.0:
            w = np.exp((x[top].astype(np.float64) - mx) * inv_t)
            cum = np.cumsum(w)
            for j in range(top.shape[0]):
                if cum[j] >= top_p * cum[-1]:
                    cutoff = x[top[j]]
                    break
    else:
        mx = row_max(x, n)
        if top_k > 0 or top_p < 1.0:
            cutoff = _cutoff(x, n, mx, inv_t, top_k, top_p)
    if min_p > 0.0:
        cutoff = max(cutoff, np.float32(mx + math.log(min_p) * temperature))
    m = _kept_indices(x, n, cutoff, top, kept) if cutoff > -np.inf else -1
    if m < 0:
        z = _kept_mass(x, n, mx, inv_t, cutoff)
        return mx, cutoff, math.log(z) if z > 0 else np.nan, -1
    z = 0.0
    for j in range(m):
        z += math.exp((float(x[kept[j]]) - mx) * inv_t)
    return mx, cutoff, math.log(z) if z > 0 else np.nan, m


@jit
def sample_kept(x, n, temperature, mx, cutoff, lz, kept, m, u):
    """Inverse-CDF draw with uniform u from a processed distribution whose kept tokens are kept[:m]
    (`processed_kept`; m < 0: the whole row, `sample`)."""
    if m < 0:
        return sample(x, n, temperature, mx, cutoff, lz, u)
    inv_t = 1.0 / temperature
    total = 0.0
    for j in range(m):
        total += math.exp((float(x[kept[j]]) - mx) * inv_t - lz)
    target, cum = u * total, 0.0
    for j in range(m):
        cum += math.exp((float(x[kept[j]]) - mx) * inv_t - lz)
        if cum > target:
            return kept[j]
    return kept[m - 1] if m > 0 else argmax(x, n)


@njit(inline="always")
def q_at(y, t, q_kept, q_logits, m_q, j):
    """The draft's logit of token t and the cursor for the next lookup: from its row y, or where its row was not
    kept (m_q >= 0) from its kept tokens q_kept[:m_q] and their logits (-inf elsewhere: q~ is 0 there); callers
    look tokens up in increasing order, so the cursor j only moves forward."""
    if m_q < 0:
        return y[t], j
    while j < m_q and q_kept[j] < t:
        j += 1
    if j < m_q and q_kept[j] == t:
        return q_logits[j], j
    return np.float32(-np.inf), j


@njit(inline="always")
def _residual_at(xv, yv, inv_t, px, py, onehot, is_d):
    """max(p~_t - q~_t, 0), float64, from the two logits of t; q~ is one-hot on d for prompt lookup."""
    p = math.exp((float(xv) - px[0]) * inv_t - px[2]) if xv >= px[1] else 0.0
    if onehot:
        q = 1.0 if is_d else 0.0
    else:
        q = math.exp((float(yv) - py[0]) * inv_t - py[2]) if yv >= py[1] else 0.0
    return max(p - q, 0.0)


@jit
def residual_kept(x, y, n, temperature, px, py, kept, m, u, onehot, d, q_kept, q_logits, m_q):
    """Draw from norm(max(p~ - q~, 0)) (the SD replacement) over p~'s kept tokens kept[:m] (m < 0: every token),
    q~ read through `q_at` or, with `onehot`, the drafted token d alone. Falls back to p~ when the residual has
    no mass."""
    if m < 0:
        if onehot:  # p~ without d: the inverse CDF of p~ at a point that skips d's interval
            p_d = prob(x, d, temperature, px[0], px[1], px[2])
            v = u * (1.0 - p_d)
            before = float(_block_mass(x, 0, d, px[0], np.float32(1.0 / temperature), px[1], px[2]))
            return sample(x, n, temperature, px[0], px[1], px[2], min(v if v < before else v + p_d, 1.0 - 1e-12))
        if m_q < 0:
            return sample_residual(x, y, n, temperature, px, py, u)
    inv_t = 1.0 / temperature
    pf = (float(px[0]), float(px[1]), float(px[2]))
    qf = (float(py[0]), float(py[1]), float(py[2]))
    size = m if m >= 0 else n
    total, j = 0.0, 0
    for i in range(size):
        t = kept[i] if m >= 0 else i
        yv, j = q_at(y, t, q_kept, q_logits, m_q, j)
        total += _residual_at(x[t], yv, inv_t, pf, qf, onehot, t == d)
    if not total > 1e-12:
        return sample_kept(x, n, temperature, px[0], px[1], px[2], kept, m, u)
    target, cum, last, j = u * total, 0.0, -1, 0
    for i in range(size):
        t = kept[i] if m >= 0 else i
        yv, j = q_at(y, t, q_kept, q_logits, m_q, j)
        r = _residual_at(x[t], yv, inv_t, pf, qf, onehot, t == d)
        if r > 0.0:
            cum += r
            last = t
            if cum > target:
                return t
    return last


@jit
def pick_kept(x, n, temperature, top_k, top_p, min_p, u, out_stats, kept, want_top, summary):
    """`pick` with the fast paths (greedy: an argmax at memory speed, on one core; untruncated: a draw from the block
    summary): writes (mx, cutoff, lz) to out_stats and the kept tokens to kept; returns (token, p~(token), p~ of the
    most likely token, how many tokens are kept: -1 when not truncated, or greedy)."""
    if temperature <= 0.0:  # one core: right after a decode a parallel region's start costs more than the second
        mx, t = max_argmax(x, n)  # core saves on a read at memory speed (docs/measurements/sampled-rounds.md)
        return _greedy_pick(x, n, mx, t, want_top, out_stats)
    if untruncated(top_k, top_p, min_p):
        t, p_t, p_top, ok = _pick_dense(x, n, temperature, u, out_stats, summary, x, False)
        if ok:
            return t, p_t, p_top, -1
    mx, cutoff, lz, m = processed_kept(x, n, temperature, top_k, top_p, min_p, kept)
    out_stats[0], out_stats[1], out_stats[2] = mx, cutoff, lz
    t = sample_kept(x, n, temperature, mx, cutoff, lz, kept, m, u)
    return t, prob(x, t, temperature, mx, cutoff, lz), math.exp(-lz), m


@njit(inline="always")
def untruncated(top_k, top_p, min_p):
    """Whether a sampled distribution keeps every token (a temperature alone): kernels/dense.py's rows."""
    return top_k <= 0 and top_p >= 1.0 and min_p <= 0.0


@jit
def _pick_dense(x, n, temperature, u, out_stats, summary, y, copy):
    """A draw from x's untruncated p~ through its block summary (copying x into y in the same pass where `copy`):
    (token, p~(token), p~ of the most likely token, whether the summary held: else nothing was drawn)."""
    mx, lz, _, ok = summarise(x, n, 1.0 / temperature, False, summary, y, copy)
    if not ok:
        return -1, 0.0, 0.0, False
    out_stats[0], out_stats[1], out_stats[2] = mx, -np.inf, lz
    t = draw(y if copy else x, n, 1.0 / temperature, mx, summary, u)
    return t, prob(x, t, temperature, mx, -np.inf, lz), math.exp(-lz), True


@jit
def pick_kept_copy(x, n, temperature, top_k, top_p, min_p, u, out_stats, kept, want_top, y, summary):
    """pick_kept of row x, leaving a copy of x[:n] in y[:n] (a draft's row the acceptance kernel reads after the
    draft's next decode): greedy and untruncated, the one read of the row copies it; otherwise it is copied first."""
    if temperature <= 0.0:
        mx, t = copy_max_argmax(x, n, y)
        return _greedy_pick(y, n, mx, t, want_top, out_stats)
    if untruncated(top_k, top_p, min_p):
        t, p_t, p_top, ok = _pick_dense(x, n, temperature, u, out_stats, summary, y, True)
        if ok:
            return t, p_t, p_top, -1
    copy_row(x, n, y)
    return pick_kept(y, n, temperature, top_k, top_p, min_p, u, out_stats, kept, want_top, summary)


@jit
def _greedy_pick(x, n, mx, t, want_top, out_stats):
    if not want_top:
        return t, 1.0, 1.0, -1
    z = _kept_mass(x, n, mx, np.float32(1.0), np.float32(-np.inf))
    out_stats[0], out_stats[1], out_stats[2] = mx, -np.inf, math.log(z)
    return t, 1.0, 1.0 / float(z), -1
