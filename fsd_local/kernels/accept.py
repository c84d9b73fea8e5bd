"""The acceptance rule of one round (FSD.md, "Acceptance rules"), jitted end to end.

Inputs are the target's k+1 logit rows (a zero-copy view of llama.cpp's buffer), the draft's k raw rows
(copied as they were produced), the drafted tokens with their draft probabilities and processed-distribution
stats, and pre-drawn uniforms. Divergences are computed lazily: `fsd` only where the SD test failed,
`fsd-paper` slot by slot up to the first failure.
"""
import numpy as np
from numba import njit

from fsd_local.kernels.divergence import divergence
from fsd_local.kernels.rows import row_lse
from fsd_local.kernels.sampling import argmax, pick, prob, processed, sample_residual

MODES = ("fsd", "fsd-paper", "sd", "ar", "draft-only")
FSD, FSD_PAPER, SD, AR, DRAFT_ONLY = range(5)

# why a slot was accepted (the core statistic)
REJECTED, BY_SD, BY_FUZZY = 0, 1, 2


@njit(cache=True)
def accept_round(P, Q, drafts, n_drafts, q_prob, q_stats, n_vocab, mode, div_kind, tau, topk_div,
                 temperature, top_k, top_p, min_p, uniforms, reason, divs, logprobs):
    """Returns (n_accepted, next_token). Fills reason[:n_drafts], divs[:n_drafts] (NaN = not computed)
    and logprobs[:n_accepted + 1]: the target's raw log-probability of every emitted token."""
    greedy = temperature <= 0.0
    n = n_vocab
    lse_p = np.full(n_drafts + 1, np.nan)
    stats_p = np.zeros(3, np.float32)
    accepted = 0
    for i in range(n_drafts):
        reason[i] = REJECTED
        divs[i] = np.nan
    for i in range(n_drafts):
        x = P[i]
        d = drafts[i]
        if mode != FSD_PAPER:
            if greedy:
                ok = argmax(x, n) == d
            else:
                mx, cut, lz = processed(x, n, temperature, top_k, top_p, min_p)
                # accept with probability min(1, p~(d) / q~(d))
                ok = uniforms[i] * q_prob[i] < prob(x, d, temperature, mx, cut, lz)
            if ok:
                reason[i] = BY_SD
                accepted += 1
                continue
            if mode == SD or not tau > 0.0:  # tau = 0: exactly standard speculative decoding
                break
        lse_p[i] = row_lse(x, n)
        y = Q[i]
        dv = divergence(div_kind, x, lse_p[i], y, row_lse(y, n), n, topk_div)
        divs[i] = dv
        if dv <= tau:  # NaN compares False: never accepts
            reason[i] = BY_FUZZY
            accepted += 1
        else:
            break
    # the one extra token: bonus after a full accept, otherwise the replacement at the failed slot
    x = P[accepted]
    u = uniforms[n_drafts]
    if greedy:
        nxt = argmax(x, n)
    elif accepted == n_drafts or mode == FSD_PAPER:
        nxt, _, _ = pick(x, n, temperature, top_k, top_p, min_p, u, stats_p, False)
    else:
        mx, cut, lz = processed(x, n, temperature, top_k, top_p, min_p)
        stats_p[0], stats_p[1], stats_p[2] = mx, cut, lz
        nxt = sample_residual(x, Q[accepted], n, temperature, stats_p, q_stats[accepted], u)
    for j in range(accepted + 1):
        if not lse_p[j] == lse_p[j]:
            lse_p[j] = row_lse(P[j], n)
        tok = drafts[j] if j < accepted else nxt
        logprobs[j] = float(P[j][tok]) - lse_p[j]
    return accepted, nxt


@njit(cache=True)
def emit_one(x, n, temperature, top_k, top_p, min_p, u, stats):
    """Plain decoding (the ar and draft-only baselines): (token, raw log-prob of the token)."""
    t, _, _ = pick(x, n, temperature, top_k, top_p, min_p, u, stats, False)
    return t, float(x[t]) - row_lse(x, n)


_warm = False


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel the loop uses, with the loop's exact argument
    types, so the first generation does not pay for it inside its timed span. Once per process."""
    global _warm
    if _warm:
        return
    n, k = 64, 2
    rng = np.random.default_rng(0)
    P = rng.standard_normal((k + 1, n)).astype(np.float32)
    Q = rng.standard_normal((k, n)).astype(np.float32)
    q_stats = np.zeros((k + 1, 3), np.float32)
    q_prob = np.ones(k)
    drafts = np.zeros(k, np.int32)
    for temperature in (0.0, 1.0):
        pick(Q[0], n, temperature, 0, 1.0, 0.0, 0.5, q_stats[0], False)
        pick(Q[0], n, temperature, 0, 1.0, 0.0, 0.5, q_stats[0], True)
        emit_one(P[0], n, temperature, 0, 1.0, 0.0, 0.5, q_stats[0])
        for mode in (FSD, FSD_PAPER, SD):
            accept_round(P, Q, drafts, k, q_prob, q_stats, n, mode, 0, 1.0, 50, temperature, 0, 1.0, 0.0,
                         np.full(k + 1, 0.5), np.zeros(k, np.int8), np.zeros(k), np.zeros(k + 1))
    _warm = True
