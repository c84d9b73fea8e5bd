"""The acceptance rule of one round, jitted end to end: `accept_round` judges the drafts slot by slot against the
target's rows, draws the one extra token and describes what it emits (docs/design.md, "The acceptance rules").
Plain decoding's one token is kernels/emit.py's `emit_one`."""

from typing import NamedTuple

import numpy as np
from numba import njit

from fsd_local.kernels.budget import (
    TAU,
    end_round,
    kept_union,
    open_share,
    plan_round,
    rescue_floor,
    sampled_loss,
)
from fsd_local.kernels.dense import (
    PARTS,
    SUMMARY_BLOCKS,
    dense_draft,
    dense_loss,
    draw,
    draw_without,
    residual_draw,
    summarise_round,
)
from fsd_local.kernels.divergence import BOUNDS
from fsd_local.kernels.emit import cached_lse, fill_top
from fsd_local.kernels.jit_cache import jit
from fsd_local.kernels.names import (  # noqa: F401
    AR,
    BY_FUZZY,
    BY_SD,
    CASCADE,
    DIVERGENCES,
    DRAFT_ONLY,
    FSD,
    FSD_ENTROPY,
    FSD_PAPER,
    MODES,
    REJECTED,
    RELAXED,
    RELAXED_K_DEFAULT,
    SD,
    TYPICAL,
    TYPICAL_ALPHA_DEFAULT,
    TYPICAL_EPS_DEFAULT,
)
from fsd_local.kernels.rows import max_argmax, max_argmax_rows
from fsd_local.kernels.rules import rescue, target_only
from fsd_local.kernels.sampling import (
    KEPT_MAX,
    prob,
    processed_kept,
    residual_kept,
    sample_kept,
    untruncated,
)

# Drafts.onehot: a drafter's row (0), a one-hot q without a row (1: prompt lookup), or a token the grammar forced
# (2: one-hot too, and judged exactly: never rescued, never charged to a budget)
ONE_HOT, FORCED = 1, 2


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
    """A round's drafts: the raw rows (copied only where the rule reads them), the tokens, their draft probabilities,
    each processed row's (max, cutoff, log-normaliser), one-hot rows (ONE_HOT, FORCED), kept tokens, the untruncated
    pick's scratch, and which slots only the lossless test may accept."""

    rows: np.ndarray
    tokens: np.ndarray
    prob: np.ndarray
    stats: np.ndarray
    onehot: np.ndarray
    kept: np.ndarray = np.zeros((0, 0), np.int64)
    kept_n: np.ndarray = np.zeros(0, np.int64)
    summary: np.ndarray = np.zeros((3, SUMMARY_BLOCKS), np.float32)  # the untruncated pick's scratch (dense.py)
    lossless: np.ndarray = np.zeros(0, np.uint8)  # 1: only the lossless test may accept the slot (none stored: 0)


NO_TOP_IDS = np.zeros((0, 0), np.int32)
NO_TOP_LOGPROB = np.zeros((0, 0))


class RoundOut(NamedTuple):
    """What accept_round writes, allocated once (`round_out`): each slot's reason and divergence, each emitted
    token's log-probability, top alternatives and gap to the target's top token, then the kernel's scratch."""

    reason: np.ndarray  # REJECTED, BY_SD or BY_FUZZY per slot
    divergence: np.ndarray  # NaN: not computed; the target's rules (rules.py): the smallest tau that rescues
    logprob: np.ndarray  # log-softmax of the row the rule saw, at temperature 1 (OpenAI's); empty: not asked
    top_ids: np.ndarray  # the target's most likely tokens per emitted position (-1 pads a short vocabulary)
    top_logprob: np.ndarray
    gap: np.ndarray  # log p(the target's top token) - log p(the emitted one): the page's gap; greedy, the loss
    lse: np.ndarray
    row_max: np.ndarray
    top: np.ndarray
    pstats: np.ndarray
    kept: np.ndarray
    kept_n: np.ndarray
    union: np.ndarray
    summaries: np.ndarray
    rstats: np.ndarray
    dense: np.ndarray
    masses: np.ndarray
    sums: np.ndarray


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
        np.empty(2 * KEPT_MAX, np.int64),
        np.zeros((k + 1, 3, SUMMARY_BLOCKS), np.float32),
        np.zeros((k + 1, 3), np.float32),
        np.zeros(k + 1, np.uint8),
        np.zeros(SUMMARY_BLOCKS, np.float32),
        np.zeros((PARTS, 6)),
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


@jit
def _row_stats(x, i, n, sampling, out):
    """What the rule reads of target row i, computed once: greedy, its max and argmax (one pass at memory speed);
    sampled, the processed distribution (kept tokens and stats in out.kept[i], out.pstats; an untruncated row's
    from its summary) and the raw max."""
    if sampling.temperature <= 0.0:
        out.row_max[i], out.top[i] = max_argmax(x, n)
    elif out.dense[i]:  # summarised with the round's other rows (dense.summarise_round)
        st = out.rstats[i]
        out.row_max[i], out.kept_n[i] = st[0], -1
        out.pstats[0], out.pstats[1], out.pstats[2] = st[0], st[1], st[2]
    else:
        mx, cut, lz, m = processed_kept(
            x, n, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, out.kept[i]
        )
        out.row_max[i], out.kept_n[i] = mx, m
        out.pstats[0], out.pstats[1], out.pstats[2] = mx, cut, lz


@jit
def _lse(P, i, n, out):
    return cached_lse(P[i], n, i, out)


@jit
def accept_round(P, draft, n_drafts, n_vocab, rule, sampling, uniforms, out, budget):
    """(n_accepted, next_token) for the target's n_drafts + 1 rows P; fills `out` for the emitted tokens and
    budget.loss[:n_accepted + 1]. Each row is read only for what the rule needs; under a budget its threshold
    replaces rule.tau and a rescue must be affordable (sampled: slot by slot, _open; greedy: the round, plan_round)."""
    tau = rule.tau if budget.bound < 0.0 else budget.state[TAU]
    greedy = sampling.temperature <= 0.0
    n, loss = n_vocab, budget.loss
    _clear(out, loss, n_drafts)
    planned = greedy and budget.bound > 0.0
    if greedy:  # every row's argmax at once, in parallel (a rejection early in the round wastes a little)
        max_argmax_rows(P, n_drafts + 1, n, out.row_max, out.top)
    elif untruncated(sampling.top_k, sampling.top_p, sampling.min_p):  # every row's summary at once, likewise
        summarise_round(P, n_drafts + 1, n, sampling.temperature, out)
    accepted = 0
    while accepted < n_drafts:
        why = _judge(P, draft, accepted, n_drafts, n, rule, sampling, tau, uniforms, out, budget)
        if why == REJECTED:
            break
        out.reason[accepted] = why
        accepted += 1
    if planned and accepted:  # greedy under a budget: how many of the drafts the rule accepts the budget affords
        kept = plan_round(budget, out.reason, BY_FUZZY, accepted)
        for j in range(kept, accepted):
            out.reason[j], loss[j] = REJECTED, 0.0
        accepted = kept
    # a lossless-only slot's replacement is what sd's would be (fsd-paper's own draws from p~ itself)
    mode = SD if accepted < n_drafts and lossless_only(draft, accepted) else rule.mode
    nxt = _extra_token(P, draft, accepted, n_drafts, n, mode, sampling, uniforms[n_drafts], out)
    _describe(P, draft.tokens, accepted, nxt, n, greedy, out, loss)
    end_round(budget, accepted + 1, n_drafts, accepted)
    return accepted, nxt


@jit
def _clear(out, loss, n_drafts):
    for i in range(n_drafts + 1):
        out.lse[i] = np.nan
        out.top[i] = -1
        out.dense[i] = 0
        loss[i] = 0.0
        if i < n_drafts:
            out.reason[i] = REJECTED
            out.divergence[i] = np.nan


@jit
def _judge(P, draft, i, n_drafts, n, rule, sampling, tau, uniforms, out, budget):
    """Why draft i is accepted (BY_SD, BY_FUZZY) or REJECTED, with out.divergence[i] where computed and
    budget.loss[i]: a greedy rescue's cost, a sampled budget's charge (_open), or else a rescue's loss over
    P(rescue)."""
    x, d, mode = P[i], draft.tokens[i], rule.mode
    greedy = sampling.temperature <= 0.0
    strict = lossless_only(draft, i)  # the slot is judged as sd judges it: the SD test alone
    lossy = not strict and mode != SD and budget.bound != 0.0 and (tau > 0.0 or mode == FSD_PAPER)  # else: sd
    share = -1.0  # the share of the slot's rescues a sampled budget allows (-1: no budget decides)
    if not greedy:
        _row_stats(x, i, n, sampling, out)
        if lossy and budget.bound > 0.0:
            share = _open(P, draft, i, n_drafts, n, rule, sampling, tau, out, budget)
    u = uniforms[i]  # fsd-paper has no SD test: the uniform is free for the budget's share
    if mode != FSD_PAPER or strict:
        if greedy:
            ok = out.top[i] == d
        else:  # accept with probability min(1, p~(d) / q~(d))
            pst, qd = out.pstats, draft.prob[i]
            pd = prob(x, d, sampling.temperature, pst[0], pst[1], pst[2])
            ok = u * qd < pd
            if not ok:  # given the failure, uniform on [0, 1) again whatever d is (u qd >= pd with u < 1: qd > pd)
                u = (u * qd - pd) / (qd - pd)
        if ok:
            return BY_SD
    if not lossy or share == 0.0:
        return REJECTED
    if share < 0.0 or target_only(mode):  # an opened slot of a divergence rule rescues whatever was drafted there
        ok, dv = rescue(rule, x, _lse(P, i, n, out), draft.rows[i], draft.onehot[i], d, n, tau)
        out.divergence[i] = dv
        if not ok:
            return REJECTED
    if share > 0.0:  # a sampled budget opened the slot (and charged it): the rescue is taken within its share
        return BY_FUZZY if share >= 1.0 or u < share else REJECTED
    if greedy:  # what the rescue costs, known before accepting it (with no budget _describe writes it again)
        budget.loss[i] = float(out.row_max[i]) - float(x[d])
    else:  # no budget decides: the rescue's loss over P(rescue), whose expectation is the slot's loss
        loss, rescued = _slot_loss(draft, i, x, n, rule, sampling, tau, out)
        budget.loss[i] = loss / rescued if rescued > 0.0 else 0.0  # (0: float32 and float64 disagree on p < q)
    return BY_FUZZY


@njit(inline="always")
def lossless_only(draft, i):
    """Whether slot i may be accepted by the lossless SD test alone: a token the grammar forced, or a slot
    Drafts.lossless flags (none stored: no)."""
    return draft.onehot[i] == FORCED or (draft.lossless.shape[0] > i and draft.lossless[i] != 0)


@jit
def _open(P, draft, i, n_drafts, n, rule, sampling, tau, out, budget):
    """A sampled budget at slot i, before its SD test: the share of the slot's rescues it allows (open_share),
    charged in budget.loss[i] as that share of the slot's loss; decided on the slot's rows, never on the token
    drawn there (docs/design.md, "The quality budget")."""
    x, mode = P[i], rule.mode
    if target_only(mode):
        _lse(P, i, n, out)
    elif mode == FSD_ENTROPY or not tau >= BOUNDS[rule.divergence]:
        ok, dv = rescue(rule, x, _lse(P, i, n, out), draft.rows[i], draft.onehot[i], draft.tokens[i], n, tau)
        out.divergence[i] = dv
        if not ok:
            return 0.0
    loss, rescued = _slot_loss(draft, i, x, n, rule, sampling, tau, out)
    share = open_share(budget, loss, rescued, i, n_drafts)
    if share > 0.0:
        budget.loss[i] = share * loss
    return share


@jit
def _describe(P, drafts, accepted, nxt, n, greedy, out, loss):
    """The emitted tokens' gap, greedy loss and (where asked) log-probability and top alternatives."""
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


@jit
def _slot_loss(draft, i, x, n, rule, sampling, tau, out):
    """budget.sampled_loss of slot i, over the tokens where p~ or q~ has mass when both are truncated (their kept
    sets' union: a few dozen tokens under chat's sampling), else over the whole rows. The row's log-partition where
    it was computed, else 0 (only the target's rules read it: _open computed it for them)."""
    m_p = out.kept_n[i]
    if draft.onehot[i]:  # prompt lookup: q~ is the drafted token alone
        m = kept_union(out.kept[i], m_p, draft.tokens[i : i + 1], 1, out.union) if m_p >= 0 else -1
    elif draft.kept.shape[0] > i and m_p >= 0 and draft.kept_n[i] >= 0:
        m = kept_union(out.kept[i], m_p, draft.kept[i], draft.kept_n[i], out.union)
    else:
        m = -1
    lx = out.lse[i]
    if m < 0 and out.dense[i] and dense_draft(draft, i):  # one vectorised pass over both rows, on every core
        shift = lx if lx == lx else float(out.pstats[0])  # any shift cancels for the divergence rules
        floor = rescue_floor(rule.mode, x, shift, n, tau, rule.relaxed_k, rule.typical_eps, rule.typical_alpha)
        y, d = draft.rows[i], draft.tokens[i]
        return dense_loss(
            rule.mode,
            x,
            shift,
            y,
            n,
            sampling.temperature,
            out.pstats,
            draft.stats[i],
            floor,
            out.sums,
            draft.onehot[i],
            d,
        )
    return sampled_loss(
        rule.mode,
        x,
        lx if lx == lx else 0.0,
        draft.rows[i],
        draft.onehot[i],
        draft.tokens[i],
        n,
        sampling.temperature,
        out.pstats,
        draft.stats[i],
        tau,
        rule.relaxed_k,
        rule.typical_eps,
        rule.typical_alpha,
        out.union,
        m,
        draft.kept_n,  # q~ is read from the draft's row (m_q -1): no drafter stores its kept logits alone
        draft.rows[0],
        -1,
    )


@jit
def _extra_token(P, draft, accepted, n_drafts, n, mode, sampling, u, out):
    """The one extra token of the round: the bonus after a full accept, otherwise the replacement at the failed
    slot (greedy: the argmax; sampled: the residual norm(max(p~ - q~, 0)), or p~ itself for fsd-paper but at a
    forced slot)."""
    x = P[accepted]
    temperature = sampling.temperature
    paper = mode == FSD_PAPER and (accepted == n_drafts or draft.onehot[accepted] != FORCED)  # forced: residual
    if accepted == n_drafts or paper or temperature <= 0.0:
        if accepted == n_drafts or temperature <= 0.0:  # a row not read yet (the bonus), or read greedily
            if out.top[accepted] < 0 or temperature > 0.0:
                _row_stats(x, accepted, n, sampling, out)
        if temperature <= 0.0:
            return out.top[accepted]
        pst = out.pstats
        if out.dense[accepted]:
            return draw(x, n, 1.0 / temperature, pst[0], out.summaries[accepted], u)
        return sample_kept(x, n, temperature, pst[0], pst[1], pst[2], out.kept[accepted], out.kept_n[accepted], u)
    pst = out.pstats  # the stats of row `accepted`: the last row _row_stats read
    if out.dense[accepted] and dense_draft(draft, accepted):  # one pass over both rows
        if draft.onehot[accepted]:
            return draw_without(x, n, 1.0 / temperature, pst[0], out.summaries[accepted], u, draft.tokens[accepted])
        t = residual_draw(x, draft.rows[accepted], n, temperature, pst, draft.stats[accepted], u, out.masses)
        return t if t >= 0 else draw(x, n, 1.0 / temperature, pst[0], out.summaries[accepted], u)
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
        draft.tokens[accepted],
        draft.kept_n,  # q~ from the draft's row (m_q -1), as in _slot_loss
        draft.rows[0],
        -1,
    )
