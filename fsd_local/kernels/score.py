"""Teacher-forced scoring of a drafter (drafting/proposer.py `catch_up`), jitted: would the round's rule have
accepted the draft's own pick at a slot of text it did not draft?"""

import numpy as np

from fsd_local.kernels.dense import summarise
from fsd_local.kernels.jit_cache import jit
from fsd_local.kernels.names import FSD_PAPER, SD
from fsd_local.kernels.rows import row_lse_wide
from fsd_local.kernels.rules import rescue
from fsd_local.kernels.sampling import argmax, pick_kept, prob, processed, untruncated


@jit
def _p_of(x, t, n, sampling, summary):
    """p~(t) of row x: from its summary where nothing is truncated (one pass, kernels/dense.py), else the plain
    processed triple."""
    temperature = sampling.temperature
    if untruncated(sampling.top_k, sampling.top_p, sampling.min_p):
        mx, lz, _, ok = summarise(x, n, 1.0 / temperature, False, summary, x, False)
        if ok:
            return prob(x, t, temperature, mx, -np.inf, lz)
    mx, cut, lz = processed(x, n, temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    return prob(x, t, temperature, mx, cut, lz)


@jit
def score_slots(P, p_idx, Q, q_idx, n, rule, sampling, tau, us, q_stats, kept, summary, out):
    """Teacher-forced scoring of a drafter on text it did not draft (proposer.py `catch_up`): out[i] = 1 where the
    rule at tau would accept the draft's own pick from row Q[q_idx[i]] against target row P[p_idx[i]] (pick with
    us[i, 0], SD test with us[i, 1], then the rescue), else 0. A budget's refusals are not modelled."""
    temperature, top_k, top_p, min_p = sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
    greedy = temperature <= 0.0
    for i in range(p_idx.shape[0]):
        x, y = P[p_idx[i]], Q[q_idx[i]]
        d, q_p, _, _ = pick_kept(y, n, temperature, top_k, top_p, min_p, us[i, 0], q_stats, kept, False, summary)
        ok = False
        if rule.mode != FSD_PAPER:
            if greedy:
                ok = argmax(x, n) == d
            else:
                ok = us[i, 1] * q_p < _p_of(x, d, n, sampling, summary)
        if not ok and rule.mode != SD and tau > 0.0:
            ok, _ = rescue(rule, x, row_lse_wide(x, n), y, 0, d, n, tau)
        out[i] = ok
