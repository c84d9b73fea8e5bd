"""The target-only lossy rules (typical, cascade, relaxed) and fsd-entropy, jitted, and `rescue`, every lossy
mode's decision at a slot. Each returns (rescued, critical tau); a masked or NaN token is never rescued
(docs/design.md, "The acceptance rules")."""

import math

import numpy as np
from numba import njit

from fsd_local.kernels.divergence import divergence
from fsd_local.kernels.jit_cache import jit
from fsd_local.kernels.names import CASCADE, FSD_ENTROPY, RELAXED, TYPICAL
from fsd_local.kernels.onehot import divergence_onehot
from fsd_local.kernels.rows import row_entropy, row_lse_wide, row_max
from fsd_local.kernels.topk import count_greater


@jit
def target_rule(mode, x, lx, d, n, tau, eps, alpha, k):
    """(rescued, critical tau) of `typical`, `cascade` or `relaxed` for draft token d against target row x[:n]
    with log-partition lx. eps in [0, 1), alpha >= 0, k >= 1 (settings check them)."""
    if not lx == lx or lx == -np.inf or lx == np.inf or d < 0 or d >= n:
        return False, np.nan
    xd = float(x[d])
    if not xd > -np.inf:
        return False, np.inf if xd == -np.inf else np.nan
    p = math.exp(min(xd - lx, 0.0))
    if mode == TYPICAL:
        h = row_entropy(x, n, lx)
        if not h == h:
            return False, np.nan
        m = min(eps, alpha * math.exp(-h))
        return p > 1.0 - tau * (1.0 - m), (1.0 - p) / (1.0 - m)
    xmax = float(row_max(x, n))
    if mode == CASCADE:  # p(d) / max p = exp(x[d] - max x), exact without the partition
        ratio = math.exp(min(xd - xmax, 0.0))
        return ratio >= 1.0 - tau, 1.0 - ratio
    if mode == RELAXED:
        if count_greater(x, n, x[d]) >= k:  # rank of d: tokens strictly above it (ties count for d)
            return False, np.inf
        pmax = math.exp(min(xmax - lx, 0.0))
        return p >= pmax - tau, max(pmax - p, 0.0)
    return False, np.nan


@jit
def uncertainty(x, lx, n):
    """1 - exp(-H(p)) = 1 - 1/perplexity of the target's distribution: in [0, 1), 0 for a one-hot p, 1/2 for a
    fair coin, 1 - 1/N for N equally likely tokens. NaN on bad input."""
    h = row_entropy(x, n, lx)
    return -math.expm1(-h) if h == h else np.nan


@jit
def entropy_scaled(dv, x, lx, n, tau):
    """(rescued, critical tau) of `fsd-entropy`: divergence dv against the threshold tau (1 - exp(-H(p)))."""
    g = uncertainty(x, lx, n)
    if not (g == g and dv == dv):
        return False, np.nan
    crit = dv / g if g > 0.0 else (0.0 if dv == 0.0 else np.inf)
    return dv <= tau * g, crit


@njit(inline="always")
def target_only(mode):
    """Whether the mode's rescue reads the target's distribution alone (typical, cascade, relaxed): it rescues some
    tokens of a slot and not others, where a divergence rule rescues whatever was drafted at a slot that passes."""
    return mode == TYPICAL or mode == CASCADE or mode == RELAXED


@jit
def rescue(rule, x, lx, y, onehot, d, n, tau):
    """(rescued, value) of a lossy rule at a slot whose SD test failed (fsd-paper: every slot): value is the
    divergence compared with tau, or for the target-only rules the smallest tau that rescues d. NaN never rescues."""
    mode = rule.mode
    if target_only(mode):  # the target's distribution alone
        return target_rule(mode, x, lx, d, n, tau, rule.typical_eps, rule.typical_alpha, rule.relaxed_k)
    if onehot:
        dv = divergence_onehot(rule.divergence, x, lx, d, n, rule.divergence_topk)
    else:
        dv = divergence(rule.divergence, x, lx, y, row_lse_wide(y, n), n, rule.divergence_topk)
    if mode == FSD_ENTROPY:
        return entropy_scaled(dv, x, lx, n, tau)
    return dv <= tau, dv  # NaN compares False: never accepts
