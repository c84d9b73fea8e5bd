"""What a round writes about each token it emits, and plain decoding's one token (the ar and draft-only
baselines): the raw log-probability, the gap to the row's max, the top alternatives; each log-partition computed
once per row and only where asked (out.lse caches it, NaN until then)."""

import numpy as np

from fsd_local.kernels.budget import end_round
from fsd_local.kernels.jit_cache import jit
from fsd_local.kernels.names import BY_SD, REJECTED
from fsd_local.kernels.rows import row_lse_wide, row_max
from fsd_local.kernels.sampling import pick_kept
from fsd_local.kernels.topk import top_indices


@jit
def fill_top(x, n, lse, j, out):
    """out.top_ids[j] / out.top_logprob[j]: the most likely tokens of row x (as many as top_ids has columns)."""
    n_top = out.top_ids.shape[1]
    if n_top == 0:
        return
    idx = top_indices(x, n, n_top)
    for t in range(n_top):
        if t < idx.shape[0]:
            out.top_ids[j, t] = idx[t]
            out.top_logprob[j, t] = float(x[idx[t]]) - lse
        else:
            out.top_ids[j, t] = -1
            out.top_logprob[j, t] = -np.inf


@jit
def emit_one(x, n, sampling, u, stats, out):
    """Plain decoding (the ar and draft-only baselines): (token, raw log-prob of the token, NaN when not asked);
    out.logprob[0], out.gap[0] and the top alternatives (out.top_ids[0]) as accept_round (kernels/accept.py) fills
    them."""
    temperature = sampling.temperature
    t, _, _, _ = pick_kept(
        x,
        n,
        temperature,
        sampling.top_k,
        sampling.top_p,
        sampling.min_p,
        u,
        stats,
        out.kept[0],
        False,
        out.summaries[0],
    )
    out.lse[0] = np.nan
    mx = row_max(x, n) if temperature <= 0.0 else stats[0]  # a sampled pick wrote the row's max
    out.gap[0] = float(mx) - float(x[t])
    lp = np.nan
    if out.logprob.shape[0] > 0:
        lp = out.logprob[0] = float(x[t]) - cached_lse(x, n, 0, out)
    if out.top_ids.shape[1] > 0:
        fill_top(x, n, cached_lse(x, n, 0, out), 0, out)
    return t, lp


@jit
def cached_lse(x, n, i, out):
    """Row x's log-partition, computed once per round slot i (out.lse[i] is NaN until then)."""
    if not out.lse[i] == out.lse[i]:
        out.lse[i] = row_lse_wide(x, n)
    return out.lse[i]


@jit
def accept_tops(drafts, n_drafts, out, budget):
    """A greedy round of the lossless rule from the target's argmax of each row in out.top[:n_drafts + 1] (picked
    on the device): the drafts up to the first that is not its row's argmax, then that argmax; gap and loss 0.
    Returns (n_accepted, next_token), as accept_round."""
    accepted = 0
    for i in range(n_drafts):
        out.divergence[i] = np.nan
        out.reason[i] = REJECTED
    while accepted < n_drafts and drafts[accepted] == out.top[accepted]:
        out.reason[accepted] = BY_SD
        accepted += 1
    for j in range(accepted + 1):
        out.gap[j] = 0.0
        budget.loss[j] = 0.0
    end_round(budget, accepted + 1, n_drafts, accepted)
    return accepted, out.top[accepted]
