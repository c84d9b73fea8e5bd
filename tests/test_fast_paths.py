"""The kernels' fast paths against the plain ones and float64 references, on recorded rows: real logit rows of
the F16 demo pair (the target's and the draft's at the same positions of the target's own text) and of Gemma 3
270M (a 262,144-token vocabulary). Greedy: the argmax at memory speed; sampled: the processed distribution,
draws and SD replacements over the kept set (top-k / top-p / min-p) instead of whole-row passes; the round:
every mode, greedy and sampled, with and without log-probabilities."""

from __future__ import annotations

import numpy as np
import pytest

from fsd_local.kernels import sampling as S
from fsd_local.kernels.accept import Drafts, Rule, Sampling, accept_round, round_out
from fsd_local.kernels.budget import new_budget
from fsd_local.kernels.dense import new_summaries
from fsd_local.kernels.names import DIVERGENCES, MODES
from fsd_local.kernels.rows import copy_max_argmax, max_argmax
from support.reference import divergence as ref_divergence
from support.reference import log_softmax


def _rows(model, tokens: list[int], first: int) -> np.ndarray:
    model.clear()
    model.decode(tokens, f"from:{first}")
    rows = np.array(model.logits(len(tokens) - first), copy=True)
    model.clear()
    return rows


@pytest.fixture(scope="module")
def recorded(real_engine_f16):
    """(target rows, draft rows, the target's greedy text): 24 positions of a chat reply, F16 demo pair."""
    eng = real_engine_f16
    ids = eng.chat_prompt([{"role": "user", "content": "Explain how a refrigerator keeps food cold."}])
    eng.reset()
    reply = eng.generate(ids, mode="ar", max_tokens=24, ignore_eos=True).token_ids
    text, first = ids + reply, len(ids) - 1
    rows = _rows(eng.target, text, first)[: len(reply)], _rows(eng.draft, text, first)[: len(reply)], reply
    eng.reset()
    return rows


@pytest.fixture(scope="module")
def gemma_rows(gemma_path):
    from fsd_local.llama.model import Model
    from fsd_local.llama.options import ModelOptions

    m = Model(ModelOptions(path=gemma_path, n_ctx=256, n_threads=2), "target")
    try:
        toks = m.tokenize("The water cycle begins when the sun warms the oceans and lakes, and")
        return _rows(m, toks, 0)
    finally:
        m.close()


def test_argmax_at_memory_speed_is_the_argmax(recorded, gemma_rows):
    P, Q, _ = recorded
    for x in [*P, *Q, *gemma_rows]:
        x = np.ascontiguousarray(x)
        mx, i = max_argmax(x, x.shape[0])
        assert i == int(np.argmax(x)) and mx == x.max()
        y = x.copy()
        y[: i + 1] = -np.inf  # the max gone: the next one, found further on
        assert max_argmax(y, y.shape[0])[1] == int(np.argmax(y))
        y[7] = y[len(y) - 3] = np.float32(1e9)  # ties: the first
        assert max_argmax(y, y.shape[0])[1] == 7


def test_the_copying_argmax_is_the_argmax_and_leaves_the_row_copied(recorded, gemma_rows):
    """copy_max_argmax (a draft's row kept for the kernel, copied by the pass that picks its token): the argmax
    max_argmax gives, on rows short and long (split over the cores from PARALLEL_MIN), with ties and NaN, and an
    exact copy of the row."""
    P, Q, _ = recorded
    for x in [*P[:4], *Q[:4], *gemma_rows[:4]]:
        for variant in range(3):
            x = np.ascontiguousarray(x).copy()
            if variant == 1:
                x[11] = x[x.shape[0] - 5] = np.float32(1e9)  # ties: the first
            if variant == 2:
                x[x.shape[0] // 2] = np.nan  # a positive NaN: max NaN, the plain scalar rule's index
            y = np.full(x.shape[0] + 3, np.float32(7.0))
            mx, i = copy_max_argmax(x, x.shape[0], y)
            ref_mx, ref_i = max_argmax(x, x.shape[0])
            assert i == ref_i and (mx == ref_mx or (mx != mx and ref_mx != ref_mx))
            assert np.array_equal(y[: x.shape[0]], x, equal_nan=True) and (y[x.shape[0] :] == 7.0).all()


SAMPLED = [(0.8, 40, 0.95, 0.05), (1.0, 0, 1.0, 0.1), (0.7, 0, 0.9, 0.0), (1.2, 5, 1.0, 0.0), (1.0, 0, 1.0, 0.0)]


@pytest.mark.parametrize(("t", "top_k", "top_p", "min_p"), SAMPLED)
def test_kept_set_sampling_equals_the_whole_row(recorded, gemma_rows, t, top_k, top_p, min_p):
    """The processed distribution, its draws and the SD replacement over the kept set are the whole-row ones
    (a draw at the same uniform is the same token: both walk the tokens in index order)."""
    P, Q, _ = recorded
    kept = np.empty(S.KEPT_MAX, np.int64)
    rng = np.random.default_rng(0)
    for x, y in [*zip(P, Q), *zip(gemma_rows[1:], gemma_rows[:-1])]:
        x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
        n = x.shape[0]
        dense = S.processed(x, n, t, top_k, top_p, min_p)
        mx, cut, lz, m = S.processed_kept(x, n, t, top_k, top_p, min_p, kept)
        assert (mx, cut) == dense[:2] and lz == pytest.approx(dense[2], abs=1e-5)
        truncated = top_k > 0 or top_p < 1.0 or min_p > 0.0
        assert (m >= 0) == truncated or m < 0
        if m >= 0:
            assert list(kept[:m]) == list(np.flatnonzero(x >= cut))
        px = np.array(dense, np.float32)
        py = np.array(S.processed(y, n, t, top_k, top_p, min_p), np.float32)
        for u in rng.random(6):
            assert S.sample_kept(x, n, t, mx, cut, lz, kept, m, u) == S.sample(x, n, t, *dense, u)
            fast = S.residual_kept(x, y, n, t, px, py, kept, m, u, False, 0, kept, y, -1)
            q_kept = np.empty(S.KEPT_MAX, np.int64)  # q~ from its kept tokens' logits alone, without its row
            m_q = S.processed_kept(y, n, t, top_k, top_p, min_p, q_kept)[3]
            if m_q >= 0:
                q_logits = np.zeros(S.KEPT_MAX, np.float32)
                q_logits[:m_q] = y[q_kept[:m_q]]
                nan_row = np.full(n, np.nan, np.float32)
                assert S.residual_kept(x, nan_row, n, t, px, py, kept, m, u, False, 0, q_kept, q_logits, m_q) == fast
            assert fast == S.sample_residual(x, y, n, t, px, py, u)


@pytest.mark.parametrize(("t", "top_k", "top_p", "min_p"), [(0.0, 0, 1.0, 0.0), *SAMPLED[:3]])
@pytest.mark.parametrize("want_top", [False, True])
def test_the_copying_pick_is_the_pick(recorded, gemma_rows, t, top_k, top_p, min_p, want_top):
    """pick_kept_copy (the draft's pick where the kernel reads its rows later) returns what pick_kept returns at
    the same uniform, with the same stats and kept set, and leaves the row copied."""
    P, Q, _ = recorded
    rng = np.random.default_rng(3)
    for x in [*Q[:6], *gemma_rows[:3]]:
        x = np.ascontiguousarray(x)
        n, u = x.shape[0], rng.random()
        stats, kept = np.zeros(3, np.float32), np.empty(S.KEPT_MAX, np.int64)
        ref = S.pick_kept(x, n, t, top_k, top_p, min_p, u, stats, kept, want_top, new_summaries(1)[0])
        stats2, kept2, y = np.zeros(3, np.float32), np.empty(S.KEPT_MAX, np.int64), np.zeros(n, np.float32)
        got = S.pick_kept_copy(x, n, t, top_k, top_p, min_p, u, stats2, kept2, want_top, y, new_summaries(1)[0])
        assert got == ref and np.array_equal(stats2, stats) and np.array_equal(y, x)
        if ref[3] > 0:
            assert list(kept2[: ref[3]]) == list(kept[: ref[3]])


def _reference_round(P, Q, drafts, mode, div, tau, lossless=()):
    """Greedy, float64, straight from docs/design.md, "The acceptance rules": the SD test (the draft is the
    target's argmax), then the rule; at a `lossless` slot (a token that would end the reply) the SD test alone."""
    from support.reference_rules import critical_tau

    for i, d in enumerate(drafts):
        x, y = P[i].astype(np.float64), Q[i].astype(np.float64)
        if (mode != "fsd-paper" or i in lossless) and d == int(np.argmax(x)):
            continue
        if mode == "sd" or i in lossless or tau == 0 and mode != "fsd-paper":
            return i, int(np.argmax(x))
        if mode in ("fsd", "fsd-paper", "fsd-entropy"):
            dv = ref_divergence(div, x, y)
            ok = critical_tau(mode, x, d, dv) <= tau if mode == "fsd-entropy" else dv <= tau
        else:
            ok = critical_tau(mode, x, d) <= tau
        if not ok:
            return i, int(np.argmax(x))
    return len(drafts), int(np.argmax(P[len(drafts)]))


DIVS = {"fsd": ("js", "tv"), "fsd-paper": ("js", "tv"), "fsd-entropy": ("js", "tv")}
TAUS = {"fsd": 0.2, "fsd-paper": 0.2, "fsd-entropy": 0.3, "typical": 0.5, "cascade": 0.4, "relaxed": 0.2, "sd": 0.0}


@pytest.mark.parametrize("mode", [m for m in MODES if m in TAUS])
def test_the_round_matches_the_reference_on_recorded_rows_greedy(recorded, mode):
    """Every mode, greedy, drafts of the draft model's own picks at each position, with and without a slot that
    only the lossless test may accept: the fast kernel accepts exactly what the float64 reference accepts (except
    where a divergence is within rounding of tau), and its losses and gaps are the rows' max minus the token's
    logit."""
    P, Q, reply = recorded
    k, n = 4, P.shape[1]
    for start in range(0, 16, 3):
        rows = np.ascontiguousarray(P[start : start + k + 1])
        q = np.ascontiguousarray(Q[start : start + k])
        drafts = np.array([int(np.argmax(r)) for r in q], np.int32)
        for div, strict in ((div, strict) for div in DIVS.get(mode, ("js",)) for strict in ((), (start % k,))):
            out, budget = round_out(k), new_budget(None, k)
            lossless = np.zeros(k, np.uint8)
            lossless[list(strict)] = 1
            d = Drafts(
                q, drafts, np.ones(k), np.zeros((k + 1, 3), np.float32), np.zeros(k, np.uint8), lossless=lossless
            )
            rule = Rule(MODES.index(mode), DIVERGENCES.index(div), TAUS[mode], 50)
            acc, nxt = accept_round(rows, d, k, n, rule, Sampling(0.0, 0, 1.0, 0.0), np.zeros(k + 1), out, budget)
            want_acc, want_nxt = _reference_round(rows, q, list(drafts), mode, div, TAUS[mode], strict)
            if (acc, nxt) != (want_acc, want_nxt):  # allowed only at a divergence within rounding of tau
                dv = [v for v in out.divergence[: min(acc, want_acc) + 1] if v == v]
                assert dv and min(abs(v - TAUS[mode]) for v in dv) < 1e-5, (mode, div, start, acc, want_acc)
                continue
            emitted = list(drafts[:acc]) + [nxt]
            for j, tok in enumerate(emitted):
                gap = float(rows[j].max()) - float(rows[j][tok])
                assert out.gap[j] == pytest.approx(gap, abs=1e-6) and budget.loss[j] == pytest.approx(gap, abs=1e-6)
                assert out.logprob[j] == pytest.approx(log_softmax(rows[j])[tok], abs=1e-5)


def _sampled_rounds(P, Q, k, sampling, rng):
    """Rounds of k drafts over the recorded rows (every other start): the target's k + 1 rows, the draft's k rows,
    and the draft's own picks from them at these sampling settings, as drafting/proposer.py makes them."""
    n = P.shape[1]
    kept = np.empty(S.KEPT_MAX, np.int64)
    for start in range(0, 18, 2):
        rows = np.ascontiguousarray(P[start : start + k + 1])
        q = np.ascontiguousarray(Q[start : start + k])
        stats = np.zeros((k + 1, 3), np.float32)
        drafts, probs = np.empty(k, np.int32), np.empty(k)
        for i in range(k):
            drafts[i], probs[i], _, _ = S.pick_kept(
                q[i], n, *sampling, rng.random(), stats[i], kept, False, new_summaries(1)[0]
            )
        yield rows, q, Drafts(q, drafts, probs, stats, np.zeros(k, np.uint8))


@pytest.mark.parametrize("mode", ["sd", "fsd", "typical"])
@pytest.mark.parametrize(("t", "top_k", "top_p", "min_p"), SAMPLED[:3])
def test_the_sampled_round_takes_the_same_decisions_over_the_kept_set(recorded, mode, t, top_k, top_p, min_p):
    """Sampled, the same uniforms: the kernel over kept sets decides as the whole-row computation does (the SD
    test's p~(d), the replacement's residual), checked against p~ computed in float64 from the row."""
    P, Q, _ = recorded
    k, n = 3, P.shape[1]
    rng = np.random.default_rng(1)
    for rows, q, d in _sampled_rounds(P, Q, k, (t, top_k, top_p, min_p), rng):
        drafts, probs = d.tokens, d.prob
        us = rng.random(k + 1)
        out = round_out(k)
        rule = Rule(MODES.index(mode), 0, TAUS.get(mode, 0.2), 50)
        acc, nxt = accept_round(rows, d, k, n, rule, Sampling(t, top_k, top_p, min_p), us, out, new_budget(None, k))
        for i in range(acc):  # every accepted slot passed the SD test or was rescued; the first failure did not
            p_d = S.prob(rows[i], drafts[i], t, *S.processed(rows[i], n, t, top_k, top_p, min_p))
            assert out.reason[i] == 2 or us[i] * probs[i] < p_d
        assert 0 <= nxt < n and S.prob(rows[acc], nxt, t, *S.processed(rows[acc], n, t, top_k, top_p, min_p)) > 0


def _reference_loss(x, y, t, top_k, top_p, min_p, mode, tau):
    """The sampled loss of a slot and P(rescue) there, float64 from their definition (kernels/budget.py): r the
    rule's emission at the slot, p the raw softmax, p~ and q~ the processed distributions (cut-offs from the
    kernel, whose truncation the other tests check), (max(0, E_p~[log p] - E_r[log p]), P(rescue))."""
    from tests.test_budget import _rescue_set

    def processed(row):
        _, cut, _ = S.processed(row, row.shape[0], t, top_k, top_p, min_p)
        z = np.where(row >= cut, row.astype(np.float64) / t, -np.inf)
        w = np.exp(z - z.max())
        return w / w.sum()

    p, q = processed(x), processed(y)
    a = _rescue_set(MODES.index(mode), x, tau, 0.09, 0.3, 10)
    over, under = np.maximum(q - p, 0), np.maximum(p - q, 0)
    rescued, rejected = over[a].sum(), over[~a].sum()
    r = np.minimum(p, q) + np.where(a, over, 0) + (rejected * under / under.sum() if under.sum() else 0)
    logp = log_softmax(x)
    return (max(0.0, float(np.sum(p * logp) - np.sum(r * logp))) if rescued else 0.0), rescued


@pytest.mark.parametrize("mode", ["fsd", "typical", "cascade"])
@pytest.mark.parametrize(("t", "top_k", "top_p", "min_p"), SAMPLED[:2])
def test_the_sampled_loss_of_a_rescue_on_recorded_rows_is_the_reference(recorded, mode, t, top_k, top_p, min_p):
    """What a sampled slot is charged (a budget charges the loss at the slot, a tau run the loss over P(rescue) on
    a rescue: every lossy run reports it), computed over the kept sets' union from the draft's kept logits alone,
    against its float64 definition, on the demo pair's rows; fsd's without the row's log-partition (it cancels)."""
    from fsd_local.kernels.budget import kept_union, sampled_loss

    P, Q, _ = recorded
    n = P.shape[1]
    tau = TAUS[mode]
    p_kept, q_kept = np.empty(S.KEPT_MAX, np.int64), np.empty(S.KEPT_MAX, np.int64)
    union = np.empty(2 * S.KEPT_MAX, np.int64)
    for x, y in zip(P, Q):
        x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
        *ps, m_p = S.processed_kept(x, n, t, top_k, top_p, min_p, p_kept)
        *qs, m_q = S.processed_kept(y, n, t, top_k, top_p, min_p, q_kept)
        lx = float(np.logaddexp.reduce(x.astype(np.float64)))
        rule = (MODES.index(mode), x, lx, y, False, 0, n, t, np.array(ps, np.float32), np.array(qs, np.float32))
        dense = sampled_loss(*rule, tau, 10, 0.09, 0.3, union, -1, q_kept, y, -1)
        m = kept_union(p_kept, m_p, q_kept, m_q, union) if m_p >= 0 and m_q >= 0 else -1
        q_logits = np.zeros(S.KEPT_MAX, np.float32)
        q_logits[: max(m_q, 0)] = y[q_kept[: max(m_q, 0)]]
        sparse = sampled_loss(*rule, tau, 10, 0.09, 0.3, union, m, q_kept, q_logits, m_q)
        want = _reference_loss(x, y, t, top_k, top_p, min_p, mode, tau)
        assert dense == pytest.approx(want, rel=1e-3, abs=1e-6) and sparse == pytest.approx(want, rel=1e-3, abs=1e-6)
        if mode == "fsd":
            no_lse = (rule[0], x, 0.0, *rule[3:])
            assert sampled_loss(*no_lse, tau, 10, 0.09, 0.3, union, m, q_kept, q_logits, m_q) == pytest.approx(
                want, rel=1e-3, abs=1e-6
            )


@pytest.mark.parametrize("mode", ["fsd", "typical"])
@pytest.mark.parametrize("bound", [None, 50.0])
def test_a_sampled_round_charges_each_emitted_token_the_reference_loss(recorded, mode, bound):
    """What accept_round charges each emitted token of sampled rounds on the demo pair's rows at chat's sampling,
    against the float64 definition. A fixed-tau run (bound None) charges a rescued token its slot's loss over
    P(rescue) and every other token nothing. A budget (ample: every slot worth its price and within the cap, at
    the same threshold) charges every slot where the rule may rescue (fsd: its js within tau, computed before the
    SD test since 0.2 is below js's bound; typical: some token rescued) its whole loss, whether the slot's SD
    test passed, its token was rescued or it was rejected; the bonus token nothing."""
    from fsd_local.kernels.budget import G_HI, LOSS, TAU, G

    P, Q, _ = recorded
    t, top_k, top_p, min_p = SAMPLED[0]
    k, n, tau = 3, P.shape[1], TAUS[mode]
    rng = np.random.default_rng(2)
    charged = 0
    for start, (rows, q, d) in enumerate(_sampled_rounds(P, Q, k, SAMPLED[0], rng)):
        out, budget = round_out(k), new_budget(bound, k)
        budget.state[TAU], budget.state[G] = tau, G_HI
        acc, _ = accept_round(
            rows, d, k, n, Rule(MODES.index(mode), 0, tau, 50), Sampling(*SAMPLED[0]), rng.random(k + 1), out, budget
        )
        for j in range(min(acc + 1, k)):  # the slots judged (the bonus token, j = k, is sd's)
            loss, rescued = _reference_loss(rows[j], q[j], t, top_k, top_p, min_p, mode, tau)
            opens = rescued > 0 and (mode != "fsd" or ref_divergence("js", rows[j], q[j]) <= tau)
            if bound is None:
                want = loss / rescued if j < acc and out.reason[j] == 2 else 0.0
            else:
                want = loss if opens else 0.0
                charged += opens and out.reason[j] != 2
            assert budget.loss[j] == pytest.approx(want, rel=2e-3, abs=1e-6), (start, j)
        if acc == k:
            assert budget.loss[k] == 0.0
        if bound is not None:
            assert budget.state[LOSS] == pytest.approx(budget.loss[: acc + 1].sum(), rel=1e-9, abs=1e-12)
    if bound is not None:
        assert charged > 0  # slots charged whose token was not a rescue: the slot's loss, not the rescue's
