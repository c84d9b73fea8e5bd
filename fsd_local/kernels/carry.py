"""A draft's row carried onto the target's vocabulary as logits (drafting across tokenizers, llama/vocab_map.py):
the draft's logit on every shared token, several carried to one adding up (`extra`), -inf on the target's own
tokens, written once per buffer (`prepare`)."""

import math

import numpy as np

from fsd_local.kernels.fastmath import INT32_MIN, kernel, order_key, wide
from fsd_local.kernels.rows import ARGMAX_BLOCK, max_argmax

NEG_INF = np.float32(-np.inf)


@kernel
def prepare(out):
    """A new buffer for carried rows: -inf everywhere, which carry_row then only ever writes on shared tokens."""
    wide()
    for i in range(out.shape[0]):
        out[i] = NEG_INF


@kernel
def _scatter(row, shared_t, shared_d, out):
    wide()
    for j in range(shared_t.shape[0]):
        out[shared_t[j]] = row[shared_d[j]]


@kernel
def _add_logs(a, b):
    """log(exp(a) + exp(b)) in float32; -inf when both are, NaN when either is."""
    hi, lo = (a, b) if a >= b else (b, a)
    if hi == NEG_INF or not (lo == lo):
        return hi if lo == lo else lo
    return np.float32(hi + math.log1p(math.exp(lo - hi)))


@kernel
def carry_row(row, shared_t, shared_d, extra, out):
    """The draft row `row` carried onto the target's vocabulary in `out`: out[shared_t[j]] = row[shared_d[j]],
    then out[t] = log(exp(out[t]) + exp(row[d])) for each (t, d) of extra; every other entry is left as it is."""
    _scatter(row, shared_t, shared_d, out)
    for j in range(extra.shape[0]):
        t, d = extra[j, 0], extra[j, 1]
        out[t] = _add_logs(out[t], row[d])


@kernel
def _primary_block_max(row, primary, lo, hi):
    """The largest order key of row[d] over d in [lo, hi) with primary[d] >= 0 (INT32_MIN: none): one vectorised
    pass, a select in place of a branch."""
    wide()
    rb, pb = row[lo:hi], primary[lo:hi]  # slices: see rows.sum_exp
    m = INT32_MIN
    for i in range(rb.shape[0]):
        k = order_key(rb[i]) if pb[i] >= np.int32(0) else INT32_MIN
        m = k if k > m else m
    return m


@kernel
def _primary_max(row, primary):
    """(order key, draft id) of the largest row[d] over d with primary[d] >= 0 (the first on ties; (INT32_MIN, -1):
    none): the row's own argmax where the map carries it, else each ARGMAX_BLOCK block's carried maximum, then one
    block scanned (rows.max_argmax's way: an argmax loop does not vectorise)."""
    n = row.shape[0]
    mx, d = max_argmax(row, n)
    if mx == mx and primary[d] >= np.int32(0):
        return order_key(mx), d
    best, where = INT32_MIN, 0
    for lo in range(0, n, ARGMAX_BLOCK):
        m = _primary_block_max(row, primary, lo, min(lo + ARGMAX_BLOCK, n))
        if m > best:
            best, where = m, lo
    if best > INT32_MIN:
        for d in range(where, min(where + ARGMAX_BLOCK, n)):
            if primary[d] >= np.int32(0) and order_key(row[d]) == best:
                return best, d
    return INT32_MIN, -1


@kernel
def carried_argmax(row, primary, draft_of, extra):
    """argmax of carry_row's output without writing it (greedy drafting with no row kept): the target token,
    -1 when no shared token is finite. `primary[d]`: the target token d is carried to when d is draft_of's
    choice for it, else -1. Ties go to the target token whose draft token comes first."""
    best, at = _primary_max(row, primary)
    tok = primary[at] if at >= 0 else np.int32(-1)
    best_d = at
    j = 0
    while j < extra.shape[0]:  # a target token several draft tokens are carried to: their probabilities add
        t = extra[j, 0]
        v = row[draft_of[t]]
        first = draft_of[t]
        while j < extra.shape[0] and extra[j, 0] == t:
            v = _add_logs(v, row[extra[j, 1]])
            first = min(first, extra[j, 1])
            j += 1
        k = order_key(v)
        if v == v and (k > best or (k == best and first < best_d)):
            best, best_d, tok = k, first, t
    return tok if best > order_key(NEG_INF) else np.int32(-1)
