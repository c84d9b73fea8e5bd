"""The quality budget B, nats of target log-probability given up per emitted token, jitted: each token's loss,
the hard cap at every point where the reply can end (`open_share`, `plan_round`), and the controlled gain g
(docs/design.md, "The quality budget")."""

import math
from typing import NamedTuple

import numpy as np

from fsd_local.kernels.jit_cache import jit
from fsd_local.kernels.names import (  # noqa: F401  (the state's indices, declared once there)
    ACCEPTED,
    BUDGET_STATE,
    CAPPED,
    CASCADE,
    CHARGED,
    DRAFTED,
    FSD_PAPER,
    LOSS,
    REFUSED,
    RELAXED,
    ROUNDS,
    STOP_AT,
    TAU,
    TAU0,
    TAU_MAX,
    TAU_MIN,
    TAU_SUM,
    TOKENS,
    TYPICAL,
    G,
)
from fsd_local.kernels.rows import row_entropy, row_max
from fsd_local.kernels.sampling import q_at
from fsd_local.kernels.topk import top_indices

N_STATE = len(BUDGET_STATE)
NO_STOP = 1e9  # STOP_AT when no draft of the round ends the reply
G_START, G_LO, G_HI = 1.0, 0.01, 40.0  # the controlled gain: first value (at B_REF or less) and range
B_REF = 0.025  # sampled, a larger B starts g at B / B_REF (Budgets.start)
TAU_HI = 4.0  # the threshold never goes above this (every rule's tau scale is below it)
TAU_START = 0.1  # the mode's starting threshold, unless its own scale says otherwise:
MODE_TAU_START = {"fsd-entropy": 0.2, "typical": 0.9, "cascade": 0.5, "relaxed": 0.3}
RESERVE_TOKENS = 2.0  # the controller keeps this many tokens' worth of budget unspent for the next rescue
STEP = 0.25  # log-change of g per round at full deviation from the reserve
ACCEPT_PRIOR = 0.7  # the acceptance rate a before the reply has drafted anything (weight: DRAFTS_PRIOR drafts)
DRAFTS_PRIOR = 8.0


class Budget(NamedTuple):
    """One reply's budget: the bound B (< 0: no budget, the rule's own tau), the state (LOSS ... REFUSED above),
    and `loss`, filled by accept_round with the loss of every emitted token of the round (also with no budget)."""

    bound: float
    state: np.ndarray
    loss: np.ndarray


def new_budget(bound: float | None, k: int, tau0: float = TAU_START, g: float = G_START) -> Budget:
    """A budget for a reply with up to k drafts a round; bound None = no budget (losses are still measured).
    tau0: the mode's starting threshold; g: the controller's gain to start from."""
    state = np.zeros(N_STATE)
    state[TAU0], state[G] = tau0, g
    state[TAU] = min(tau0 * g, TAU_HI)
    state[STOP_AT] = NO_STOP
    state[TAU_MIN], state[TAU_MAX] = np.inf, -np.inf
    return Budget(-1.0 if bound is None else float(bound), state, np.zeros(k + 1))


@jit
def _p(v, mx, cut, lz, inv_t):
    """A processed probability (kernels/sampling.py's three numbers), float64."""
    return math.exp((float(v) - mx) * inv_t - lz) if v >= cut else 0.0


@jit
def _row_constants(mode, x, lx, n, relaxed_k, eps, alpha):
    """What the target rules' critical tau of any token needs: (log max p, kth largest logit, m of typical); each
    read off the row only for the rule that uses it."""
    xmax = float(row_max(x, n)) if mode == CASCADE or mode == RELAXED else lx
    kth = -np.inf
    if mode == RELAXED:
        top = top_indices(x, n, relaxed_k)
        kth = float(x[top[top.shape[0] - 1]]) if top.shape[0] > 0 else -np.inf
    m = 0.0
    if mode == TYPICAL:
        h = row_entropy(x, n, lx)
        m = min(eps, alpha * math.exp(-h)) if h == h else np.nan
    return xmax - lx, kth, m


@jit
def _rescuable(mode, xv, lx, lpmax, kth, m, tau):
    """Whether the target rule (kernels/rules.py) rescues a token with raw logit xv at threshold tau."""
    if not xv > -np.inf:
        return False
    p = math.exp(min(float(xv) - lx, 0.0))
    if mode == TYPICAL:
        return (1.0 - p) / (1.0 - m) <= tau
    if mode == CASCADE:
        return 1.0 - math.exp(min(float(xv) - lx - lpmax, 0.0)) <= tau
    if mode == RELAXED:
        return xv >= kth and math.exp(lpmax) - p <= tau
    return True  # the divergence rules rescue whatever was drafted at a slot whose divergence passed


@jit
def rescue_floor(mode, x, lx, n, tau, relaxed_k, eps, alpha):
    """The lowest raw logit the rule rescues at threshold tau (`_rescuable` as one compare, for the vectorised
    kernels/dense.py): every target rule's test is p(t) >= some c, i.e. x_t >= lx + log c; the divergence rules
    rescue every token the target does not mask (-inf: the caller also requires x_t > -inf)."""
    if not (mode == TYPICAL or mode == CASCADE or mode == RELAXED):
        return -np.inf
    lpmax, kth, m = _row_constants(mode, x, lx, n, relaxed_k, eps, alpha)
    if mode == TYPICAL:  # (1 - p) / (1 - m) <= tau
        c = 1.0 - tau * (1.0 - m)
    elif mode == CASCADE:  # p / max p >= 1 - tau
        c = (1.0 - tau) * math.exp(lpmax)
    else:  # p >= max p - tau, among the top k
        c = math.exp(lpmax) - tau
    floor = lx + math.log(c) if c > 0.0 else -np.inf
    return max(floor, kth) if mode == RELAXED else floor


@jit
def kept_union(p_kept, m_p, q_kept, m_q, out):
    """out[:m] = the sorted union of p_kept[:m_p] and q_kept[:m_q] (both sorted); returns m."""
    i = j = m = 0
    while i < m_p or j < m_q:
        if j >= m_q or (i < m_p and p_kept[i] < q_kept[j]):
            t = p_kept[i]
            i += 1
        elif i >= m_p or q_kept[j] < p_kept[i]:
            t = q_kept[j]
            j += 1
        else:
            t = p_kept[i]
            i += 1
            j += 1
        out[m] = t
        m += 1
    return m


@jit
def sampled_loss(
    mode,
    x,
    lx,
    y,
    onehot,
    d,
    n,
    temperature,
    p_stats,
    q_stats,
    tau,
    relaxed_k,
    eps,
    alpha,
    tokens,
    m,
    q_kept,
    q_logits,
    m_q,
):
    """(loss, P(rescue)) of a slot where the rule may rescue, sampling: E_{t~p~}[log p(t)] - E_{t~r}[log p(t)]
    clamped at 0 (p the target's raw softmax, r what the rule emits from), and the chance the token is a rescue.
    Rows and stats as in kernels/accept.py; tokens[:m] every token where p~ or q~ has mass (m < 0: all n)."""
    inv_t = 1.0 / temperature
    pmx, pcut, plz = float(p_stats[0]), float(p_stats[1]), float(p_stats[2])
    qmx, qcut, qlz = float(q_stats[0]), float(q_stats[1]), float(q_stats[2])
    lpmax, kth, mm = _row_constants(mode, x, lx, n, relaxed_k, eps, alpha)
    if not mm == mm:
        return np.nan, 0.0
    size = m if m >= 0 else n
    # pass 1: the mass the rule rescues, the rejected mass the residual replaces, and E_p~[log p]
    rescued, rejected, residual, base, c = 0.0, 0.0, 0.0, 0.0, 0
    for j in range(size):
        t = tokens[j] if m >= 0 else j
        p = _p(x[t], pmx, pcut, plz, inv_t)
        yv, c = q_at(y, t, q_kept, q_logits, m_q, c)
        q = (1.0 if t == d else 0.0) if onehot else _p(yv, qmx, qcut, qlz, inv_t)
        if p > 0.0:
            base += p * (float(x[t]) - lx)
        if q > p:
            if mode == FSD_PAPER or _rescuable(mode, x[t], lx, lpmax, kth, mm, tau):
                rescued += q - p
            else:
                rejected += q - p
        else:
            residual += p - q
    if mode == FSD_PAPER:  # no SD test: every token accepted at the slot is a rescue
        rescued, rejected = 1.0, 0.0
    if not rescued > 0.0:
        return 0.0, 0.0
    # pass 2: E_r[log p], r = min(p, q) + rescued part of (q - p)+ + rejected mass spread as the residual
    emitted, c = 0.0, 0
    for j in range(size):
        t = tokens[j] if m >= 0 else j
        p = _p(x[t], pmx, pcut, plz, inv_t)
        yv, c = q_at(y, t, q_kept, q_logits, m_q, c)
        q = (1.0 if t == d else 0.0) if onehot else _p(yv, qmx, qcut, qlz, inv_t)
        if mode == FSD_PAPER:
            r = q
        elif q > p:
            r = q if _rescuable(mode, x[t], lx, lpmax, kth, mm, tau) else p
        else:
            r = q + (rejected * (p - q) / residual if residual > 0.0 else 0.0)
        if r > 0.0:
            if not x[t] > -np.inf:
                return np.inf, rescued  # the rule would emit a token the target masks
            emitted += r * (float(x[t]) - lx)
    return max(base - emitted, 0.0), rescued


@jit
def rescue_value(budget, slot, n_drafts):
    """Expected tokens a rescue at this slot buys: itself (the round goes on) and the drafts after it."""
    s = budget.state
    a = (s[ACCEPTED] + ACCEPT_PRIOR * DRAFTS_PRIOR) / (s[DRAFTED] + DRAFTS_PRIOR)
    v, w = 1.0, 1.0
    for _ in range(n_drafts - 1 - slot):
        w *= a
        v += w
    return v


@jit
def open_share(budget, loss, rescued, slot, n_drafts):
    """Sampled, before the slot's SD test: the share of its rescues the budget allows (0, 1, or what the hard cap
    leaves room for), with that share of the slot's loss charged. A share below 1 counts REFUSED, and CAPPED too
    where the rescue was worth its price."""
    s, b = budget.state, budget.bound
    if not rescued > 0.0:  # the rule rescues nothing here
        return 0.0
    worth = loss / rescued <= s[G] * b * rescue_value(budget, slot, n_drafts)  # False on NaN
    room = b * (s[TOKENS] + slot + 1.0) - s[LOSS]
    share = 0.0
    if worth and loss <= room:
        share = 1.0
    elif worth and room > 0.0:
        share = room / loss * (1.0 - 1e-12)  # up to the cap, not a rounding error over it
    if share < 1.0:
        s[REFUSED] += 1.0
        s[CAPPED] += worth  # cut by the hard cap alone (worth its price)
    if share > 0.0:
        s[LOSS] += share * loss
        s[CHARGED] += 1.0
    return share


@jit
def plan_round(budget, reason, rescue, n_ok):
    """Greedy, the whole round: of the n_ok drafts the rule accepts, returns m, the longest prefix whose loss keeps the
    reply within B x its tokens wherever it can end and whose rescues are worth their tokens. Charges the loss;
    counts a refusal when m < n_ok."""
    s, b, costs = budget.state, budget.bound, budget.loss
    base, tokens, stop = s[LOSS], s[TOKENS], s[STOP_AT]
    at_stop = base  # the reply's loss if it ends at draft `stop` (used when stop < n_ok; plain drafts cost 0)
    for t in range(int(min(stop + 1.0, n_ok))):
        at_stop += costs[t]
    m, loss, run, capped = -1, 0.0, 0.0, False
    for j in range(n_ok + 1):
        if j == n_ok or reason[j] == rescue:  # a place to end the round: before this rescue, or after the last
            if m < 0:  # the first one costs nothing: plain-accepted drafts only
                m = j
            elif run - loss <= s[G] * b * (j - m):  # worth its price
                if base + run <= b * (tokens + j + 1.0) and (stop >= j or at_stop <= b * (tokens + stop + 1.0)):
                    m, loss = j, run
                else:
                    capped = True
        if j < n_ok:
            run += costs[j]
    if m < n_ok:
        s[REFUSED] += 1.0
        s[CAPPED] += capped
    s[LOSS] += loss
    return m


@jit
def end_round(budget, emitted, n_drafts, accepted):
    """Count the round's tokens and drafts, record the threshold it used, and move g (and with it the threshold)
    for the next round."""
    if budget.bound < 0.0:
        return
    s = budget.state
    s[TOKENS] += emitted
    s[DRAFTED] += n_drafts
    s[ACCEPTED] += accepted
    s[ROUNDS] += 1.0
    s[TAU_SUM] += s[TAU]
    s[TAU_MIN] = min(s[TAU_MIN], s[TAU])
    s[TAU_MAX] = max(s[TAU_MAX], s[TAU])
    if budget.bound > 0.0:
        reserve = budget.bound * RESERVE_TOKENS
        if s[CHARGED] > 0.0:  # sampled: a slot is charged its loss whole, at times several tokens' worth; keep
            reserve = max(reserve, s[LOSS] / s[CHARGED])  # one typical charge, not less
        unspent = budget.bound * s[TOKENS] - s[LOSS]
        step = min(max((unspent - reserve) / reserve, -1.0), 1.0)
        s[G] = min(max(s[G] * math.exp(STEP * step), G_LO), G_HI)
        s[TAU] = min(s[TAU0] * s[G], TAU_HI)


def stop_at(budget: Budget, slot: int | None) -> None:
    """Before a round: the first draft of the round that ends the reply if emitted (end of generation, a stop
    string); None: none does."""
    budget.state[STOP_AT] = NO_STOP if slot is None else slot


def threshold(budget: Budget) -> float:
    """The threshold the rule uses this round."""
    return float(budget.state[TAU])


class Budgets:
    """The gain the controller settled on, per (mode, divergence, greedy or not, B): the next reply of the same
    kind starts from there instead of from G_START."""

    def __init__(self) -> None:
        self._last: dict[tuple, np.ndarray] = {}

    def copy(self) -> "Budgets":
        new = Budgets()
        new._last = {k: v.copy() for k, v in self._last.items()}
        return new

    def start(self, s, k: int) -> Budget:
        if s.quality_budget is None:
            return new_budget(None, k)
        key = (s.mode, s.divergence, s.temperature > 0, float(s.quality_budget))
        prev = self._last.get(key)
        tau0 = MODE_TAU_START.get(s.mode, TAU_START)
        # sampled, a first reply of this kind starts from a gain in proportion to B: from the modes' own
        # starting thresholds g climbs at most e^STEP a round, and a B of 0.5 spent most of a 96-token reply
        # getting there (F16 demo pair, chat's sampling: 4.32 tokens per target call, 4.48 from B / 0.1; with the
        # slot-by-slot charge B / 0.025 took wide B 0.2 4.55 -> 4.76: docs/measurements/budget-sampled.md).
        # Greedy starts at G_START: there the same start cost B 0.2 4.86 -> 4.64 on the same pair (its rounds
        # decide whole)
        g0 = max(G_START, float(s.quality_budget) / B_REF) if s.temperature > 0 else G_START
        budget = new_budget(s.quality_budget, k, tau0, g0 if prev is None else float(prev[G]))
        self._last[key] = budget.state
        return budget
