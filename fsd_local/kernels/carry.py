"""A draft's row carried onto the target's vocabulary (drafting across tokenizers, llama/vocab_map.py): as logits,
the draft's logit on every token both vocabularies share and -inf on the target's own tokens, so that softmax of
the carried row is q', the draft's distribution on the shared tokens renormalised. Several draft tokens carried
to one target token (`extra`) add their probabilities there. The -inf entries are written once per buffer
(`prepare`); each row then writes only the shared ones."""

import math

import numpy as np

from fsd_local.kernels.fastmath import INT32_MIN, kernel, order_key, wide

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
    then for each (t, d) of extra, out[t] = log(exp(out[t]) + exp(row[d])). Every other entry of out is left as
    it is, -inf since `prepare`: the target's own tokens (a scatter of the shared entries costs a copy of the
    draft's row, where writing the whole target row would cost a gather over it)."""
    _scatter(row, shared_t, shared_d, out)
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
