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

from fsd_local.kernels.budget import TAU, afford, end_round, new_budget, plan_round, sampled_loss
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
from fsd_local.kernels.rows import max_argmax, row_lse, row_max
from fsd_local.kernels.rules import entropy_scaled, target_rule
from fsd_local.kernels.sampling import (
    KEPT_MAX,
    argmax,
    pick,
    pick_kept,
    prob,
    processed,
    processed_kept,
    residual_kept,
    sample_kept,
)
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
    temperature and truncation: OpenAI's `logprobs`; an empty array: not asked, not computed), when top_ids has
    columns the target's most likely tokens at each emitted position with their log-probabilities (OpenAI's
    `top_logprobs`; -1 pads a short vocabulary), and `gap`: log p(the target's top token) - log p(the emitted
    token) of each emitted token (the page's rescue gap; greedy, its loss). The rest is the kernel's scratch,
    allocated once (`round_out`) so that a round allocates nothing: each row's log-partition (NaN: not computed),
    maximum and argmax (-1: not computed), processed-distribution stats, and kept tokens (sampling.py)."""

    reason: np.ndarray
    divergence: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprob: np.ndarray
    gap: np.ndarray
    lse: np.ndarray
    row_max: np.ndarray
    top: np.ndarray
    pstats: np.ndarray
    kept: np.ndarray
    kept_n: np.ndarray


def round_out(k: int, n_top: int = 0, logprobs: bool = True) -> RoundOut:
    """Buffers for a round of up to k drafts, reporting n_top alternatives per emitted token and (logprobs)
    each emitted token's log-probability."""
    return RoundOut(
        np.empty(k, np.int8),
        np.empty(k),
        np.empty(k + 1 if logprobs else 0),
        np.empty((k + 1, n_top), np.int32),
        np.empty((k + 1, n_top)),
        np.empty(k + 1),
        np.empty(k + 1),
        np.empty(k + 1, np.float32),
        np.empty(k + 1, np.int64),
        np.empty(3, np.float32),
        np.empty((k + 1, KEPT_MAX), np.int64),
        np.empty(k + 1, np.int64),
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
def _row_stats(x, i, n, sampling, out):
    """What the rule reads of target row i, computed once: greedy, its max and argmax (one pass at memory speed);
    sampled, the processed distribution (kept tokens and stats in out.kept[i], out.pstats) and the raw max."""
    if sampling.temperature <= 0.0:
        out.row_max[i], out.top[i] = max_argmax(x, n)
    else:
        mx, cut, lz, m = processed_kept(
            x, n, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, out.kept[i]
        )
        out.row_max[i], out.kept_n[i] = mx, m
        out.pstats[0], out.pstats[1], out.pstats[2] = mx, cut, lz


@njit(cache=True)
def _lse(P, i, n, out):
    return _lse_row(P[i], n, i, out)


@njit(cache=True)
def accept_round(P, draft, n_drafts, n_vocab, rule, sampling, uniforms, out, budget):
    """Returns (n_accepted, next_token); fills out.reason[:n_drafts], out.divergence[:n_drafts], out.gap and (if
    asked) out.logprob / out.top_* for the n_accepted + 1 emitted tokens, and budget.loss[:n_accepted + 1]
    (kernels/budget.py). P: the target's n_drafts + 1 logit rows. Under a budget (budget.bound >= 0) the rule
    uses the budget's threshold instead of rule.tau, and a rescue must also be affordable: slot by slot when
    sampling, for the whole round at once when greedy.

    Each row is read only for what the rule needs: greedy, an argmax (with its max, which gives the loss and the
    gap for free); sampled, the processed distribution over its kept tokens; a log-partition and a divergence
    only at a slot whose SD test failed (and where log-probabilities are asked)."""
    Q, drafts, q_prob, q_stats = draft.rows, draft.tokens, draft.prob, draft.stats
    mode = rule.mode
    tau = rule.tau if budget.bound < 0.0 else budget.state[TAU]
    temperature = sampling.temperature
    reason, divs = out.reason, out.divergence
    greedy = temperature <= 0.0
    n = n_vocab
    accepted = 0
    loss = budget.loss
    for i in range(n_drafts + 1):
        out.lse[i] = np.nan
        out.top[i] = -1
        loss[i] = 0.0
        if i < n_drafts:
            reason[i] = REJECTED
            divs[i] = np.nan
    planned = greedy and budget.bound > 0.0
    for i in range(n_drafts):
        x = P[i]
        d = drafts[i]
        _row_stats(x, i, n, sampling, out)
        if mode != FSD_PAPER:
            if greedy:
                ok = out.top[i] == d
            else:  # accept with probability min(1, p~(d) / q~(d))
                ok = uniforms[i] * q_prob[i] < prob(x, d, temperature, out.pstats[0], out.pstats[1], out.pstats[2])
            if ok:
                reason[i] = BY_SD
                accepted += 1
                continue
            if mode == SD or not tau > 0.0 or budget.bound == 0.0:  # tau = 0 or B = 0: exactly sd
                break
        elif budget.bound == 0.0:
            break
        ok, dv = rescue(rule, x, _lse(P, i, n, out), Q[i], draft.onehot[i], d, n, tau)
        divs[i] = dv
        if ok:  # what the rescue costs (kernels/budget.py), known before accepting it
            if greedy:
                cost = float(out.row_max[i]) - float(x[d])
            elif budget.bound < 0.0:
                cost = np.nan  # sampled: measured under a budget only (two scalar passes over the row)
            else:
                cost = sampled_loss(
                    mode, x, out.lse[i], Q[i], draft.onehot[i], d, n, temperature, out.pstats, q_stats[i], tau,
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
    nxt = _extra_token(P, draft, accepted, n_drafts, n, mode, sampling, uniforms[n_drafts], out)
    for j in range(accepted + 1):
        x = P[j]
        tok = drafts[j] if j < accepted else nxt
        if greedy:
            loss[j] = float(out.row_max[j]) - float(x[tok])  # 0 for every token the target chose itself
        out.gap[j] = float(out.row_max[j]) - float(x[tok])
        if out.logprob.shape[0] > 0:
            out.logprob[j] = float(x[tok]) - _lse(P, j, n, out)
        if out.top_ids.shape[1] > 0:
            fill_top(x, n, _lse(P, j, n, out), j, out)
    end_round(budget, accepted + 1, n_drafts, accepted)
    return accepted, nxt


@njit(cache=True)
def _extra_token(P, draft, accepted, n_drafts, n, mode, sampling, u, out):
    """The one extra token of the round: the bonus after a full accept, otherwise the replacement at the failed
    slot (greedy: the argmax; sampled: the residual norm(max(p~ - q~, 0)), or p~ itself for fsd-paper)."""
    x = P[accepted]
    temperature = sampling.temperature
    if accepted == n_drafts or mode == FSD_PAPER or temperature <= 0.0:
        if accepted == n_drafts or temperature <= 0.0:  # a row not read yet (the bonus), or read greedily
            if out.top[accepted] < 0 or temperature > 0.0:
                _row_stats(x, accepted, n, sampling, out)
        if temperature <= 0.0:
            return out.top[accepted]
        pst = out.pstats
        return sample_kept(x, n, temperature, pst[0], pst[1], pst[2], out.kept[accepted], out.kept_n[accepted], u)
    pst = out.pstats  # the stats of row `accepted`: the last row _row_stats read
    d = draft.tokens[accepted]
    return residual_kept(
        x,
        draft.rows[accepted],
        n,
        temperature,
        pst,
        draft.stats[accepted],
        out.kept[accepted],
        out.kept_n[accepted],
        u,
        draft.onehot[accepted],
        d,
    )


@njit(cache=True)
def rescue(rule, x, lx, y, onehot, d, n, tau):
    """(rescued, value) of a lossy rule at a slot whose SD test failed (fsd-paper: at every slot): draft token d,
    target row x with log-partition lx, draft row y (one-hot on d for prompt lookup). value is the divergence
    compared with tau, or for the target-only rules (kernels/rules.py) the smallest tau that rescues d. NaN never
    rescues."""
    mode = rule.mode
    if mode == TYPICAL or mode == CASCADE or mode == RELAXED:  # the target's distribution alone
        return target_rule(mode, x, lx, d, n, tau, rule.typical_eps, rule.typical_alpha, rule.relaxed_k)
    if onehot:
        dv = divergence_onehot(rule.divergence, x, lx, d, n, rule.divergence_topk)
    else:
        dv = divergence(rule.divergence, x, lx, y, row_lse(y, n), n, rule.divergence_topk)
    if mode == FSD_ENTROPY:
        return entropy_scaled(dv, x, lx, n, tau)
    return dv <= tau, dv  # NaN compares False: never accepts


@njit(cache=True)
def score_slots(P, p_idx, Q, q_idx, n, rule, sampling, tau, us, q_stats, out):
    """Teacher-forced scoring of a drafter on text it did not draft (drafting/proposer.py `catch_up`): out[i] = 1
    where the rule, at threshold tau, would accept the draft's own pick from row Q[q_idx[i]] at a slot whose
    target row is P[p_idx[i]], else 0. The pick is the draft's (argmax, or a draw with us[i, 0]), the SD test
    that of accept_round (us[i, 1]), then the rescue. Given the text before each slot, that is the chance the
    round would have had there; a budget's refusals are not modelled (its threshold is)."""
    temperature, top_k, top_p, min_p = sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
    greedy = temperature <= 0.0
    for i in range(p_idx.shape[0]):
        x, y = P[p_idx[i]], Q[q_idx[i]]
        d, q_p, _ = pick(y, n, temperature, top_k, top_p, min_p, us[i, 0], q_stats, False)
        ok = False
        if rule.mode != FSD_PAPER:
            if greedy:
                ok = argmax(x, n) == d
            else:
                mx, cut, lz = processed(x, n, temperature, top_k, top_p, min_p)
                ok = us[i, 1] * q_p < prob(x, d, temperature, mx, cut, lz)
        if not ok and rule.mode != SD and tau > 0.0:
            ok, _ = rescue(rule, x, row_lse(x, n), y, 0, d, n, tau)
        out[i] = ok


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
    """Plain decoding (the ar and draft-only baselines): (token, raw log-prob of the token, NaN when not asked);
    out.logprob[0], out.gap[0] and the top alternatives (out.top_ids[0]) as accept_round fills them."""
    t, _, _ = pick_kept(
        x, n, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, u, stats, out.kept[0], False
    )
    out.lse[0] = np.nan
    out.gap[0] = float(row_max(x, n)) - float(x[t])
    lp = np.nan
    if out.logprob.shape[0] > 0:
        lp = out.logprob[0] = float(x[t]) - _lse_row(x, n, 0, out)
    if out.top_ids.shape[1] > 0:
        fill_top(x, n, _lse_row(x, n, 0, out), 0, out)
    return t, lp


@njit(cache=True)
def _lse_row(x, n, i, out):
    if not out.lse[i] == out.lse[i]:
        out.lse[i] = row_lse(x, n)
    return out.lse[i]


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
            pick_kept(Q[0], n, temperature, 0, 1.0, 0.0, 0.5, q_stats[0], out.kept[0], False)
            pick_kept(Q[0], n, temperature, 8, 0.9, 0.05, 0.5, q_stats[0], out.kept[0], True)
            emit_one(P[0], n, sampling, 0.5, q_stats[0], out)
            for mode in (FSD, FSD_PAPER, SD, TYPICAL, CASCADE, RELAXED, FSD_ENTROPY):
                for budget in budgets:
                    accept_round(P, draft, k, n, Rule(mode, 0, 1.0, 50), sampling, np.full(k + 1, 0.5), out, budget)
                idx = np.arange(k, dtype=np.int64)
                scored = np.zeros(k, np.uint8)
                rule, us = Rule(mode, 0, 1.0, 50), np.full((k, 2), 0.5)
                score_slots(P, idx, Q, idx, n, rule, sampling, 1.0, us, q_stats[0], scored)
    _warm = True
