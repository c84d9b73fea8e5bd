"""kernels/dense.py (a round whose rows are untruncated: a temperature alone) against the float64 references of
tests/support/reference_dense.py, on random rows of every size (one core below dense.PARALLEL_MIN, every core
above), adversarial rows (ties, masked tokens and blocks, NaN, +inf, huge spreads, temperature extremes) and
recorded 262,144-token rows of Gemma 3 270M; and the sampling entry points that use it against the plain
whole-row functions of kernels/sampling.py, which define the same distributions."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from fsd_local.kernels import dense as D
from fsd_local.kernels import sampling as S
from fsd_local.kernels.budget import rescue_floor
from fsd_local.kernels.names import CASCADE, FSD, FSD_PAPER, RELAXED, TYPICAL
from support import reference_dense as R

ALPHA = 1e-3  # false-alarm rate of each statistical test
TEMPERATURES = (0.05, 0.7, 1.0, 5.0)


@pytest.fixture(scope="module")
def gemma_rows(gemma_path):
    """Six consecutive next-token rows of Gemma 3 270M (vocabulary 262,144) on a plain sentence."""
    from fsd_local.llama.model import Model
    from fsd_local.llama.options import ModelOptions

    m = Model(ModelOptions(path=gemma_path, n_ctx=128, n_threads=2), "target")
    try:
        toks = m.tokenize("Rain falls on the hills and runs down to the")
        m.decode(toks, f"from:{len(toks) - 6}")
        return np.array(m.logits(6), copy=True)
    finally:
        m.close()


def _random_rows():
    """(name, row): sizes on both sides of PARALLEL_MIN and of one block, and the adversarial shapes."""
    rng = np.random.default_rng(0)
    out = []
    for n in (7, 50, 1500, 5000, 70_000):
        x = (rng.standard_normal(n) * 3).astype(np.float32)
        out.append((f"normal {n}", x))
        ties = np.round(x).astype(np.float32)  # many exact ties, the max among them
        out.append((f"ties {n}", ties))
        masked = x.copy()
        masked[rng.random(n) < 0.5] = -np.inf
        masked[0] = 1.0  # never all masked
        out.append((f"half masked {n}", masked))
    wide = (rng.standard_normal(70_000) * 3).astype(np.float32)
    wide[: 3 * 1024] = -np.inf  # whole blocks masked
    wide[40_000:41_500] = -np.inf
    out.append(("masked blocks 70000", wide))
    out.append(("huge spread", (rng.standard_normal(70_000) * 400).astype(np.float32)))
    out.append(("one token", np.array([3.5], np.float32)))
    out.append(("flat 70000", np.zeros(70_000, np.float32)))
    return out


ROWS = _random_rows()


def _summary(x, t, raw=True):
    s = D.new_summaries(1)[0]
    y = np.full(x.shape[0] + 2, np.float32(9.0))
    got = D.summarise(x, x.shape[0], 1.0 / t, raw, s, y, True)
    assert np.array_equal(y[: x.shape[0]], x, equal_nan=True) and (y[x.shape[0] :] == 9.0).all()  # the copy only
    return got, s


@pytest.mark.parametrize("t", TEMPERATURES)
@pytest.mark.parametrize(("name", "x"), ROWS, ids=[n for n, _ in ROWS])
def test_the_summary_is_the_processed_distribution(name, x, t):
    """(M, lz) describe p~ = softmax(x / T) exactly as sampling.py's triple does, and the raw log-partition is
    the row's, to float32 rounding per exp."""
    (mx, lz, l1, ok), _ = _summary(x, t)
    assert ok and mx == x.max()
    z = (x.astype(np.float64) - float(mx)) / t
    assert lz == pytest.approx(float(np.log(np.exp(z).sum())), rel=1e-6, abs=2e-6)
    assert l1 == pytest.approx(R.raw_lse(x), rel=1e-6, abs=2e-6)
    i = int(np.argmax(x))
    assert S.prob(x, i, t, mx, -np.inf, lz) == pytest.approx(R.processed(x, t)[i], rel=2e-6)


def _variants(x):
    """A recorded row as it is and made adversarial: ties (rounded to halves: the max tied many times), masked
    tokens (half of them at random, and whole blocks: a grammar's mask or a logit bias of -inf)."""
    rng = np.random.default_rng(11)
    ties = np.round(x * 2) / 2
    masked = x.copy()
    masked[rng.random(x.shape[0]) < 0.5] = -np.inf
    masked[int(np.argmax(x))] = x.max()
    blocks = x.copy()
    blocks[: 40 * 1024] = -np.inf
    blocks[100_000:200_000] = -np.inf
    return {"as recorded": x, "ties": ties.astype(np.float32), "half masked": masked, "masked blocks": blocks}


@pytest.mark.parametrize("t", TEMPERATURES)
@pytest.mark.parametrize("variant", ["as recorded", "ties", "half masked", "masked blocks"])
def test_recorded_rows_summaries_draws_and_losses(gemma_rows, variant, t):
    """Gemma's 262,144-token rows, as recorded and made adversarial, at every temperature from 0.05 to 5: the
    summary is p~'s (max, normaliser) and the raw log-partition; a draw is the float64 inverse CDF at its
    uniform; the residual's draw too; the loss of a rescue is the float64 definition's."""
    rng = np.random.default_rng(12)
    n = gemma_rows.shape[1]
    x, y = (_variants(np.ascontiguousarray(r))[variant] for r in gemma_rows[2:4])
    (mx, lz, l1, ok), s = _summary(x, t)
    (my, lzy, _, _), _ = _summary(y, t, raw=False)
    assert ok and mx == x.max() and l1 == pytest.approx(R.raw_lse(x), rel=1e-6, abs=2e-6)
    z = (x.astype(np.float64) - float(mx)) / t
    assert lz == pytest.approx(float(np.log(np.exp(z).sum())), rel=1e-6, abs=2e-6)
    px, py = np.array([mx, -np.inf, lz], np.float32), np.array([my, -np.inf, lzy], np.float32)
    p, r = R.processed(x, t), R.residual(x, y, t)
    masses = np.zeros(D.SUMMARY_BLOCKS, np.float32)
    for u in rng.random(8):
        assert _inverse_cdf_holds(p, D.draw(x, n, 1.0 / t, mx, s, u), u)
        assert _inverse_cdf_holds(r, D.residual_draw(x, y, n, t, px, py, u, masses), u)
    got, want = _loss(FSD, x, y, t, 0.3), R.sampled_loss(FSD, x, y, t, 0.3)
    assert _close(got[0], want[0], rel=1e-3) and _close(got[1], want[1], rel=1e-3)


@pytest.mark.parametrize("bad", ["nan", "negative nan", "+inf", "all masked"])
@pytest.mark.parametrize("n", [40, 70_000, "recorded"])
def test_rows_the_summary_cannot_hold_go_to_the_plain_path(gemma_rows, bad, n):
    """A NaN (either sign), +inf or a row with every token masked, in random rows and a recorded Gemma row: the
    summary says so, and pick_kept gives what the plain whole-row functions give (they define such rows)."""
    if n == "recorded":
        x, n = np.array(gemma_rows[1], copy=True), gemma_rows.shape[1]
    else:
        x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    if bad == "nan":
        x[n // 2] = np.nan
    elif bad == "negative nan":
        x[n // 3] = -np.float32(np.nan)
    elif bad == "+inf":
        x[n - 1] = np.inf
    else:
        x[:] = -np.inf
    (_, _, _, ok), _ = _summary(x, 0.7)
    assert not ok
    stats, kept = np.zeros(3, np.float32), np.empty(S.KEPT_MAX, np.int64)
    t, p, _, m = S.pick_kept(x, n, 0.7, 0, 1.0, 0.0, 0.3, stats, kept, False, D.new_summaries(1)[0])
    mx, cut, lz = S.processed(x, n, 0.7, 0, 1.0, 0.0)
    assert m == -1 and t == S.sample(x, n, 0.7, mx, cut, lz, 0.3)
    assert np.array_equal(stats, np.array([mx, cut, lz], np.float32), equal_nan=True)


def _inverse_cdf_holds(p, a, u, tol=1e-6):
    """Whether token a is the float64 inverse CDF of p at u, up to tol of rounding in the CDF (float32 sums)."""
    c = np.cumsum(p)
    return p[a] > 0 and c[a] - p[a] - tol <= u <= c[a] + tol


@pytest.mark.parametrize("t", [0.7, 1.0, 1.6])
def test_draws_are_the_plain_inverse_cdf_on_recorded_rows(gemma_rows, t):
    """On Gemma's rows: the summary's draw is the float64 inverse CDF of p~ at its uniform, within 1e-6 of float32
    rounding in the CDF (sampling.py's whole-row draw, which it nearly always equals, can be further off: its
    float32 sums run in index order over the whole row), the SD residual's likewise, and the pick's p~ of its
    token is the float64 one."""
    rng = np.random.default_rng(2)
    n = gemma_rows.shape[1]
    masses = np.zeros(D.SUMMARY_BLOCKS, np.float32)
    for x, y in zip(gemma_rows[1:], gemma_rows[:-1]):
        x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
        (mx, lz, _, ok), s = _summary(x, t, raw=False)
        (my, lzy, _, _), _ = _summary(y, t, raw=False)
        px, py = np.array([mx, -np.inf, lz], np.float32), np.array([my, -np.inf, lzy], np.float32)
        p, r = R.processed(x, t), R.residual(x, y, t)
        same = 0
        for u in rng.random(25):
            a, b = D.draw(x, n, 1.0 / t, mx, s, u), S.sample(x, n, t, mx, -np.inf, lz, u)
            assert _inverse_cdf_holds(p, a, u)
            same += a == b
            a, b = D.residual_draw(x, y, n, t, px, py, u, masses), S.sample_residual(x, y, n, t, px, py, u)
            assert _inverse_cdf_holds(r, a, u)
            same += a == b
        assert same >= 45
        stats, kept = np.zeros(3, np.float32), np.empty(S.KEPT_MAX, np.int64)
        tok, p_tok, p_top, m = S.pick_kept(x, n, t, 0, 1.0, 0.0, 0.5, stats, kept, False, D.new_summaries(1)[0])
        assert m == -1 and p_tok == pytest.approx(p[tok], rel=2e-6) and p_top == pytest.approx(p.max(), rel=2e-6)


def _peaked(n, seed, t):
    """A row whose p~ at temperature t puts its mass on ~40 tokens spread over the row (every block, both
    cores' halves), the rest tiny but not zero: draws can be counted token by token."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 1.0).astype(np.float32)
    hot = rng.choice(n, 40, replace=False)
    x[hot] += np.float32(12.0 * t) + rng.random(40).astype(np.float32) * np.float32(2.0 * t)
    return x


def _pvalue(counts, p):
    expected = p * counts.sum()
    big = expected >= 5  # the rare tokens pooled, so the chi-square approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return sps.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize("n", [3000, 70_000])
def test_draws_follow_p_the_residual_and_p_without_a_token(n):
    """Chi-square against the float64 distributions: the summary's draw follows p~, the residual's draw follows
    norm(max(p~ - q~, 0)), and a one-hot draft's residual (p~ without its token) never returns that token."""
    t = 0.7
    x, y = _peaked(n, 3, t), _peaked(n, 4, t)
    y[np.argsort(x)[-20:]] += np.float32(2.0)  # the draft shares some of the target's favourites
    (mx, lz, _, _), s = _summary(x, t, raw=False)
    (my, lzy, _, _), _ = _summary(y, t, raw=False)
    px, py = np.array([mx, -np.inf, lz], np.float32), np.array([my, -np.inf, lzy], np.float32)
    masses = np.zeros(D.SUMMARY_BLOCKS, np.float32)
    d = int(np.argmax(x))
    us = np.random.default_rng(5).random(6000)
    draws = np.bincount([D.draw(x, n, 1.0 / t, mx, s, u) for u in us], minlength=n)
    resid = np.bincount([D.residual_draw(x, y, n, t, px, py, u, masses) for u in us], minlength=n)
    without = np.bincount([D.draw_without(x, n, 1.0 / t, mx, s, u, d) for u in us], minlength=n)
    assert _pvalue(draws, R.processed(x, t)) > ALPHA
    r = R.residual(x, y, t)
    assert resid[r == 0].sum() == 0 and _pvalue(resid, r) > ALPHA
    assert without[d] == 0 and _pvalue(without, R.residual(x, None, t, onehot=d)) > ALPHA


def test_a_residual_without_mass_is_none():
    """p~ == q~: no residual mass; residual_draw says so (-1) and the caller draws from p~."""
    x = _peaked(70_000, 6, 1.0)
    (mx, lz, _, _), _ = _summary(x, 1.0, raw=False)
    px = np.array([mx, -np.inf, lz], np.float32)
    assert (
        D.residual_draw(x, x.copy(), x.shape[0], 1.0, px, px.copy(), 0.4, np.zeros(D.SUMMARY_BLOCKS, np.float32)) == -1
    )


MODES = {"fsd": (FSD, 0.3), "fsd-paper": (FSD_PAPER, 0.3), "typical": (TYPICAL, 0.5), "cascade": (CASCADE, 0.4)}
MODES["relaxed"] = (RELAXED, 0.05)


def _loss(mode, x, y, t, tau, onehot=None, shift=None):
    n = x.shape[0]
    (mx, lz, lx, _), _ = _summary(x, t)
    px = np.array([mx, -np.inf, lz], np.float32)
    if onehot is None:
        (my, lzy, _, _), _ = _summary(y, t, raw=False)
        py = np.array([my, -np.inf, lzy], np.float32)
    else:
        y, py = x, np.zeros(3, np.float32)
    floor = rescue_floor(mode, x, lx, n, tau, 10, 0.09, 0.3)
    sums = np.zeros((D.PARTS, 6))
    lx = lx if shift is None else shift
    return D.dense_loss(mode, x, lx, y, n, t, px, py, floor, sums, onehot is not None, 0 if onehot is None else onehot)


def _close(got, want, rel=2e-4, abs_=2e-6):
    return got == pytest.approx(want, rel=rel, abs=abs_)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("t", [0.7, 1.0, 1.4])
def test_the_loss_of_a_slot_is_the_reference(gemma_rows, mode, t):
    """dense_loss (one pass over both rows) against the float64 definition: (loss, P(rescue)) on Gemma's
    recorded rows and on random rows of both sizes, with masked tokens on both sides; a one-hot draft (prompt
    lookup); the divergence rules with any shift in place of the log-partition (it cancels)."""
    code, tau = MODES[mode]
    rng = np.random.default_rng(7)
    pairs = [(np.ascontiguousarray(a), np.ascontiguousarray(b)) for a, b in zip(gemma_rows[1:4], gemma_rows[:3])]
    for n in (900, 70_000):
        x, y = _peaked(n, 8, 1.0), _peaked(n, 9, 1.0)
        x[rng.random(n) < 0.1] = -np.inf
        y[rng.random(n) < 0.1] = -np.inf
        x[int(np.argmax(np.where(x > -np.inf, y, -np.inf)))] += 1.0  # both rows keep mass on shared tokens
        pairs.append((x, y))
    for x, y in pairs:
        got = _loss(code, x, y, t, tau)
        want = R.sampled_loss(code, x, y, t, tau)
        assert _close(got[0], want[0]) and _close(got[1], want[1]), (mode, got, want)
        d = int(np.argsort(np.where(x > -np.inf, x, np.inf))[0])  # the target's least likely unmasked token
        got, want = _loss(code, x, y, t, tau, onehot=d), R.sampled_loss(code, x, y, t, tau, onehot=d)
        assert _close(got[0], want[0]) and _close(got[1], want[1]), (mode, "one-hot", got, want)
        if code in (FSD, FSD_PAPER):
            got = _loss(code, x, y, t, tau, shift=float(x.max()))
            assert _close(got[0], R.sampled_loss(code, x, y, t, tau)[0])


def test_fsd_paper_charges_infinity_where_the_draft_reaches_a_masked_token():
    x, y = _peaked(70_000, 10, 1.0), _peaked(70_000, 11, 1.0)
    x[int(np.argmax(y))] = -np.inf
    assert _loss(FSD_PAPER, x, y, 1.0, 0.3)[0] == np.inf
    assert _loss(FSD, x, y, 1.0, 0.3)[0] < np.inf  # fsd's rescue never reaches it: that mass is rejected


@pytest.mark.parametrize("mode", ["typical", "cascade", "relaxed"])
def test_the_rescue_floor_is_the_rules_own_test(mode):
    """rescue_floor: a token is above the floor exactly where budget._rescuable (the rule's test) rescues it."""
    from fsd_local.kernels.budget import _rescuable, _row_constants

    code, tau = MODES[mode]
    x = _peaked(3000, 12, 1.0)
    n, lx = x.shape[0], R.raw_lse(x)
    floor = rescue_floor(code, x, lx, n, tau, 10, 0.09, 0.3)
    lpmax, kth, m = _row_constants(code, x, lx, n, 10, 0.09, 0.3)
    for v in np.sort(x)[-60:]:
        assert (v >= floor) == _rescuable(code, v, lx, lpmax, kth, m, tau), (mode, v, floor)


def _first_two(target, prompt, t):
    """The target's joint distribution of the next two tokens at temperature t, untruncated (float64)."""
    from fsd_local.llama.model import Model
    from fsd_local.llama.options import ModelOptions

    fresh = Model(ModelOptions(target, n_ctx=128, n_threads=1))
    try:
        fresh.decode(prompt, "last")
        p1 = R.processed(fresh.logits(1)[0], t)
        joint = np.zeros((p1.size, p1.size))
        for t1 in np.nonzero(p1 > 1e-6)[0]:
            fresh.truncate(len(prompt))
            fresh.decode([int(t1)], "last")
            joint[t1] = p1[t1] * R.processed(fresh.logits(1)[0], t)
        return joint
    finally:
        fresh.close()


def test_sampled_sd_at_a_temperature_alone_keeps_the_targets_two_token_distribution(small_vocab_pair):
    """The engine's untruncated sampled rounds (summaries, residual draws, bonus draws from the summary): sampled
    sd's first two tokens follow the target's joint distribution at that temperature (chi-square over seeds), and
    fsd at tau 0 emits exactly what sd emits."""
    from fsd_local import Engine

    draft, target = small_vocab_pair
    t = 0.7
    with Engine(target=target, draft=draft, n_ctx=128, n_threads=1, draft_policy="fixed", draft_max=3) as eng:
        prompt = eng.tokenize("the sky")
        n = eng.n_vocab
        counts = np.zeros((n, n), np.int64)
        for seed in range(2000):
            out = eng.generate(prompt, mode="sd", max_tokens=4, seed=seed, temperature=t, ignore_eos=True)
            counts[out.token_ids[0], out.token_ids[1]] += 1
            if seed < 40:
                same = eng.generate(
                    prompt, mode="fsd", tau=0.0, max_tokens=4, seed=seed, temperature=t, ignore_eos=True
                )
                assert same.token_ids == out.token_ids
    assert _pvalue(counts.ravel(), _first_two(target, prompt, t).ravel()) > ALPHA


def test_the_loop_on_a_long_vocabulary_draws_from_the_target(wide_vocab):
    """On a 65,536-token pair (every row split over the cores): sampled sd's first token follows the target's p~,
    and log-probabilities asked at the same time are the rows' raw log-softmax (from the summary's raw sums)."""
    from test_engine import _fresh_logits

    from fsd_local import Engine

    draft, target = wide_vocab
    t = 0.7
    with Engine(target=target, draft=draft, n_ctx=128, n_threads=2, draft_policy="fixed", draft_max=1) as eng:
        prompt = eng.tokenize("the cat")
        counts = np.zeros(eng.n_vocab, np.int64)
        for seed in range(500):  # one draft, then the target's row: the first token always goes through the rule
            out = eng.generate(prompt, mode="sd", max_tokens=2, seed=seed, temperature=t, ignore_eos=True)
            counts[out.token_ids[0]] += 1
        lp = eng.generate(prompt, mode="sd", max_tokens=4, seed=3, temperature=t, logprobs=True, ignore_eos=True)
    row = _fresh_logits(target, prompt)
    assert _pvalue(counts, R.processed(row, t)) > ALPHA
    want = float(row[lp.token_ids[0]]) - R.raw_lse(row)
    assert lp.logprobs[0] == pytest.approx(want, abs=1e-5)


@pytest.fixture(scope="module")
def wide_vocab(tmp_path_factory):
    """A tiny pair over 65,536 tokens: its rows are long enough to be split over the cores."""
    from support.tinymodels import WORDS, write_tiny_gguf

    words = WORDS + [f"▁w{i}" for i in range(65536 - 259 - len(WORDS))]
    d = tmp_path_factory.mktemp("dense-wide")
    return (
        str(write_tiny_gguf(d / "draft.gguf", seed=1, words=words)),
        str(write_tiny_gguf(d / "target.gguf", seed=2, noise=0.1, words=words)),
    )
