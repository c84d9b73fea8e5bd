"""A draft's row carried onto the target's vocabulary (drafting across tokenizers, llama/vocab_map.py): as logits,
the draft's logit on every token both vocabularies share and -inf on the target's own tokens, so that softmax of
the carried row is q', the draft's distribution on the shared tokens renormalised. Several draft tokens carried
to one target token (`extra`) add their probabilities there."""

import math

import numpy as np

from fsd_local.kernels.fastmath import INT32_MIN, kernel, order_key, wide

NEG_INF = np.float32(-np.inf)


@kernel
def _gather(row, draft_of, out):
    wide()
    for t in range(out.shape[0]):
        d = draft_of[t]
        v = row[max(d, np.int32(0))]
        out[t] = v if d >= np.int32(0) else NEG_INF


@kernel
def _add_logs(a, b):
    """log(exp(a) + exp(b)) in float32; -inf when both are, NaN when either is."""
    hi, lo = (a, b) if a >= b else (b, a)
    if hi == NEG_INF or not (lo == lo):
        return hi if lo == lo else lo
    return np.float32(hi + math.log1p(math.exp(lo - hi)))


@kernel
def carry_row(row, draft_of, extra, out):
    """out[:len(draft_of)] = the draft row `row` carried onto the target's vocabulary: out[t] = row[draft_of[t]]
    where draft_of[t] >= 0, else -inf; then for each (t, d) of extra, out[t] = log(exp(out[t]) + exp(row[d]))."""
    _gather(row, draft_of, out)
    for j in range(extra.shape[0]):
        t, d = extra[j, 0], extra[j, 1]
        out[t] = _add_logs(out[t], row[d])


@kernel
def _primary_max(row, primary):
    """(order key, draft id) of the largest row[d] over the draft tokens d with primary[d] >= 0 (the first
    such d on ties); (INT32_MIN, -1) when there is none."""
    wide()
    best, at = INT32_MIN, -1
    for d in range(row.shape[0]):
        k = order_key(row[d]) if primary[d] >= np.int32(0) else INT32_MIN
        if k > best:
            best, at = k, d
    return best, at


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
