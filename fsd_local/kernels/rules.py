"""The lossy acceptance rules beyond FSD's divergence threshold (docs/design.md, "The acceptance rules"), jitted,
and `rescue`, every lossy mode's decision at a slot (the divergence rules' and these).
Each one only rescues a draft token d that the lossless SD test rejected, and each reads the target's distribution
at that slot, p = softmax of the raw logit row x at temperature 1 (as the divergences do, so a rule acts the same at
every sampling temperature), given lx = row_lse(x):

- `typical` (Medusa): m = min(eps, a exp(-H(p))); rescue iff p(d) > 1 - tau (1 - m)  (tau = 1: Medusa's rule)
- `cascade` (SpecCascades' token rule): rescue iff p(d) >= (1 - tau) max p
- `relaxed` (TensorRT-LLM): rescue iff d is among the target's top k and p(d) >= max p - tau
- `fsd-entropy`: FSD's divergence test with the threshold scaled by the target's uncertainty,
  D <= tau (1 - exp(-H(p))): 1 - 1/perplexity, 0 where the target is sure, towards 1 where it is unsure.

Every function returns (rescued, critical tau): the smallest tau at which the rule rescues d (for fsd that is the
divergence itself), which the acceptance kernel records in place of the divergence. A token whose target logit is
-inf (masked: p(d) = 0) is never rescued, whatever tau (critical tau +inf); NaN input never rescues (critical tau
NaN). Each rule costs O(1) after row_lse, plus one vectorised pass: the entropy (typical, fsd-entropy), the row max
(cascade, relaxed) and the rank count (relaxed).
"""

import math

import numpy as np
from numba import njit

from fsd_local.kernels import jit_cache  # noqa: F401  (sets numba's cache directory before any kernel is defined)
from fsd_local.kernels.divergence import divergence
from fsd_local.kernels.names import CASCADE, FSD_ENTROPY, RELAXED, TYPICAL
from fsd_local.kernels.onehot import divergence_onehot
from fsd_local.kernels.rows import row_entropy, row_lse_wide, row_max
from fsd_local.kernels.topk import count_greater


@njit(cache=True)
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


@njit(cache=True)
def uncertainty(x, lx, n):
    """1 - exp(-H(p)) = 1 - 1/perplexity of the target's distribution: in [0, 1), 0 for a one-hot p, 1/2 for a
    fair coin, 1 - 1/N for N equally likely tokens. NaN on bad input."""
    h = row_entropy(x, n, lx)
    return -math.expm1(-h) if h == h else np.nan


@njit(cache=True)
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


@njit(cache=True)
def rescue(rule, x, lx, y, onehot, d, n, tau):
    """(rescued, value) of a lossy rule at a slot whose SD test failed (fsd-paper: at every slot): draft token d,
    target row x with log-partition lx, draft row y (one-hot on d for prompt lookup). value is the divergence
    compared with tau, or for the target-only rules (above) the smallest tau that rescues d. NaN never
    rescues."""
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
