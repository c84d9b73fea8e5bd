"""The acceptance rule of one round (FSD.md, "Acceptance rules"), jitted end to end.

Inputs are the target's k+1 logit rows (a zero-copy view of llama.cpp's buffer), the draft's k raw rows
(copied as they were produced), the drafted tokens with their draft probabilities and processed-distribution
stats, and pre-drawn uniforms. Divergences are computed lazily: `fsd` only where the SD test failed,
`fsd-paper` slot by slot up to the first failure. The other lossy rules (`typical`, `cascade`, `relaxed`,
`fsd-entropy`: kernels/rules.py) are, like `fsd`, a rescue after a failed SD test, and nothing at tau = 0.
"""

from typing import NamedTuple

import numpy as np
from numba import njit

from fsd_local.kernels.budget import TAU, afford, end_round, greedy_loss, new_budget, plan_round, sampled_loss
from fsd_local.kernels.divergence import divergence
from fsd_local.kernels.names import (  # noqa: F401
    AR,
    CASCADE,
    DIVERGENCES,
    DRAFT_ONLY,
    FSD,
    FSD_ENTROPY,
    FSD_PAPER,
    MODES,
    RELAXED,
    RELAXED_K_DEFAULT,
    SD,
    TYPICAL,
    TYPICAL_ALPHA_DEFAULT,
    TYPICAL_EPS_DEFAULT,
)
from fsd_local.kernels.onehot import divergence_onehot
from fsd_local.kernels.rows import row_lse
from fsd_local.kernels.rules import entropy_scaled, target_rule
from fsd_local.kernels.sampling import argmax, pick, prob, processed, sample_residual
from fsd_local.kernels.topk import top_indices

# why a slot was accepted (the core statistic)
REJECTED, BY_SD, BY_FUZZY = 0, 1, 2


class Rule(NamedTuple):
    """The acceptance rule: mode and divergence codes (kernels/names.py), tau, k of the topk-* divergences, and
    the knobs of the target-only rules (kernels/rules.py): Medusa's eps and a (`typical`), the top-k window of
    `relaxed`."""

    mode: int
    divergence: int
    tau: float
    divergence_topk: int
    typical_eps: float = TYPICAL_EPS_DEFAULT
    typical_alpha: float = TYPICAL_ALPHA_DEFAULT
    relaxed_k: int = RELAXED_K_DEFAULT


class Sampling(NamedTuple):
    """The processed distribution: temperature (0 = greedy), top_k (0 = off), top_p (1 = off), min_p (0 = off)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float


class Drafts(NamedTuple):
    """What the drafter produced this round: the raw rows Q, the tokens, each token's draft probability, the
    (max, cut-off, log-normaliser) of each processed draft row, and whether a row is one-hot (prompt lookup:
    its divergences are closed forms, kernels/onehot.py)."""

    rows: np.ndarray
    tokens: np.ndarray
    prob: np.ndarray
    stats: np.ndarray
    onehot: np.ndarray


NO_TOP_IDS = np.zeros((0, 0), np.int32)
NO_TOP_LOGPROB = np.zeros((0, 0))


class RoundOut(NamedTuple):
    """Filled by accept_round: why each slot was accepted, its divergence (NaN = not computed; for the rules of
    kernels/rules.py the smallest tau that rescues the slot, of which fsd's divergence is the special case), the
    target's log-probability of every emitted token (log-softmax of the logit row the rule saw, before
    temperature and truncation: OpenAI's `logprobs`), and, when top_ids has columns, the target's most likely
    tokens at each emitted position with their log-probabilities (OpenAI's `top_logprobs`; -1 pads a short
    vocabulary)."""

    reason: np.ndarray
    divergence: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray = NO_TOP_IDS
    top_logprob: np.ndarray = NO_TOP_LOGPROB


def round_out(k: int, n_top: int = 0) -> RoundOut:
    """Buffers for a round of up to k drafts, reporting n_top alternatives per emitted token."""
    return RoundOut(
        np.empty(k, np.int8), np.empty(k), np.empty(k + 1), np.empty((k + 1, n_top), np.int32), np.empty((k + 1, n_top))
    )


def rule_of(settings) -> Rule:
    return Rule(
        MODES.index(settings.mode),
        DIVERGENCES.index(settings.divergence),
        float(settings.tau),
        int(settings.divergence_topk),
        float(settings.typical_eps),
        float(settings.typical_alpha),
        int(settings.relaxed_k),
    )


def sampling_of(settings) -> Sampling:
    return Sampling(float(settings.temperature), int(settings.top_k), float(settings.top_p), float(settings.min_p))


@njit(cache=True)
def accept_round(P, draft, n_drafts, n_vocab, rule, sampling, uniforms, out, budget):
    """Returns (n_accepted, next_token); fills out.reason[:n_drafts], out.divergence[:n_drafts],
    out.logprob[:n_accepted + 1] and budget.loss[:n_accepted + 1] (kernels/budget.py). P: the target's n_drafts + 1
    logit rows. Under a budget (budget.bound >= 0) the rule uses the budget's threshold instead of rule.tau, and a
    rescue must also be affordable: slot by slot when sampling, for the whole round at once when greedy."""
    Q, drafts, q_prob, q_stats = draft.rows, draft.tokens, draft.prob, draft.stats
    mode, div_kind, topk_div = rule.mode, rule.divergence, rule.divergence_topk
    tau = rule.tau if budget.bound < 0.0 else budget.state[TAU]
    temperature, top_k, top_p, min_p = sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
    reason, divs, logprobs = out.reason, out.divergence, out.logprob
    greedy = temperature <= 0.0
    n = n_vocab
    lse_p = np.full(n_drafts + 1, np.nan)
    stats_p = np.zeros(3, np.float32)
    accepted = 0
    loss = budget.loss
    for i in range(n_drafts):
        reason[i] = REJECTED
        divs[i] = np.nan
    for i in range(n_drafts + 1):
        loss[i] = 0.0
    planned = greedy and budget.bound > 0.0
    for i in range(n_drafts):
        x = P[i]
        d = drafts[i]
        mx, cut, lz = np.float32(0.0), np.float32(0.0), 0.0
        if not greedy:
            mx, cut, lz = processed(x, n, temperature, top_k, top_p, min_p)
        if mode != FSD_PAPER:
            if greedy:
                ok = argmax(x, n) == d
            else:
                # accept with probability min(1, p~(d) / q~(d))
                ok = uniforms[i] * q_prob[i] < prob(x, d, temperature, mx, cut, lz)
            if ok:
                reason[i] = BY_SD
                accepted += 1
                continue
            if mode == SD or not tau > 0.0 or budget.bound == 0.0:  # tau = 0 or B = 0: exactly sd
                break
        elif budget.bound == 0.0:
            break
        lse_p[i] = row_lse(x, n)
        if mode == TYPICAL or mode == CASCADE or mode == RELAXED:  # the target's distribution alone
            ok, dv = target_rule(mode, x, lse_p[i], d, n, tau, rule.typical_eps, rule.typical_alpha, rule.relaxed_k)
        else:
            if draft.onehot[i]:
                dv = divergence_onehot(div_kind, x, lse_p[i], d, n, topk_div)
            else:
                y = Q[i]
                dv = divergence(div_kind, x, lse_p[i], y, row_lse(y, n), n, topk_div)
            if mode == FSD_ENTROPY:
                ok, dv = entropy_scaled(dv, x, lse_p[i], n, tau)
            else:
                ok = dv <= tau  # NaN compares False: never accepts
        divs[i] = dv
        if ok:  # what the rescue costs (kernels/budget.py), known before accepting it
            if greedy:
                cost = greedy_loss(x, n, d)
            elif budget.bound < 0.0:
                cost = np.nan  # sampled: measured under a budget only (two scalar passes over the row)
            else:
                stats_p[0], stats_p[1], stats_p[2] = mx, cut, lz
                cost = sampled_loss(
                    mode, x, lse_p[i], Q[i], draft.onehot[i], d, n, temperature, stats_p, q_stats[i], tau,
                    rule.relaxed_k, rule.typical_eps, rule.typical_alpha,
                )  # fmt: skip
            if planned:  # decided with the whole round below; loss[i] holds the cost until then
                loss[i] = cost
            else:
                ok = afford(budget, cost, i, n_drafts)
                if ok and not greedy:
                    loss[i] = cost
        if ok:
            reason[i] = BY_FUZZY
            accepted += 1
        else:
            break
    if planned and accepted:  # greedy under a budget: how many of the drafts the rule accepts the budget affords
        kept = plan_round(budget, reason, BY_FUZZY, accepted)
        for j in range(kept, accepted):
            reason[j], loss[j] = REJECTED, 0.0
        accepted = kept
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
        fill_top(P[j], n, lse_p[j], j, out)
        if greedy:
            loss[j] = greedy_loss(P[j], n, tok)
    end_round(budget, accepted + 1, n_drafts, accepted)
    return accepted, nxt


@njit(cache=True)
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


@njit(cache=True)
def emit_one(x, n, sampling, u, stats, out):
    """Plain decoding (the ar and draft-only baselines): (token, raw log-prob of the token); out.logprob[0] and
    the top alternatives (out.top_ids[0]) as accept_round fills them."""
    t, _, _ = pick(x, n, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, u, stats, False)
    lse = row_lse(x, n)
    out.logprob[0] = float(x[t]) - lse
    fill_top(x, n, lse, 0, out)
    return t, out.logprob[0]


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
    for onehot in (0, 1):
        draft = Drafts(Q, drafts, q_prob, q_stats, np.full(k, onehot, np.uint8))
        out = round_out(k, 2 * onehot)  # with and without top alternatives (the same types)
        budgets = (new_budget(None, k), new_budget(0.1, k))
        for temperature in (0.0, 1.0):
            sampling = Sampling(temperature, 0, 1.0, 0.0)
            pick(Q[0], n, temperature, 0, 1.0, 0.0, 0.5, q_stats[0], False)
            pick(Q[0], n, temperature, 0, 1.0, 0.0, 0.5, q_stats[0], True)
            emit_one(P[0], n, sampling, 0.5, q_stats[0], out)
            for mode in (FSD, FSD_PAPER, SD, TYPICAL, CASCADE, RELAXED, FSD_ENTROPY):
                for budget in budgets:
                    accept_round(P, draft, k, n, Rule(mode, 0, 1.0, 50), sampling, np.full(k + 1, 0.5), out, budget)
    _warm = True
