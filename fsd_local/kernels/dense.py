"""Untruncated sampled rows (a temperature alone): a row's block summary built in one read on every core, draws
from it, and the round's residual draw and rescue loss in one pass over both rows
(docs/design.md, "Where the time goes")."""

import math

import numpy as np
from numba import njit, prange

from fsd_local.kernels.fastmath import INT32_MIN, from_order_key, kernel, order_key, radd, vexp, wide
from fsd_local.kernels.jit_cache import jit
from fsd_local.kernels.names import FSD_PAPER

SUMMARY_BLOCKS = 512  # the most blocks a summary holds: 1,024-entry blocks up to a 524,288-token vocabulary
SUB = 64  # a draw's second level: the entries of its block in runs of SUB
PARTS = 8  # a row (or a batch's rows) split into this many parts for the cores (numba prange)
PARALLEL_MIN = 65536  # shorter rows are summarised on one core: a thread's start costs more than it saves
MAX, MASS, RAW = 0, 1, 2  # a summary's rows: block max, mass at temperature T (relative to M after combine), raw
NEG_INF = np.float32(-np.inf)
FLOAT32_LOWEST = np.float32(np.finfo(np.float32).min)


def new_summaries(rows: int) -> np.ndarray:
    """Buffers for the summaries of `rows` rows (float32, rows x 3 x SUMMARY_BLOCKS): any vocabulary fits."""
    return np.zeros((rows, 3, SUMMARY_BLOCKS), np.float32)


@jit
def block_size(n):
    """Entries per block of an n-entry row: 1,024, doubled until SUMMARY_BLOCKS blocks cover the row."""
    b = 1024
    while b * SUMMARY_BLOCKS < n:
        b *= 2
    return b


@kernel
def _block(x, lo, hi, inv_t, raw):
    """(max, sum exp((x - max) / T), sum exp(x - max) where raw) of x[lo:hi], float32. The sums are NaN where the
    block holds a NaN or +inf (the caller falls back), 0 for a block of -inf (masked tokens add nothing)."""
    wide()
    xb = x[lo:hi]  # a slice: x[i] over range(lo, hi) would vectorise as gathers (rows.sum_exp)
    m = INT32_MIN
    bad = np.int32(0)
    for i in range(xb.shape[0]):
        v = xb[i]
        k = order_key(v)
        m = k if k > m else m
        bad += np.int32(0) if v == v else np.int32(1)  # a negative NaN sorts below -inf: counted on its own
    mb = from_order_key(m)
    if bad > 0 or not mb < np.inf:
        return mb, np.float32(np.nan), np.float32(np.nan)
    s = np.float32(0.0)
    s1 = np.float32(0.0)
    if mb == -np.inf:
        return mb, s, s1
    for i in range(xb.shape[0]):
        s = radd(s, vexp((xb[i] - mb) * inv_t))
    if raw:
        for i in range(xb.shape[0]):
            s1 = radd(s1, vexp(xb[i] - mb))
    return mb, s, s1


@kernel
def _copy(x, y, lo, hi):
    wide()
    xb, yb = x[lo:hi], y[lo:hi]
    for i in range(xb.shape[0]):
        yb[i] = xb[i]


@jit
def _summarise_range(x, n, inv_t, raw, summary, y, copy, part, parts):
    """The blocks of part `part` of `parts`: copied into y first where `copy` (then summed from the copy, in L1)."""
    size = block_size(n)
    nb = (n + size - 1) // size
    for b in range(part * nb // parts, (part + 1) * nb // parts):
        lo, hi = b * size, min(b * size + size, n)
        src = x
        if copy:
            _copy(x, y, lo, hi)
            src = y
        summary[MAX, b], summary[MASS, b], summary[RAW, b] = _block(src, lo, hi, np.float32(inv_t), raw)


@jit(parallel=True)
def _summarise_parts(x, n, inv_t, raw, summary, y, copy):
    for p in prange(PARTS):
        _summarise_range(x, n, inv_t, raw, summary, y, copy, p, PARTS)


@jit
def summarise(x, n, inv_t, raw, summary, y, copy):
    """Summarise row x[:n] into summary (3 x SUMMARY_BLOCKS), leaving a copy of it in y[:n] where `copy`; long rows
    on every core. Returns combine's (M, lz, raw log-partition, ok)."""
    if n >= PARALLEL_MIN:
        _summarise_parts(x, n, inv_t, raw, summary, y, copy)
    else:
        _summarise_range(x, n, inv_t, raw, summary, y, copy, 0, 1)
    return combine(summary, n, inv_t, raw)


@jit(parallel=True)
def _summarise_rows(P, rows, n, inv_t, raw, summaries):
    for j in prange(rows * PARTS):
        r = j // PARTS
        _summarise_range(P[r], n, inv_t, raw, summaries[r], P[r], False, j - r * PARTS, PARTS)


@jit
def summarise_rows(P, rows, n, inv_t, raw, summaries, stats, lse):
    """Summarise rows P[:rows] together on every core (a verify batch: a rejection early in the round wastes a
    little, as greedy's argmax of every row does); stats[r] = (M, -inf, lz), lse[r] = the raw log-partition
    where raw. Returns whether every row's summary holds (else the caller takes the plain path for all)."""
    if rows * n >= PARALLEL_MIN:
        _summarise_rows(P, rows, n, inv_t, raw, summaries)
    else:
        for r in range(rows):
            _summarise_range(P[r], n, inv_t, raw, summaries[r], P[r], False, 0, 1)
    ok = True
    for r in range(rows):
        mx, lz, l1, good = combine(summaries[r], n, inv_t, raw)
        stats[r, 0], stats[r, 1], stats[r, 2] = mx, -np.inf, lz
        if raw:
            lse[r] = l1
        ok = ok and good
    return ok


@jit
def summarise_round(P, rows, n, temperature, out):
    """The block summaries of a round's target rows P[:rows] into its RoundOut (kernels/accept.py), on every core:
    what an untruncated round reads of its rows, with their raw log-partitions where log-probabilities are asked
    (at temperature 1 the summary's own). A row with a NaN (or no finite max) leaves the round to the plain path."""
    raw = temperature != 1.0 and (out.logprob.shape[0] > 0 or out.top_ids.shape[1] > 0)
    ok = summarise_rows(P, rows, n, 1.0 / temperature, raw, out.summaries, out.rstats, out.lse)
    for r in range(rows):
        out.dense[r] = ok
        if ok and temperature == 1.0:
            out.lse[r] = float(out.rstats[r, 0]) + float(out.rstats[r, 2])


@njit(inline="always")
def dense_draft(draft, i):
    """Whether draft row i is one the dense kernels read: one-hot (prompt lookup), or untruncated with finite stats."""
    st = draft.stats[i]
    return draft.onehot[i] or (st[1] == -np.inf and st[0] > -np.inf and st[0] < np.inf and st[2] == st[2])


@jit
def combine(summary, n, inv_t, raw):
    """(M, lz, raw log-partition (NaN unless raw), ok) from a row's block summary, once: the blocks' masses are
    left relative to M in summary[MASS] (float32, what `draw` walks). ok is False for a row with a NaN or +inf, or
    with every entry -inf: the caller takes sampling.py's plain path for it."""
    nb = (n + block_size(n) - 1) // block_size(n)
    mx = np.float32(-np.inf)
    ok = True
    for b in range(nb):
        v = summary[MAX, b]
        mx = v if v > mx else mx
        ok = ok and summary[MASS, b] == summary[MASS, b]
    if not (ok and mx > -np.inf):
        return mx, np.nan, np.nan, False
    z, z1 = 0.0, 0.0
    for b in range(nb):
        s = summary[MASS, b]
        if s > 0.0:
            d = float(summary[MAX, b]) - float(mx)
            w = np.float32(s * math.exp(d * inv_t))
            summary[MASS, b] = w
            z += float(w)
            if raw:
                z1 += float(summary[RAW, b]) * math.exp(d)
    return mx, math.log(z), (float(mx) + math.log(z1)) if raw else np.nan, True


@kernel
def _mass(x, lo, hi, mx, inv_t):
    """sum of exp((x - mx) / T) over x[lo:hi], float32."""
    wide()
    mx, inv_t = np.float32(mx), np.float32(inv_t)  # float32 all through
    xb = x[lo:hi]
    s = np.float32(0.0)
    for i in range(xb.shape[0]):
        s = radd(s, vexp((xb[i] - mx) * inv_t))
    return s


@jit
def draw(x, n, inv_t, mx, summary, u):
    """Inverse-CDF draw with uniform u from the untruncated p~ of row x, combined summary `summary`: the block by
    the blocks' masses, the run of SUB entries by their sums, the entry; what rounding leaves past a block's last
    entry falls on the block's last token with mass."""
    size = block_size(n)
    nb = (n + size - 1) // size
    total = 0.0
    for b in range(nb):
        total += float(summary[MASS, b])
    return _draw_at(x, n, np.float32(inv_t), mx, summary, u * total, -1)


@jit
def _draw_at(x, n, inv_t, mx, summary, target, skip):
    """The token where the cumulative p~ (unnormalised, relative to mx) passes `target`; token `skip` (>= 0) has
    no mass (a one-hot draft's residual)."""
    mx = np.float32(mx)
    size = block_size(n)
    nb = (n + size - 1) // size
    gone = float(vexp((x[skip] - mx) * inv_t)) if skip >= 0 else 0.0
    cum, b = 0.0, 0
    while b < nb - 1:
        w = float(summary[MASS, b]) - (gone if skip // size == b else 0.0)
        if cum + w > target:
            break
        cum += w
        b += 1
    lo, hi = b * size, min(b * size + size, n)
    last = -1
    for s in range(lo, hi, SUB):
        e = min(s + SUB, hi)
        w = float(_mass(x, s, e, mx, inv_t)) - (gone if s <= skip < e else 0.0)
        if cum + w <= target and e < hi:
            cum += w
            continue
        for i in range(s, e):
            v = float(vexp((x[i] - mx) * inv_t)) if i != skip else 0.0
            if v > 0.0:
                cum += v
                last = i
                if cum > target:
                    return i
    if last < 0:  # rounding carried the draw past the block's mass: the row's last token with mass
        for i in range(n - 1, -1, -1):
            if i != skip and x[i] > -np.inf:
                return i
    return last


@jit
def draw_without(x, n, inv_t, mx, summary, u, d):
    """A draw from p~ without token d, renormalised (a one-hot draft's SD residual: max(p~ - 1[d], 0))."""
    size = block_size(n)
    nb = (n + size - 1) // size
    total = 0.0
    for b in range(nb):
        total += float(summary[MASS, b])
    rest = total - float(vexp((x[d] - np.float32(mx)) * np.float32(inv_t)))
    if not rest > 1e-12 * total:
        return draw(x, n, inv_t, mx, summary, u)
    return _draw_at(x, n, np.float32(inv_t), mx, summary, u * rest, d)


# ---------------------------------------------------------------------------------------------- two rows
@kernel
def _residual(x, y, lo, hi, inv_t, mxp, lzp, mxq, lzq):
    """sum of max(p~ - q~, 0) over [lo, hi), float32."""
    wide()
    xb, yb = x[lo:hi], y[lo:hi]
    s = np.float32(0.0)
    for i in range(xb.shape[0]):
        p = vexp((xb[i] - mxp) * inv_t - lzp)
        q = vexp((yb[i] - mxq) * inv_t - lzq)
        s = radd(s, max(p - q, np.float32(0.0)))
    return s


@jit(parallel=True)
def _residual_parts(x, y, n, inv_t, px, py, masses):
    size = block_size(n)
    nb = (n + size - 1) // size
    for p in prange(PARTS):
        for b in range(p * nb // PARTS, (p + 1) * nb // PARTS):
            masses[b] = _residual(x, y, b * size, min(b * size + size, n), inv_t, px[0], px[2], py[0], py[2])


@jit
def residual_draw(x, y, n, temperature, px, py, u, masses):
    """Draw from norm(max(p~ - q~, 0)) (the SD replacement) over two untruncated rows, px / py their float32
    (M, cutoff, lz), in one pass on every core; masses: a scratch of SUMMARY_BLOCKS floats. -1 where the
    residual has no mass: the caller draws from p~."""
    inv_t = np.float32(1.0 / temperature)
    size = block_size(n)
    nb = (n + size - 1) // size
    if n >= PARALLEL_MIN:
        _residual_parts(x, y, n, inv_t, px, py, masses)
    else:
        for b in range(nb):
            masses[b] = _residual(x, y, b * size, min(b * size + size, n), inv_t, px[0], px[2], py[0], py[2])
    total = 0.0
    for b in range(nb):
        total += float(masses[b])
    if not total > 1e-12:
        return -1
    target, cum, b = u * total, 0.0, 0
    while b < nb - 1 and cum + float(masses[b]) <= target:
        cum += float(masses[b])
        b += 1
    lo, hi = b * size, min(b * size + size, n)
    last = -1
    for s in range(lo, hi, SUB):
        e = min(s + SUB, hi)
        w = float(_residual(x, y, s, e, inv_t, px[0], px[2], py[0], py[2]))
        if cum + w <= target and e < hi:
            cum += w
            continue
        for i in range(s, e):
            r = float(_residual(x, y, i, i + 1, inv_t, px[0], px[2], py[0], py[2]))
            if r > 0.0:
                cum += r
                last = i
                if cum > target:
                    return i
    return last


@kernel
def _loss_terms(x, y, lo, hi, inv_t, mxp, lzp, mxq, lzq, hx, lox, floor):
    """The sums dense_loss combines over [lo, hi), float32: (rescued, rejected, residual, S1, S2, masked) for
    p~, q~ the processed probabilities, a = log p (raw) and R the tokens the rule rescues (x > -inf, x >= floor)."""
    wide()
    xb, yb = x[lo:hi], y[lo:hi]
    zero = np.float32(0.0)
    rescued, rejected, residual, s1, s2, masked = zero, zero, zero, zero, zero, zero
    for i in range(xb.shape[0]):
        xv = xb[i]
        p = vexp((xv - mxp) * inv_t - lzp)
        q = vexp((yb[i] - mxq) * inv_t - lzq)
        a = (xv - hx) - lox
        d = p - q
        r = xv >= floor  # floor is finite: x > -inf too
        over = max(-d, zero)
        rescued = radd(rescued, over if r else zero)
        rejected = radd(rejected, over if xv < floor else zero)  # (not `zero if r`: LLVM then stays scalar)
        residual = radd(residual, max(d, zero))
        s1 = radd(s1, d * a if d > zero else zero)  # d > 0: p~ > 0, so x is finite
        s2 = radd(s2, -over * a if r else zero)  # over == 0: 0, a finite
        masked = radd(masked, zero if xv > NEG_INF else q)
    return rescued, rejected, residual, s1, s2, masked


@jit
def _loss_range(x, y, n, inv_t, mxp, lzp, mxq, lzq, hx, lox, floor, part, parts, sums):
    """_loss_terms over part `part` of `parts`, block by block (float32 within a block, float64 across)."""
    size = block_size(n)
    nb = (n + size - 1) // size
    for j in range(6):
        sums[part, j] = 0.0
    for b in range(part * nb // parts, (part + 1) * nb // parts):
        lo, hi = b * size, min(b * size + size, n)
        t = _loss_terms(x, y, lo, hi, inv_t, mxp, lzp, mxq, lzq, hx, lox, floor)
        for j in range(6):
            sums[part, j] += float(t[j])


@jit(parallel=True)
def _loss_parts(x, y, n, inv_t, mxp, lzp, mxq, lzq, hx, lox, floor, sums):
    for p in prange(PARTS):
        _loss_range(x, y, n, inv_t, mxp, lzp, mxq, lzq, hx, lox, floor, p, PARTS, sums)


@jit
def _one_hot_terms(p, q, a, floor_ok):
    """_loss_terms of one entry, float64 (a one-hot draft's token, added by hand)."""
    dd = p - q
    over = max(-dd, 0.0)
    return (
        over if floor_ok else 0.0,
        0.0 if floor_ok else over,
        max(dd, 0.0),
        dd * a if dd > 0.0 else 0.0,
        -over * a if floor_ok and over > 0.0 else 0.0,
        0.0,
    )


@jit
def dense_loss(mode, x, lx, y, n, temperature, px, py, floor, sums, onehot, d):
    """budget.sampled_loss over two untruncated rows in one pass on every core: (loss, P(rescue)), with
    loss = (1 - rejected / residual) S1 + S2 (_loss_terms); floor: budget.rescue_floor; with `onehot` q~ is token
    d alone; sums: a (PARTS, 6) float64 scratch."""
    inv_t = np.float32(1.0 / temperature)
    hx = np.float32(lx)
    lox = np.float32(lx - float(hx))
    f = max(np.float32(floor), FLOAT32_LOWEST)  # finite: the kernel's one compare also says x > -inf
    # a one-hot q~ is summed as 0 everywhere (lz +inf) and its token put right below
    mxq, lzq = (np.float32(0.0), np.float32(np.inf)) if onehot else (py[0], py[2])
    rows = x if onehot else y
    parts = PARTS if n >= PARALLEL_MIN else 1
    if parts > 1:
        _loss_parts(x, rows, n, inv_t, px[0], px[2], mxq, lzq, hx, lox, f, sums)
    else:
        _loss_range(x, rows, n, inv_t, px[0], px[2], mxq, lzq, hx, lox, f, 0, 1, sums)
    if onehot and x[d] == x[d]:
        p_d = math.exp((float(x[d]) - float(px[0])) * inv_t - float(px[2])) if x[d] > -np.inf else 0.0
        a, ok = float(x[d]) - lx, x[d] >= f
        was, now = _one_hot_terms(p_d, 0.0, a, ok), _one_hot_terms(p_d, 1.0, a, ok)
        for j in range(5):
            sums[0, j] += now[j] - was[j]
        sums[0, 5] += 0.0 if x[d] > -np.inf else 1.0
    rescued, rejected, residual, s1, s2, masked = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    for p in range(parts):
        rescued += sums[p, 0]
        rejected += sums[p, 1]
        residual += sums[p, 2]
        s1 += sums[p, 3]
        s2 += sums[p, 4]
        masked += sums[p, 5]
    if mode == FSD_PAPER:  # no SD test: every token of the slot is the draft's; masked ones cost +inf
        if masked > 0.0:
            return np.inf, 1.0
        return max(s1 + s2, 0.0), 1.0
    if not rescued > 0.0:
        return 0.0, 0.0
    rho = rejected / residual if residual > 0.0 else 0.0
    return max((1.0 - rho) * s1 + s2, 0.0), rescued
