"""Every divergence kernel against the float64 NumPy reference, on random and adversarial rows."""

import math

import numpy as np
import pytest

from fsd_local.kernels import divergence as D
from fsd_local.kernels.rows import row_lse
from support.reference import divergence as reference

RTOL = 1e-4
ATOL = 1e-7  # for values that are exactly 0 in float64 (identical rows)


def close(a, b):
    if math.isinf(b):
        return a == b
    return abs(a - b) <= RTOL * abs(b) + ATOL


def rows(seed, n, scale=3.0, spread=0.5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * scale
    y = x + rng.standard_normal(n) * spread
    return x.astype(np.float32), y.astype(np.float32)


def adversarial_cases():
    n = 4096
    x, y = rows(1, n)
    one_hot = np.full(n, -np.inf, np.float32)
    one_hot[7] = 0.0
    masked_x = x.copy()
    masked_x[::3] = -np.inf  # target masks a third of the vocabulary
    masked_both = masked_x.copy()
    y_masked_same = y.copy()
    y_masked_same[::3] = -np.inf
    huge = (np.random.default_rng(2).standard_normal(n) * 1e4).astype(np.float32)
    near_one_hot = np.zeros(n, np.float32)
    near_one_hot[3] = 80.0
    return {
        "random": (x, y),
        "identical": (x, x.copy()),
        "one-hot same": (one_hot, one_hot.copy()),
        "one-hot vs random": (x, one_hot),  # draft puts all mass on one token, target spreads it
        "target masked": (masked_x, y),
        "both masked same": (masked_both, y_masked_same),
        "huge logits": (huge, huge[::-1].copy()),
        "huge vs small": (huge, y),
        "near one-hot": (near_one_hot, y),
        "constant rows": (np.zeros(n, np.float32), np.ones(n, np.float32)),
        "large offset": (x + np.float32(1e3), y - np.float32(1e3)),
    }


@pytest.mark.parametrize("name", D.DIVERGENCES)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n", [100, 49152])
def test_random_rows_match_reference(name, seed, n):
    x, y = rows(seed, n, spread=0.25 * (seed + 1))
    got, want = D.compute(name, x, y), reference(name, x, y)
    assert close(got, want), (got, want)


@pytest.mark.parametrize("name", D.DIVERGENCES)
@pytest.mark.parametrize("case", list(adversarial_cases()))
def test_adversarial_rows_match_reference(name, case):
    x, y = adversarial_cases()[case]
    got, want = D.compute(name, x, y), reference(name, x, y)
    assert not math.isnan(got)
    assert got >= 0.0
    assert close(got, want), (case, got, want)


@pytest.mark.parametrize("name", D.DIVERGENCES)
def test_identical_rows_are_exactly_zero(name):
    x, _ = rows(5, 3000)
    assert D.compute(name, x, x.copy()) == 0.0


@pytest.mark.parametrize("name", D.DIVERGENCES)
def test_nan_input_gives_nan_never_a_number(name):
    x, y = rows(6, 1000)
    x[10] = np.nan
    assert math.isnan(D.compute(name, x, y))
    assert math.isnan(D.compute(name, y, x))
    allinf = np.full(1000, -np.inf, np.float32)
    assert math.isnan(D.compute(name, allinf, y))


def test_js_bounded_by_ln2_and_paper_js_is_not():
    one = np.full(100, -np.inf, np.float32)
    two = one.copy()
    one[0] = 0.0
    two[1] = 0.0
    assert D.compute("js", one, two) == pytest.approx(math.log(2), rel=1e-5)
    x = np.full(100, -30.0, np.float32)
    y = x.copy()
    x[0], y[1] = 0.0, 0.0
    assert D.compute("paper-js", x, y) > math.log(2)  # the reference code's formula is unbounded


def test_topk_uses_the_target_top_k():
    x, y = rows(9, 2000)
    for k in (1, 5, 50, 2000):
        got = float(D.divergence(D.TOPK_KL, x, row_lse(x, 2000), y, row_lse(y, 2000), 2000, k))
        assert close(got, reference("topk-kl", x, y, topk=k))


def test_unknown_divergence_is_a_clear_error():
    from fsd_local.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown divergence 'hellinger'"):
        D.compute("hellinger", np.zeros(3, np.float32), np.zeros(3, np.float32))


@pytest.mark.parametrize("name", D.DIVERGENCES)
@pytest.mark.parametrize("n", [262144, 50021])  # Gemma 3's vocabulary; a size that leaves loop tails everywhere
def test_large_and_ragged_rows_match_reference(name, n):
    x, y = rows(11, n, spread=0.3)
    got, want = D.compute(name, x, y), reference(name, x, y)
    assert close(got, want), (got, want)
    x[n - 1] = np.nan  # in the last, partial block
    assert math.isnan(D.compute(name, x, y))


@pytest.mark.parametrize("name", D.DIVERGENCES)
def test_far_apart_partitions_keep_their_low_bits(name):
    """Rows whose log-partitions differ by 6e4: the float32 kernels carry each one as a high and a low part."""
    x, y = rows(12, 20000, spread=0.3)
    x, y = x + np.float32(3e4), y - np.float32(3e4)
    assert close(D.compute(name, x, y), reference(name, x, y))
