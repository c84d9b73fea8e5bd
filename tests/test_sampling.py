"""Processed distributions (temperature, top-k, top-p, min-p), draws from them, and the acceptance kernel on
fixed rows: monotone in tau, NaN never accepted."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from fsd_local.kernels import sampling as S
from fsd_local.kernels.accept import (
    BY_FUZZY,
    BY_SD,
    FSD,
    FSD_PAPER,
    SD,
    Drafts,
    Rule,
    Sampling,
    accept_round,
    round_out,
)
from fsd_local.kernels.budget import new_budget
from fsd_local.kernels.divergence import DIVERGENCES
from support.rounds import random_round

ALPHA = 1e-3  # false-alarm rate of every statistical test in this file


def reference_processed(x, t, top_k, top_p, min_p):
    """p~ in float64 the plain way: temperature, then top-k, top-p (over the top-k set), min-p."""
    z = x.astype(np.float64) / t
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    kk = top_k if top_k > 0 else len(p)
    keep[order[:kk]] = True
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        cum = np.cumsum(q[order])
        last = int(np.searchsorted(cum, top_p * (1 - 1e-12)))
        nucleus = np.zeros_like(keep)
        nucleus[order[: last + 1]] = True
        keep &= nucleus
    if min_p > 0:
        keep &= p >= min_p * p.max()
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def processed_probs(x, t, top_k, top_p, min_p):
    n = len(x)
    mx, cut, lz = S.processed(x, n, t, top_k, top_p, min_p)
    return np.array([S.prob(x, i, t, mx, cut, lz) for i in range(n)])


CONFIGS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.0, 5, 1.0, 0.0),
    (1.0, 0, 0.9, 0.0),
    (0.8, 0, 0.5, 0.0),
    (1.0, 0, 1.0, 0.05),
    (0.6, 20, 0.8, 0.02),
    (2.0, 3, 0.95, 0.1),
    (1.0, 1, 1.0, 0.0),
]


@pytest.mark.parametrize("t,top_k,top_p,min_p", CONFIGS)
@pytest.mark.parametrize("n", [50, 5000])
def test_processed_distribution_matches_reference(t, top_k, top_p, min_p, n):
    x = (np.random.default_rng(n).standard_normal(n) * 2).astype(np.float32)
    got = processed_probs(x, t, top_k, top_p, min_p)
    want = reference_processed(x, t, top_k, top_p, min_p)
    assert np.all((got > 0) == (want > 0)), "kept sets differ"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("t,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.7, 5, 0.9, 0.0), (1.3, 0, 0.8, 0.05)])
def test_draws_follow_the_processed_distribution(t, top_k, top_p, min_p):
    n = 40
    x = (np.random.default_rng(3).standard_normal(n) * 1.5).astype(np.float32)
    p = reference_processed(x, t, top_k, top_p, min_p)
    mx, cut, lz = S.processed(x, n, t, top_k, top_p, min_p)
    us = np.random.default_rng(4).random(20000)
    counts = np.bincount([S.sample(x, n, t, mx, cut, lz, u) for u in us], minlength=n)
    assert counts[p == 0].sum() == 0, "drew a token outside the kept set"
    kept = p > 0
    assert sps.chisquare(counts[kept], p[kept] * len(us)).pvalue > ALPHA


def test_residual_draws_follow_max_p_minus_q():
    n = 30
    rng = np.random.default_rng(5)
    x = rng.standard_normal(n).astype(np.float32)
    y = (x + rng.standard_normal(n)).astype(np.float32)
    px = np.array(S.processed(x, n, 1.0, 0, 1.0, 0.0), np.float32)
    py = np.array(S.processed(y, n, 1.0, 0, 1.0, 0.0), np.float32)
    r = np.maximum(reference_processed(x, 1.0, 0, 1.0, 0.0) - reference_processed(y, 1.0, 0, 1.0, 0.0), 0)
    r /= r.sum()
    us = rng.random(20000)
    counts = np.bincount([S.sample_residual(x, y, n, 1.0, px, py, u) for u in us], minlength=n)
    assert counts[r == 0].sum() == 0
    assert sps.chisquare(counts[r > 0], r[r > 0] * len(us)).pvalue > ALPHA


def run_accept(P, Q, drafts, mode, div, tau, temperature=0.0, uniforms=None):
    k = len(drafts)
    n = P.shape[1]
    q_stats = np.zeros((k + 1, 3), np.float32)
    q_prob = np.ones(k)
    if temperature > 0:
        for i in range(k):
            mx, cut, lz = S.processed(Q[i], n, temperature, 0, 1.0, 0.0)
            q_stats[i] = (mx, cut, lz)
            q_prob[i] = S.prob(Q[i], drafts[i], temperature, mx, cut, lz)
    out = round_out(k)
    us = np.zeros(k + 1) if uniforms is None else uniforms
    draft = Drafts(
        rows=Q, tokens=np.asarray(drafts, np.int32), prob=q_prob, stats=q_stats, onehot=np.zeros(k, np.uint8)
    )
    acc, nxt = accept_round(
        P,
        draft,
        k,
        n,
        Rule(mode, DIVERGENCES.index(div), float(tau), 50),
        Sampling(float(temperature), 0, 1.0, 0.0),
        us,
        out,
        new_budget(None, k),
    )
    return acc, nxt, out.reason.copy(), out.divergence.copy(), out.logprob.copy()


@pytest.mark.parametrize("div", DIVERGENCES)
@pytest.mark.parametrize("mode", [FSD, FSD_PAPER])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_accepted_slots_only_grow_with_tau(div, mode, temperature):
    taus = [0.0, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 2.0, 5.0]
    for seed in range(8):
        P, Q, drafts = random_round(seed, spread=0.3 + 0.2 * seed)
        us = np.random.default_rng(seed).random(len(drafts) + 1)
        prev = -1
        for tau in taus:
            acc, *_ = run_accept(P, Q, drafts, mode, div, tau, temperature, us)
            assert acc >= prev, (seed, tau)
            prev = acc


def test_fsd_rescues_only_where_sd_failed_and_sd_never_rescues():
    P, Q, drafts = random_round(1, spread=0.8)
    acc0, _, reason0, divs0, _ = run_accept(P, Q, drafts, FSD, "js", 0.0)
    assert np.all(np.isnan(divs0)), "tau = 0 computes no divergence: it is exactly SD"
    acc, _, reason, divs, _ = run_accept(P, Q, drafts, FSD, "js", 10.0)
    assert acc == len(drafts)
    for i in range(acc):
        agrees = drafts[i] == int(np.argmax(P[i]))
        assert reason[i] == (BY_SD if agrees else BY_FUZZY)
        assert np.isnan(divs[i]) == agrees, "divergence computed lazily: only where the SD test failed"
    acc_sd, _, reason_sd, _, _ = run_accept(P, Q, drafts, SD, "js", 10.0)
    assert acc_sd == acc0 and not np.any(reason_sd == BY_FUZZY)


def test_nan_rows_never_accept():
    P, Q, drafts = random_round(2)
    drafts = [(int(np.argmax(P[i])) + 1) % P.shape[1] for i in range(len(drafts))]  # SD test fails everywhere
    P[0, 5] = np.nan
    for div in DIVERGENCES:
        acc, _, reason, divs, _ = run_accept(P, Q, drafts, FSD, div, 1e9)
        assert acc == 0 and reason[0] == 0 and math.isnan(divs[0])
        acc, *_ = run_accept(P, Q, drafts, FSD_PAPER, div, 1e9)
        assert acc == 0


def test_logprobs_are_the_targets_raw_log_probabilities():
    P, Q, drafts = random_round(3, spread=0.2)
    acc, nxt, _, _, lps = run_accept(P, Q, drafts, FSD, "kl", 0.5)
    emitted = drafts[:acc] + [nxt]
    for j, tok in enumerate(emitted):
        row = P[j].astype(np.float64)
        want = row[tok] - (row.max() + np.log(np.exp(row - row.max()).sum()))
        assert lps[j] == pytest.approx(want, abs=1e-4)
