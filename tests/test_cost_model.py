"""The `auto` draft-length policy: the cost model (drafting/cost_model.py: verification costs, acceptance per
position, the k it picks) and DraftLength (drafting/length.py: one cost model per source, shadows, catch-up)."""

from __future__ import annotations

import math
import random

import pytest

from fsd_local.drafting.cost_model import CostModel, VerifyCost, best_k, expected_rates

MS = 1e-3


def simulate(cm, rounds, verify, draft_per_token, accept, seed=0, redecode=False):
    """Drive the model like the engine would, with synthetic costs and per-position acceptance (no timing).
    verify(n) -> seconds; accept: conditional acceptance of every position (a float or a list). redecode: the
    target goes back to a checkpoint after a rejection, so its next decode takes the round's first token and the
    accepted drafts again (as the engine's verify and plain steps do)."""
    rng = random.Random(seed)
    chosen, carry = [], 0
    for _ in range(rounds):
        k = cm.choose_k()
        n_acc = 0
        if k:
            cm.observe_draft(k, k * draft_per_token)
            while n_acc < k and rng.random() < (accept if isinstance(accept, float) else accept[n_acc]):
                n_acc += 1
            cm.observe_acceptance(k, n_acc)
        cm.observe_verify(carry + k + 1, verify(carry + k + 1))
        carry = n_acc + 1 if redecode and n_acc < k else 0
        chosen.append(k)
    return chosen


def settled(chosen, run=20):
    """The first round from which `run` rounds in a row all drafted (k > 0)."""
    return next(i for i in range(len(chosen)) if all(k > 0 for k in chosen[i : i + run]))


def share(chosen, pred):
    return sum(1 for k in chosen if pred(k)) / max(1, len(chosen))


def q4_verify(n):  # a compute-bound target: a batch costs about as much as decoding one by one
    return 9 * MS * n


def f16_verify(n):  # a memory-bound target: a batch costs about one decode
    return 25 * MS + 0.3 * MS * n


def test_k_is_zero_when_drafting_cannot_pay():
    cm = CostModel(8)  # a model drafter: 5 ms a token, half the target's decode, and poor acceptance
    chosen = simulate(cm, 300, q4_verify, 5 * MS, 0.3)
    tail = chosen[100:]
    assert tail.count(0) >= 0.95 * len(tail), cm.k_histogram
    assert cm.probes >= 2  # it kept looking, rarely
    assert cm.plain_tokens_per_second_est == pytest.approx(1 / (9 * MS), rel=1e-3)
    # a free drafter with hopeless acceptance does not pay either on a compute-bound target
    cm = CostModel(8, draft_cost_prior=0.0)
    tail = simulate(cm, 300, q4_verify, 0.0, 0.05)[100:]
    assert tail.count(0) >= 0.95 * len(tail), cm.k_histogram


def test_large_k_when_verification_is_nearly_free_and_acceptance_high():
    cm = CostModel(8, draft_cost_prior=0.0)
    chosen = simulate(cm, 200, f16_verify, 2e-6, 0.95)
    assert share(chosen[50:], lambda k: k >= 6) >= 0.9, cm.k_histogram
    assert cm.last_rate > 3 / (25 * MS)


def test_intermediate_costs_give_an_intermediate_k():
    """Exact expectation: with v(n) = 9 ms (1 + 0.5 (n-1)), free drafts and a = 0.7 the best k is small."""
    rates = expected_rates([0.7] * 8, 0.0, [0.0] + [9 * MS * (1 + 0.5 * (n - 1)) for n in range(1, 10)])
    want = best_k(rates)
    assert 1 <= want <= 3
    cm = CostModel(8, draft_cost_prior=0.0)
    tail = simulate(cm, 400, lambda n: 9 * MS * (1 + 0.5 * (n - 1)), 0.0, 0.7, seed=3)[150:]
    # the most frequent choice is the best k or a neighbour (the estimates are noisy samples)
    mode = max(set(tail), key=tail.count)
    assert abs(mode - want) <= 1, (want, cm.k_histogram)


def test_policy_comes_back_after_costs_change():
    cm = CostModel(8)  # a memory-bound target; the draft model's drafts are poor
    chosen = simulate(cm, 300, f16_verify, 5 * MS, 0.1, seed=1)
    assert chosen[-50:].count(0) >= 45
    # the draft gets fast and good while other jobs slow the target 2x (the same shape: the level follows)
    chosen = simulate(cm, 300, lambda n: 2 * f16_verify(n), 1 * MS, 0.9, seed=2)
    back = settled(chosen)
    assert back <= cm.probe_max + 2 * cm.probe_every, chosen  # within about one backed-off probe interval
    assert share(chosen[back + 20 :], lambda k: k >= 3) >= 0.9, cm.k_histogram
    # and it goes back to plain steps when drafting stops paying again
    chosen = simulate(cm, 300, f16_verify, 5 * MS, 0.1, seed=4)
    assert chosen[-100:].count(0) >= 95, cm.k_histogram


def test_acceptance_improving_while_at_k0_is_found_by_probes():
    """Costs fixed, acceptance jumps (the text turned into copying the prompt): probes notice it."""
    cm = CostModel(8, draft_cost_prior=0.0)
    verify = lambda n: 9 * MS * (1 + 0.35 * (n - 1))
    assert simulate(cm, 300, verify, 0.0, 0.1, seed=5)[-50:].count(0) >= 45
    chosen = simulate(cm, 200, verify, 0.0, 0.98, seed=6)
    back = settled(chosen)
    assert back <= cm.probe_max + 2 * cm.probe_every, chosen
    assert share(chosen[back + 20 :], lambda k: k >= 4) >= 0.9, cm.k_histogram


@pytest.mark.parametrize("seed", range(20))
def test_higher_acceptance_never_lowers_k(seed):
    """Under fixed costs, raising any position's acceptance never lowers the chosen k (log-rate has increasing
    differences in (k, a): the ratio rate(k+1)/rate(k) grows with every a_j)."""
    rng = random.Random(seed)
    kmax = rng.randrange(1, 12)
    single = rng.uniform(1, 30) * MS
    slope = rng.uniform(0.0, 1.2)
    curve = [0.0] + [single * (1 + slope * (n - 1)) for n in range(1, kmax + 2)]
    draft = rng.choice([0.0, rng.uniform(0, 1) * single])
    acc = [rng.uniform(0.0, 1.0) for _ in range(kmax)]
    last = -1
    for step in range(30):
        k = best_k(expected_rates(acc, draft, curve))
        assert k >= last, (step, acc, k, last)
        last = k
        j = rng.randrange(kmax)
        acc[j] = min(1.0, acc[j] + rng.uniform(0, 0.2))
    # and through the model: same costs, one history with more acceptances per position
    lo, hi = CostModel(kmax), CostModel(kmax)
    for cm in (lo, hi):
        cm.observe_verify(1, curve[1])
        cm.observe_verify(kmax + 1, curve[kmax + 1])
        cm.observe_draft(3, 3 * draft)
    for _ in range(10):
        n = rng.randrange(0, kmax + 1)
        lo.observe_acceptance(kmax, n)
        hi.observe_acceptance(kmax, kmax if rng.random() < 0.5 else min(kmax, n + 1))
    # compare only when hi's estimates dominate lo's pointwise (the premise of monotonicity)
    if all(h >= l_ for h, l_ in zip(hi.acceptance(), lo.acceptance())):
        assert best_k(hi.rates()) >= best_k(lo.rates())


def test_cold_start_is_sensible_and_respects_the_limit():
    # before a plain step has been timed: one, since every k is priced against it
    free = CostModel(8, draft_cost_prior=0.0)
    assert free.choose_k() == 0 and free.k_histogram[0] == 1
    free.observe_verify(1, 10 * MS)
    # then a guess that explores (the acceptance is read optimistically while it rests on the prior; the batches
    # follow the slope prior through the one timed size), neither a plain step nor k_max
    assert 1 <= free.choose_k() <= 6
    model = CostModel(8)
    model.observe_verify(1, 10 * MS)
    assert 1 <= model.choose_k() <= 3
    assert CostModel(8).choose_k(0) == 0
    assert CostModel(8, draft_cost_prior=0.0).choose_k(1) <= 1
    assert CostModel(0).choose_k() == 0
    # the first measurement sets the scale of the whole verify curve (slope from the prior)
    cm = CostModel(8, draft_cost_prior=0.0)
    cm.observe_verify(3, 16 * MS)
    v = cm.verify.curve(9)
    assert v[1] == pytest.approx(16 * MS / 1.6)
    assert all(a <= b for a, b in zip(v[1:], v[2:]))
    # ... but a plain-decoding rate read off that guess is never reported as one: only a timed single decode
    assert cm.plain_tokens_per_second_est == 0.0
    cm.observe_verify(1, 11 * MS)
    assert cm.plain_tokens_per_second_est == pytest.approx(1 / (11 * MS))


def test_verify_cost_keeps_the_measured_tiles():
    vc = VerifyCost(9)
    assert not vc.measured
    for _ in range(10):
        vc.observe(1, 10 * MS)
        vc.observe(5, 20 * MS)
    v = vc.curve(9)
    assert v[1] == pytest.approx(10 * MS, rel=1e-6)
    assert v[5] == pytest.approx(20 * MS, rel=1e-6)
    assert v[3] == pytest.approx(15 * MS, rel=1e-6)  # unseen n between measured ones: interpolated
    # beyond: what the largest timed batch cost, until the size is timed itself (an optimism that each size loses
    # when timed: the fitted line through a CPU target's steep start prices long drafts out before they are tried)
    assert v[6] == v[9] == pytest.approx(20 * MS, rel=1e-6)
    vc.observe(9, 24 * MS)
    assert vc.curve(9)[7] == pytest.approx(22 * MS, rel=1e-3)  # now between two timed sizes
    # ... except at whole tiles (multiples of 8), which may cost no more than the timed batch below until timed
    assert vc.curve(9)[8] == pytest.approx(20 * MS, rel=1e-3)
    vc.observe(8, 23 * MS)
    assert vc.curve(9)[8] == pytest.approx(23 * MS, rel=1e-3)
    # a batch that costs less than a smaller one is kept as measured (CPU tiles), not smoothed away
    for _ in range(3):
        vc.observe(4, 12 * MS)
    v = vc.curve(9)
    assert v[4] == pytest.approx(12 * MS, rel=1e-6) and v[3] == pytest.approx(34 / 3 * MS, rel=1e-6)
    # the load doubles: seen only at n = 1, every size follows, the shape stays
    for _ in range(60):
        vc.observe(1, 20 * MS)
    v = vc.curve(9)
    assert v[1] == pytest.approx(20 * MS, rel=0.01)
    assert v[4] > 16 * MS and v[5] / v[4] > 1.5  # (part of the change is taken as n = 1's own shape)
    # garbage is ignored
    vc.observe(2, float("nan"))
    vc.observe(2, -1.0)
    vc.observe(0, 1.0)
    assert vc._weight[2] == 0.0
    # a batch larger than planned grows the table
    vc.observe(20, 40 * MS)
    assert vc.seconds(20) >= vc.seconds(9)


def test_settings_changed_softens_acceptance_and_keeps_costs():
    cm = CostModel(6, draft_cost_prior=0.0)
    simulate(cm, 100, f16_verify, 0.0, 0.95)
    before = cm.acceptance()
    v_before = list(cm.verify.curve(7))
    assert before[0] > 0.9
    same = CostModel(6, draft_cost_prior=0.0)
    simulate(same, 100, f16_verify, 0.0, 0.95)
    cm.settings_changed()
    assert sum(cm._seen) <= 0.1 * sum(same._seen) + 1e-9  # the evidence shrank, its estimate did not move
    assert cm.verify.curve(7) == v_before
    # a few rounds under the new settings (tau lowered: much lower acceptance) take over
    for _ in range(8):
        cm.observe_acceptance(6, 0)
    assert cm.acceptance()[0] < 0.4
    for _ in range(10):
        cm.observe_acceptance(6, 0)
    assert cm.acceptance()[0] < 0.2
    for _ in range(15):  # without being told, the same change takes much longer to show
        same.observe_acceptance(6, 0)
    assert same.acceptance()[0] > 0.4


def test_acceptance_counts_only_reached_positions():
    cm = CostModel(4, accept_prior_weight=1e-9, position_weight=1e-9)
    cm.observe_acceptance(4, 1)  # position 1 passed, 2 failed, 3 and 4 never reached
    a = cm.acceptance()
    assert a[0] == pytest.approx(1.0) and a[1] == pytest.approx(0.0, abs=1e-6)
    assert a[2] == pytest.approx(0.5)  # never reached: the pooled rate of the reached positions (1 of 2)
    cm.observe_acceptance(2, 2)  # a short draft fully accepted: nothing learned about position 3
    assert cm._seen[2] == 0.0 and cm._acc[2] == 0.0
    cm.observe_acceptance(0, 0)
    cm.observe_acceptance(7, 7)  # more than k_max drafted (the engine's limit changed): grows
    assert len(cm.acceptance()) == 7


def auto_lengths(draft_max: int = 8):
    """A DraftLength started under the `auto` policy with greedy sd settings."""
    from fsd_local.drafting.length import DraftLength
    from fsd_local.settings import Settings

    lengths = DraftLength()
    lengths.start(Settings(mode="sd", draft_policy="auto", draft_max=draft_max))
    return lengths


def test_draft_length_keeps_acceptance_per_source_and_drafts_long_only_where_it_is_earned():
    """Two sources share the target's costs: long prompt-lookup matches (class 4) that are always accepted and
    unigram matches (class 0) that never are. The policy learns each apart: long drafts for the first, plain
    steps for the second, where one pooled rate would draft a middling k for both."""

    lengths = auto_lengths()
    rng = random.Random(0)
    good, bad = ("ngram", 4), ("ngram", 0)
    chosen: dict = {good: [], bad: []}
    for _ in range(300):
        source = good if rng.random() < 0.5 else bad
        k = lengths.choose(source, 64)
        n_acc = k if source == good else 0
        lengths.observe(source if k else None, k, n_acc, 0.0, k + 1, q4_verify(k + 1) * 0.4 + 6 * MS)
        chosen[source].append(k)
    assert min(chosen[good][50:]) >= 6, chosen[good][-20:]
    assert share(chosen[bad][50:], lambda k: k == 0) >= 0.9, chosen[bad][-20:]


def test_declined_lookup_proposals_are_scored_against_the_text_and_bring_drafting_back():
    """A class the policy stopped drafting from (its matches were rejected) learns from the proposals it
    declines: each is scored against what the target wrote, so when copying starts the policy drafts again
    within a few rounds, without waiting for a probe."""

    lengths = auto_lengths()
    src = ("ngram", 2)
    for _ in range(30):  # a compute-bound target and matches that are always rejected: plain steps
        k = lengths.choose(src, 64)
        lengths.observe(src if k else None, k, 0, 0.0, k + 1, q4_verify(k + 1) * 0.4 + 6 * MS)
    assert lengths.choose(src, 64) == 0
    cm = lengths.cost(src)
    probes = cm.probes
    text = list(range(1000, 1100))  # now the target copies: every proposal would have been accepted
    seq: list[int] = []
    chosen = []
    for i in range(12):
        lengths.score_shadow(seq)
        k = lengths.choose(src, 64)
        chosen.append(k)
        if k == 0:
            lengths.shadow(src, text[i : i + 8], len(seq))
        seq.append(text[i])  # a plain step writes one token; the shadow is scored once all 8 are known
        lengths.observe(src if k else None, k, k, 0.0, k + 1, q4_verify(k + 1) * 0.4 + 6 * MS)
        if k:
            seq.extend(text[i + 1 : i + 1 + k])
            break
    assert chosen[-1] > 0, chosen
    assert cm.probes == probes  # the evidence came from the shadows, not from a probe


def test_a_shadow_scores_the_matching_prefix_and_is_dropped_when_the_text_rewinds():

    lengths = auto_lengths()
    src = ("ngram", 1)
    cm = lengths.cost(src)
    lengths.shadow(src, [5, 6, 7, 8], 3)
    lengths.shadow(src, [9, 9], 4)  # one shadow at a time: ignored
    lengths.score_shadow([0, 1, 2, 5])  # one token known, it matches: not decided yet
    assert sum(cm._seen) == 0
    lengths.score_shadow([0, 1, 2, 5, 6, 4])  # the third differs: positions 1, 2 accepted, 3 rejected
    assert cm._seen[:4] == [1.0, 1.0, 1.0, 0.0] and cm._acc[:3] == [1.0, 1.0, 0.0]
    lengths.shadow(src, [5, 6], 3)
    lengths.score_shadow([0, 1])  # rewound below the proposal
    lengths.shadow(src, [7], 9)  # a new shadow can open: the old one was dropped
    assert lengths._shadow == (src, [7], 9)


def test_a_draft_model_far_behind_the_text_drafts_only_if_it_pays_for_its_catch_up():
    """Drafting after plain steps first costs the draft model's catch-up on the skipped text: a draft length that
    pays when the model is current (k > 0) must not be taken when catching up would eat the gain."""
    from fsd_local.drafting.proposer import MODEL

    lengths = auto_lengths()
    for i in range(40):  # plain steps 20 ms; k = 1 rounds: 2 ms drafting + 24 ms verifying, half accepted
        lengths.observe(None, 0, 0, 0.0, 1, 20 * MS)
        lengths.observe(MODEL, 1, i % 2, 2 * MS, 2, 24 * MS)
    lengths.observe_catch_up(30, 60 * MS)  # 2 ms a token to evaluate skipped text
    assert lengths.choose(MODEL, 64, behind=2) >= 1  # current: 1.5 tokens in 26 ms beat 1 in 20 ms
    cm = lengths.cost(MODEL)
    probes = cm.probes
    assert lengths.choose(MODEL, 64, behind=30) == 0  # 60 ms of catch-up first: plain decoding is faster
    assert cm.probes == probes


def test_histogram_and_summary():
    cm = CostModel(5, draft_cost_prior=0.0)
    chosen = simulate(cm, 50, f16_verify, 0.0, 0.8)
    assert sum(cm.k_histogram) == cm.rounds == 50
    assert cm.k_histogram == [chosen.count(k) for k in range(6)]
    s = cm.summary()
    import json

    json.dumps(s)
    assert len(s["verify_seconds_est"]) == 6 and len(s["acceptance_est"]) == 5
    assert s["plain_tokens_per_second_est"] == (1 / f16_verify(1) if 0 in chosen else 0.0)


# recorded: one decode of a batch of n tokens on the padded 1.4 GB Q8_0 target (`--demo wide`, docs/models.md),
# 2 threads: llama.cpp's CPU kernels work in tiles of 4 and 8 rows, so 8 rows cost about what 5 cost
TILED_MS = [150, 171, 202, 225, 303, 313, 355, 312, 405]


def test_tiled_costs_pick_the_efficient_batch():
    """With the measured per-n costs the policy drafts up to the next efficient batch: k + 1 = 8 (312 ms), not 5
    (303 ms), when acceptance is good; smoothing the curve to be non-decreasing would have hidden it."""
    curve = [0.0] + [ms * MS for ms in TILED_MS]
    acc = [0.9] * 8
    rates = expected_rates(acc, 13 * MS, curve)
    assert best_k(rates) == 7 and rates[7] > rates[4]
    smoothed = [0.0] + [max(curve[1 : n + 1]) for n in range(1, 10)]  # what a monotone curve would say
    assert best_k(expected_rates(acc, 13 * MS, smoothed)) != 7
    # through the model: the sizes measured once each (Engine.measure_costs), then rounds at k = 7
    cm = CostModel(8)
    for n, ms in enumerate(TILED_MS, start=1):
        cm.observe_verify(n, ms * MS)
    assert cm.verify.curve(9)[1:] == pytest.approx(curve[1:])
    rng = random.Random(0)
    chosen = []
    for _ in range(200):
        k = cm.choose_k()
        chosen.append(k)
        if k:
            cm.observe_draft(k, 13 * MS * k)
            n_acc = 0
            while n_acc < k and rng.random() < 0.9:
                n_acc += 1
            cm.observe_acceptance(k, n_acc)
        cm.observe_verify(k + 1, curve[k + 1])
    tail = chosen[50:]
    assert tail.count(7) >= 0.7 * len(tail), cm.k_histogram
    assert tail.count(4) == 0, cm.k_histogram
    # with k + 1 = 8 out of reach (k_max 6), a batch of 4 (225 ms) beats 5..7 (303..355 ms)
    assert best_k(expected_rates(acc[:6], 13 * MS, curve)) == 3


def test_recorded_prices_replace_the_costs_loaded_from_the_store_and_those_timed_later(tmp_path):
    """`DraftLength.prices` replaces every measured cost: what the cost store held when the engine loaded (10x
    dearer here) and what is timed after the table is set (calibration's restore and measure path) never mix in."""
    import json

    from fsd_local.drafting.calibration import CATCH_UP_BATCH, CostStore
    from fsd_local.drafting.length import CostTable, DraftLength

    stored = {"sizes": {str(n): 0.4 * n for n in range(1, 6)}, "draft": 0.1, "catch_up": 0.05}
    (tmp_path / "costs.json").write_text(json.dumps({"pair": stored}))
    lengths = DraftLength()
    CostStore(tmp_path / "costs.json", "pair").load(lengths)
    model = lengths.cost(("model", 0))
    assert lengths.verify.seconds(3) == pytest.approx(1.2) and model.draft_seconds_per_token() == pytest.approx(0.1)
    table = CostTable([0.0, 0.04, 0.05, 0.06], draft=0.01, catch_up=0.005)
    lengths.prices = table
    assert not lengths.verify.measured and not model.draft_measured and lengths.measured_catch_up_seconds == 0.0
    lengths.observe_batch(2, 9.0)  # timed at load, or restored from a store, after the table was set
    lengths.observe_draft_token(9.0)
    lengths.observe_catch_up(CATCH_UP_BATCH, 9.0)
    lengths.observe(("model", 0), 2, 1, 9.0, 3, 9.0)  # a round
    lengths.observe(None, 0, 0, 0.0, 1, 9.0)  # a plain step
    assert lengths.verify.measured_sizes() == pytest.approx({1: 0.04, 2: 0.05, 3: 0.06})
    assert model.draft_seconds_per_token() == pytest.approx(0.01)
    assert lengths.catch_up_seconds(10, model) == pytest.approx(10 * 0.005)


def test_the_rework_of_a_checkpointed_target_is_the_expected_tokens_a_rejection_decodes_again():
    """R(k) in expected_rates: a rejection at draft i+1 (the first i accepted) makes the target decode the round's
    first token and those i again; enumerated over every outcome of k = 3 with uneven acceptance."""
    acc, curve, c_d, r = [0.8, 0.5, 0.3], [0.0, 1.0, 1.2, 1.4, 1.6], 0.1, 0.2
    for k in range(1, 4):
        e = redo = 0.0
        for i in range(k + 1):  # i drafts accepted
            p = math.prod(acc[:i]) * (1.0 - acc[i] if i < k else 1.0)
            e += p * (i + 1)
            redo += p * (i + 1 if i < k else 0)
        want = e / (k * c_d + curve[k + 1] + r * redo)
        assert expected_rates(acc, c_d, curve, rework=r)[k] == pytest.approx(want, rel=1e-12)
    assert expected_rates(acc, c_d, curve)[1:] > expected_rates(acc, c_d, curve, rework=r)[1:]


def test_a_target_that_decodes_a_rejected_round_again_is_drafted_for_only_where_that_pays():
    """A compute-bound target (each token of a batch 0.4 of a decode), drafts at 0.01 of one accepted half the
    time: one draft a round pays ~9% where a rejection costs nothing more, and loses ~4% where the target decodes
    the round's first token again (a Mamba target's checkpoint): the policy takes plain steps there."""

    def verify(n):
        return 9 * MS * (1 + 0.4 * (n - 1))

    def taught(redecode: bool) -> CostModel:
        cm = CostModel(1)
        cm.verify.redecode = redecode
        for i in range(200):  # the same evidence for both: sizes 1 and 2 timed, every other draft accepted
            cm.observe_verify(1 + i % 2, verify(1 + i % 2))
            cm.observe_draft(1, 0.09 * MS)
            cm.observe_acceptance(1, (i + 1) // 2 - i // 2)
        return cm

    free, redecoding = taught(False), taught(True)
    assert free.rates()[1] > 1.05 * free.rates()[0] and free.choose_k() == 1
    assert redecoding.verify.rework() == pytest.approx(0.4 * 9 * MS, rel=1e-6)  # the measured slope
    assert redecoding.rates()[1] < 0.98 * redecoding.rates()[0] and redecoding.choose_k() == 0
    # a free drafter accepted 90% of the time drafts long even so: the rework is priced, not a ban
    eager = CostModel(8, draft_cost_prior=0.0)
    eager.verify.redecode = True
    tail = simulate(eager, 300, verify, 0.0, 0.9, redecode=True)[100:]
    assert share(tail, lambda k: k >= 2) >= 0.9, eager.k_histogram
