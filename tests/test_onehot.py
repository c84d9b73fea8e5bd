"""The divergences of a target row against a one-hot draft distribution (kernels/onehot.py, what prompt lookup's
drafts are scored with) against the float64 references (tests/support/reference_onehot.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fsd_local.kernels import divergence as D
from fsd_local.kernels import onehot as O
from fsd_local.kernels.rows import row_lse
from support import reference_onehot as R

RTOL = 1e-4
ATOL = 1e-7
FULL = ("js", "kl", "rkl", "tv", "paper-js")


def close(a, b, rtol=RTOL, atol=ATOL):
    if math.isinf(b) or math.isinf(a):
        return a == b
    return abs(a - b) <= rtol * abs(b) + atol


def general_kernel(name, x, d, topk=D.TOPK_DEFAULT):
    """The general float32 kernel on an exact one-hot draft row."""
    x = np.ascontiguousarray(x, np.float32)
    n = x.shape[0]
    y = R.onehot_row(n, d)
    return float(D.divergence(D.divergence_id(name), x, row_lse(x, n), y, row_lse(y, n), n, topk))


def logits(seed, n, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def tokens_to_test(x):
    """The target's favourite, a typical token, its least likely one."""
    order = np.argsort(-x.astype(np.float64), kind="stable")
    return [int(order[0]), int(order[min(3, len(x) - 1)]), int(order[len(x) // 2]), int(order[-1])]


@pytest.mark.parametrize("name", D.DIVERGENCES)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("n", [100, 49152])
def test_onehot_random_rows_match_the_float64_reference(name, seed, n):
    x = logits(seed, n, scale=(1.0, 3.0, 8.0)[seed])
    for d in tokens_to_test(x):
        got, want = O.compute_onehot(name, x, d), R.divergence(name, x, d)
        assert close(got, want), (d, got, want)
        assert close(got, general_kernel(name, x, d), atol=1e-6), d


@pytest.mark.parametrize("name", FULL)
@pytest.mark.parametrize("seed", range(3))
def test_closed_forms_equal_the_general_reference(name, seed):
    """The derivation itself, in float64 on both sides."""
    x = logits(seed, 500, scale=4.0)
    for d in tokens_to_test(x):
        assert close(R.closed_form(name, x, d), R.divergence(name, x, d), rtol=1e-9, atol=1e-12)


def onehot_adversarial():
    n = 4096
    x = logits(7, n)
    masked = x.copy()
    masked[::3] = -np.inf
    only_d = np.full(n, -np.inf, np.float32)
    only_d[5] = 1.5
    sure = np.zeros(n, np.float32)
    sure[5] = 60.0  # p(5) = 1 - 4095 e^-60: float32 and float64 both see the off-d mass
    never = np.zeros(n, np.float32)
    never[5] = -1e4  # p(5) underflows to 0 in float64 too
    huge = logits(8, n) * np.float32(1e4)
    return {
        # name: (row, token)
        "random, d likely": (x, int(np.argmax(x))),
        "d masked": (masked, 0),
        "others masked, d kept": (masked, 1),
        "p(d) = 1 exactly": (only_d, 5),
        "d masked, one-hot target elsewhere": (only_d, 6),
        "p(d) ~ 1": (sure, 5),
        "p(d) ~ 1, d elsewhere": (sure, 6),
        "p(d) underflows": (never, 5),
        "huge logits, top": (huge, int(np.argmax(huge))),
        "huge logits, other": (huge, 11),
        "large offset": (x + np.float32(1e3), 3),
        "constant row": (np.zeros(n, np.float32), 9),
    }


@pytest.mark.parametrize("name", D.DIVERGENCES)
@pytest.mark.parametrize("case", list(onehot_adversarial()))
def test_onehot_adversarial_rows(name, case):
    x, d = onehot_adversarial()[case]
    got = O.compute_onehot(name, x, d)
    assert not math.isnan(got)
    assert got >= 0.0
    assert close(got, R.divergence(name, x, d)), (got, R.divergence(name, x, d))
    assert close(got, general_kernel(name, x, d), atol=1e-6), (got, general_kernel(name, x, d))


def test_onehot_known_values():
    n = 64
    only_d = np.full(n, -np.inf, np.float32)
    only_d[5] = 0.0
    for name in D.DIVERGENCES:  # the target is the one-hot itself: every divergence is exactly 0
        assert O.compute_onehot(name, only_d, 5) == 0.0, name
    # d masked: disjoint supports
    assert O.compute_onehot("tv", only_d, 6) == 1.0
    assert O.compute_onehot("js", only_d, 6) == pytest.approx(math.log(2), rel=1e-12)
    for name in ("rkl", "kl", "paper-js", "topk-kl"):
        assert O.compute_onehot(name, only_d, 6) == math.inf, name
    # uniform target: P = 1/n
    u = np.zeros(n, np.float32)
    assert O.compute_onehot("tv", u, 3) == pytest.approx(1 - 1 / n, rel=1e-6)
    assert O.compute_onehot("rkl", u, 3) == pytest.approx(math.log(n), rel=1e-6)
    assert O.compute_onehot("kl", u, 3) == math.inf  # kl never rescues an n-gram token
    assert O.compute_onehot("paper-js", u, 3) == math.inf


def test_onehot_js_is_bounded_and_falls_as_p_d_rises():
    vals = []
    for lp in np.linspace(-40, 0, 401):
        v = float(O.js_of_logprob(lp))
        assert 0.0 <= v <= math.log(2) + 1e-15
        vals.append(v)
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    assert O.js_of_logprob(0.0) == 0.0
    assert float(O.js_of_logprob(-np.inf)) == pytest.approx(math.log(2), rel=1e-15)
    e = 1e-12  # near p(d) = 1 the closed form keeps its precision: JS = e ln2 / 2 + O(e^2)
    assert float(O.js_of_logprob(math.log1p(-e))) == pytest.approx(e * math.log(2) / 2, rel=1e-6)


def test_onehot_float32_underflow_case_is_the_documented_difference():
    """Off-d log-probabilities in (-745, -87.3): float64 sees mass (kl = inf), float32 does not (kl = 0),
    and the kernel follows the general float32 kernel, as documented."""
    x = np.zeros(100, np.float32)
    x[5] = 200.0
    assert R.divergence("kl", x, 5) == math.inf
    assert O.compute_onehot("kl", x, 5) == general_kernel("kl", x, 5) == 0.0
    assert O.compute_onehot("paper-js", x, 5) == general_kernel("paper-js", x, 5) == 0.0


@pytest.mark.parametrize("k", [1, 2, 5, 50, 99, 100, 500])
def test_onehot_topk_with_d_inside_and_outside_the_top_k(k):
    x = logits(11, 100)
    order = np.argsort(-x.astype(np.float64), kind="stable")
    for d in (int(order[0]), int(order[min(k, 99) - 1]), int(order[min(k, 99)]), int(order[-1])):
        for name in ("topk-js", "topk-kl", "topk-tv"):
            got = float(O.divergence_onehot(D.divergence_id(name), x, row_lse(x, 100), d, 100, k))
            assert close(got, R.divergence(name, x, d, topk=k)), (name, d, got)


def test_onehot_topk_ties_and_masked_rows():
    x = np.zeros(300, np.float32)  # all tied: top-k is the lowest indices, like the reference
    x[200:] = -np.inf
    for d in (0, 49, 50, 150, 250):
        for name in ("topk-js", "topk-kl", "topk-tv"):
            assert close(O.compute_onehot(name, x, d), R.divergence(name, x, d)), (name, d)


@pytest.mark.parametrize("name", D.DIVERGENCES)
def test_onehot_nan_and_bad_input_give_nan(name):
    x = logits(12, 1000)
    x[10] = np.nan
    assert math.isnan(O.compute_onehot(name, x, 3))
    assert math.isnan(O.compute_onehot(name, x, 10))
    assert math.isnan(O.compute_onehot(name, np.full(50, -np.inf, np.float32), 3))
    y = logits(13, 50)
    lx = row_lse(y, 50)
    kind = D.divergence_id(name)
    assert math.isnan(O.divergence_onehot(kind, y, lx, -1, 50, 5))
    assert math.isnan(O.divergence_onehot(kind, y, lx, 50, 50, 5))
