"""Top-k selection (kernels/topk.py) against a stable argsort of the whole row."""

import numpy as np
import pytest

from fsd_local.kernels import topk as T


def cases():
    rng = np.random.default_rng(3)
    for trial in range(120):
        n = int(rng.integers(1, 5000))
        k = int(rng.integers(1, 150))
        x = rng.standard_normal(n).astype(np.float32)
        kind = trial % 5
        if kind == 1:
            x = np.round(x * 2).astype(np.float32)  # many ties: lower index first
        elif kind == 2:
            x[rng.random(n) < 0.95] = -np.inf  # mostly masked, often fewer than k finite entries
        elif kind == 3:
            x = np.where(rng.random(n) < 0.5, np.float32(0.0), np.float32(-0.0))  # +0 and -0 tie
        elif kind == 4:
            x[rng.integers(0, n)] = 50.0  # one dominant token
        yield x, k


@pytest.mark.parametrize("x,k", list(cases()))
def test_top_indices_is_a_stable_sort_of_the_top(x, k):
    want = np.argsort(-x.astype(np.float64), kind="stable")[:k]
    assert np.array_equal(T.top_indices(x, x.shape[0], k), want)


def test_gather_sorted_takes_everything_at_or_above_the_threshold():
    x = np.random.default_rng(4).standard_normal(10000).astype(np.float32)
    for t in (np.float32(2.5), np.float32(0.0), np.float32(-np.inf), np.float32(9.0)):
        got = T.gather_sorted(x, x.shape[0], t)
        want = np.argsort(-x.astype(np.float64), kind="stable")[: int((x >= t).sum())]
        assert np.array_equal(got, want)


def test_top_indices_uses_only_the_first_n_entries():
    x = np.arange(1000, dtype=np.float32)
    assert list(T.top_indices(x, 100, 3)) == [99, 98, 97]
