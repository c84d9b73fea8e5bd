"""The carry kernels (kernels/carry.py) against their float64 reference (tests/support/reference_carry.py) on
random and adversarial rows and maps, and on the real map from SmolLM2's vocabulary to Gemma 3's."""

from __future__ import annotations

import numpy as np
import pytest

from fsd_local.kernels import divergence as D
from fsd_local.kernels.carry import carried_argmax, carry_row, prepare
from fsd_local.kernels.rows import row_lse
from fsd_local.llama.vocab_map import primary_of, split_map
from support import reference as R
from support.reference_carry import carried_logits, carried_probs


def random_map(rng, n_draft: int, n_target: int, shared: float, dup: float = 0.02) -> np.ndarray:
    """target_of: a share of the draft's tokens carried to distinct target tokens, a few more to already used
    ones (duplicate pieces, several ends of generation)."""
    target_of = np.full(n_draft, -1, np.int32)
    k = int(min(n_draft, n_target) * shared)
    src = rng.choice(n_draft, k, replace=False)
    target_of[src] = rng.choice(n_target, k, replace=False)
    rest = np.flatnonzero(target_of < 0)
    if k and rest.size:
        dups = rng.choice(rest, max(1, int(rest.size * dup)), replace=False)
        target_of[dups] = rng.choice(target_of[src], dups.size)
    return target_of


def carried(row, target_of, n_target, out=None):
    """carry_row into a prepared buffer (or `out`, already used for another row of the same map)."""
    draft_of, extra = split_map(target_of, n_target)
    if out is None:
        out = np.empty(n_target, np.float32)
        prepare(out)
    t = np.flatnonzero(draft_of >= 0).astype(np.int32)
    carry_row(np.ascontiguousarray(row, np.float32), t, draft_of[t], extra, out)
    return out, draft_of, extra


ROWS = {
    "normal": lambda rng, n: (rng.standard_normal(n) * 3).astype(np.float32),
    "peaked": lambda rng, n: (rng.standard_normal(n) * 12).astype(np.float32),
    "masked": lambda rng, n: np.where(rng.random(n) < 0.7, -np.inf, rng.standard_normal(n) * 3).astype(np.float32),
    "ties": lambda rng, n: np.round(rng.standard_normal(n)).astype(np.float32),
    "huge": lambda rng, n: (rng.standard_normal(n) * 3 + 80).astype(np.float32),
}


@pytest.mark.parametrize("kind", list(ROWS))
@pytest.mark.parametrize(("n_draft", "n_target", "shared"), [(7, 11, 0.6), (300, 200, 0.9), (49152, 262144, 0.94)])
def test_carried_rows_are_the_reference_distribution(kind, n_draft, n_target, shared):
    rng = np.random.default_rng(n_draft + len(kind))
    target_of = random_map(rng, n_draft, n_target, shared)
    before, _, _ = carried(ROWS["peaked"](rng, n_draft), target_of, n_target)  # the buffer carried a row before
    row = ROWS[kind](rng, n_draft)
    out, draft_of, extra = carried(row, target_of, n_target, before)
    want = carried_logits(row, target_of, n_target)
    assert np.array_equal(np.isneginf(out), np.isneginf(want))  # exactly the tokens nothing is carried to
    single = draft_of >= 0
    single[extra[:, 0]] = False
    assert np.array_equal(out[single], row[draft_of[single]])  # one draft token: its logit, bit for bit
    # several: their log-sum in float32, within two units in the last place of the largest term (the sum
    # of exp(hi) and exp(lo) is formed as hi + log1p(exp(lo - hi)), each step rounded to float32)
    for t in np.unique(extra[:, 0]).tolist():
        terms = row[target_of == t].astype(np.float64)
        if np.isfinite(want[t]):
            scale = max(np.abs(terms[np.isfinite(terms)]).max(), abs(want[t]), 1.0)
            assert abs(out[t] - want[t]) <= 2 * np.spacing(np.float32(scale)), (t, terms, out[t], want[t])
    got_p = np.exp(R.log_softmax(out)) if np.isfinite(out).any() else np.zeros(n_target)
    want_p = carried_probs(row, target_of, n_target)
    # each float32 logit carries a relative rounding of 2^-24 of its size into its probability
    rtol = 4 * 2.0**-24 * float(np.max(np.abs(row[np.isfinite(row)]), initial=1.0)) + 2e-7
    np.testing.assert_allclose(got_p, want_p, rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("kind", list(ROWS))
@pytest.mark.parametrize(("n_draft", "n_target"), [(5, 9), (300, 200), (49152, 262144)])
def test_the_carried_argmax_is_the_argmax_of_the_carried_row(kind, n_draft, n_target):
    rng = np.random.default_rng(n_draft * 3 + len(kind))
    for trial in range(4):
        target_of = random_map(rng, n_draft, n_target, (0.3, 0.9, 1.0, 0.05)[trial], dup=0.2)
        row = ROWS[kind](rng, n_draft)
        out, draft_of, extra = carried(row, target_of, n_target)
        got = int(carried_argmax(row, primary_of(target_of, draft_of), draft_of, extra))
        if not np.isfinite(out).any():
            assert got == -1
            continue
        want = carried_probs(row, target_of, n_target)
        best = np.flatnonzero(want == want.max())
        assert got in best.tolist(), (trial, got, best[:5])


def test_rows_without_anything_to_carry():
    target_of = np.array([-1, 2, -1, 0], np.int32)
    row = np.array([5.0, -np.inf, 3.0, -np.inf], np.float32)
    out, draft_of, extra = carried(row, target_of, 4)
    assert np.all(np.isneginf(out))
    assert carried_argmax(row, primary_of(target_of, draft_of), draft_of, extra) == -1
    empty = np.full(3, -1, np.int32)
    out, draft_of, extra = carried(np.zeros(3, np.float32), empty, 6)
    assert np.all(np.isneginf(out)) and extra.shape == (0, 2)


def test_a_nan_stays_a_nan_where_it_is_carried():
    target_of = np.array([0, 1, 1, -1], np.int32)
    row = np.array([1.0, np.nan, 2.0, np.nan], np.float32)
    out, _, _ = carried(row, target_of, 3)
    assert out[0] == 1.0 and np.isnan(out[1]) and np.isneginf(out[2])


@pytest.mark.parametrize("name", D.DIVERGENCES)
def test_divergences_of_a_carried_row_are_the_reference(name):
    """p over the target's vocabulary against q' that is zero on the target's own tokens: the kernels stay
    finite where the definition is (js, tv, rkl and their top-k forms) and are +inf where it is not (kl: p has
    mass off the shared tokens)."""
    rng = np.random.default_rng(5)
    n_draft, n_target = 3000, 16000
    target_of = random_map(rng, n_draft, n_target, 0.9)
    x = (rng.standard_normal(n_target) * 3).astype(np.float32)
    out, _, _ = carried((rng.standard_normal(n_draft) * 3).astype(np.float32), target_of, n_target)
    got = float(D.divergence(D.divergence_id(name), x, row_lse(x, n_target), out, row_lse(out, n_target), n_target, 50))
    want = R.divergence(name, x, out)
    assert not np.isnan(got)
    # what docs/design.md says of each divergence where the supports differ
    assert np.isinf(got) == (name in ("kl", "paper-js")) or name == "topk-kl"
    if np.isinf(want):
        assert got == want
    else:
        assert abs(got - want) <= 1e-4 * abs(want) + 5e-8, (got, want)
