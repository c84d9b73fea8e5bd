"""The lossy rules beyond FSD's divergence threshold (kernels/rules.py): each kernel against its float64
reference on random and adversarial rows, the entropy kernel, and the acceptance kernel with every rule: tau = 0
is exactly sd (greedy and sampled), accepted slots never fall as tau grows, NaN never accepts, the rules rescue
only where the SD test failed and record the smallest rescuing tau."""

import math

import numpy as np
import pytest

from fsd_local.kernels import sampling as S
from fsd_local.kernels.accept import BY_FUZZY, BY_SD, REJECTED, Drafts, Rule, Sampling, accept_round, round_out
from fsd_local.kernels.budget import new_budget
from fsd_local.kernels.divergence import DIVERGENCES, compute
from fsd_local.kernels.names import CASCADE, FSD_ENTROPY, MODES, RELAXED, SD, TARGET_RULES, TAU_MODES, TYPICAL
from fsd_local.kernels.rows import row_entropy, row_lse
from fsd_local.kernels.rules import entropy_scaled, target_rule
from support import reference_rules as ref
from support.rounds import random_round

RULE_CODES = {"typical": TYPICAL, "cascade": CASCADE, "relaxed": RELAXED}
NEW_MODES = ("typical", "cascade", "relaxed", "fsd-entropy")
RTOL = 1e-4


def kernel_rule(mode, x, d, tau, eps=0.09, alpha=0.3, k=10):
    x = np.ascontiguousarray(x, np.float32)
    n = x.shape[0]
    return target_rule(RULE_CODES[mode], x, row_lse(x, n), d, n, tau, eps, alpha, k)


def close(a, b, rtol=RTOL, atol=1e-6):
    if math.isnan(b) or math.isinf(b):
        return a == b or (math.isnan(a) and math.isnan(b))
    return abs(a - b) <= rtol * abs(b) + atol


def random_row(seed, n, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def adversarial_rows():
    n = 4096
    x = random_row(1, n)
    masked = x.copy()
    masked[::3] = -np.inf
    one_hot = np.full(n, -np.inf, np.float32)
    one_hot[7] = 0.0
    near_one_hot = np.zeros(n, np.float32)
    near_one_hot[3] = 30.0
    two_way = np.full(n, -50.0, np.float32)
    two_way[[5, 9]] = 10.0  # a fair coin between two tokens
    ties = np.zeros(n, np.float32)
    ties[:20] = 5.0  # twenty tokens tied at the top
    return {
        "random": x,
        "masked": masked,
        "one-hot": one_hot,
        "near one-hot": near_one_hot,
        "flat": np.zeros(n, np.float32),
        "two-way": two_way,
        "ties": ties,
        "huge": (np.random.default_rng(2).standard_normal(n) * 1e3).astype(np.float32),
        "large offset": x + np.float32(1e3),
    }


def draft_tokens(x):
    """Tokens at every rank that matters: the top, near the top, the middle, the bottom, a masked one."""
    order = np.argsort(-x.astype(np.float64), kind="stable")
    toks = [int(order[i]) for i in (0, 1, 2, 5, 9, 10, 11, 50) if i < len(order)]
    toks += [int(order[len(order) // 2]), int(order[-1])]
    return toks


# ---------------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("case", list(adversarial_rows()))
def test_entropy_matches_reference(case):
    x = adversarial_rows()[case]
    n = x.shape[0]
    assert close(row_entropy(x, n, row_lse(x, n)), ref.entropy(x), atol=2e-6)


@pytest.mark.parametrize("n", [100, 49152, 262144 + 7])
def test_entropy_of_random_rows_matches_reference(n):
    for seed in range(3):
        x = random_row(seed, n, scale=1.0 + 2 * seed)
        assert close(row_entropy(x, n, row_lse(x, n)), ref.entropy(x))


def test_entropy_of_uniform_rows_is_log_n_and_nan_rows_give_nan():
    for n in (2, 1000, 49152):
        x = np.full(n, 3.5, np.float32)
        assert row_entropy(x, n, row_lse(x, n)) == pytest.approx(math.log(n), rel=1e-5)
    x = random_row(0, 100)
    x[4] = np.nan
    assert math.isnan(row_entropy(x, 100, row_lse(x, 100)))
    dead = np.full(10, -np.inf, np.float32)
    assert math.isnan(row_entropy(dead, 10, row_lse(dead, 10)))


@pytest.mark.parametrize("mode", TARGET_RULES)
@pytest.mark.parametrize("case", list(adversarial_rows()))
def test_rules_match_reference_on_adversarial_rows(mode, case):
    x = adversarial_rows()[case]
    for d in draft_tokens(x):
        for eps, alpha, k in ((0.09, 0.3, 10), (0.5, 2.0, 1), (0.0, 0.0, 3)):
            want = ref.critical_tau(mode, x, d, eps=eps, alpha=alpha, k=k)
            _, got = kernel_rule(mode, x, d, 0.5, eps, alpha, k)
            assert close(got, want), (mode, case, d, got, want)


@pytest.mark.parametrize("mode", TARGET_RULES)
@pytest.mark.parametrize("n", [100, 49152])
def test_rules_match_reference_on_random_rows_and_decide_as_it_does(mode, n):
    taus = (0.0, 0.01, 0.1, 0.3, 0.5, 0.9, 0.95, 1.0, 1.1, 3.0)
    for seed in range(4):
        x = random_row(seed, n, scale=1.0 + seed)
        for d in draft_tokens(x):
            want = ref.critical_tau(mode, x, d)
            for tau in taus:
                ok, got = kernel_rule(mode, x, d, tau)
                assert close(got, want), (mode, seed, d, got, want)
                if abs(tau - want) > 1e-4:  # away from the boundary, rounding cannot flip the decision
                    assert bool(ok) == ref.rescues(mode, x, d, tau), (mode, seed, d, tau)


def test_masked_and_nan_never_rescued():
    x = random_row(3, 500)
    x[17] = -np.inf
    for mode in TARGET_RULES:
        ok, crit = kernel_rule(mode, x, 17, 1e9)
        assert not ok and crit == math.inf, mode
        y = x.copy()
        y[3] = np.nan
        ok, crit = kernel_rule(mode, y, 4, 1e9)
        assert not ok and math.isnan(crit), mode
    ok, crit = entropy_scaled(np.nan, x, row_lse(x, 500), 500, 1e9)
    assert not ok and math.isnan(crit)


def test_rule_definitions_on_a_hand_made_row():
    # p = (0.5, 0.3, 0.2): max p = 0.5, H = 1.0297 nats
    x = np.log(np.array([0.5, 0.3, 0.2], np.float32))
    h = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2))
    m = min(0.09, 0.3 * math.exp(-h))
    assert kernel_rule("typical", x, 2, 1.0)[0]  # tau = 1 is Medusa's rule: p(d) = 0.2 > m
    assert kernel_rule("typical", x, 2, 1.0)[1] == pytest.approx(0.8 / (1 - m), rel=1e-5)
    assert not kernel_rule("cascade", x, 2, 0.59)[0] and kernel_rule("cascade", x, 2, 0.61)[0]  # 0.2 >= 0.4 * 0.5
    assert not kernel_rule("relaxed", x, 2, 0.29)[0] and kernel_rule("relaxed", x, 2, 0.31)[0]  # 0.2 >= 0.5 - 0.3
    assert not kernel_rule("relaxed", x, 2, 0.9, k=2)[0]  # third in rank: outside the top 2
    assert kernel_rule("relaxed", x, 1, 0.9, k=2)[0]
    # fsd-entropy: the threshold is tau (1 - exp(-H))
    g = 1 - math.exp(-h)
    ok, crit = entropy_scaled(0.1, x, row_lse(x, 3), 3, 0.1 / g + 1e-6)
    assert ok and crit == pytest.approx(0.1 / g, rel=1e-5)
    assert not entropy_scaled(0.1, x, row_lse(x, 3), 3, 0.1 / g - 1e-4)[0]


def test_entropy_scale_is_zero_where_the_target_is_sure_and_one_half_for_a_coin():
    sure = np.full(64, -np.inf, np.float32)
    sure[3] = 0.0
    ok, crit = entropy_scaled(0.01, sure, 0.0, 64, 1e9)
    assert not ok and crit == math.inf  # no drift is cheap where the target is certain
    assert entropy_scaled(0.0, sure, 0.0, 64, 1e9) == (True, 0.0)
    coin = np.full(64, -np.inf, np.float32)
    coin[[1, 2]] = 0.0
    assert entropy_scaled(0.1, coin, row_lse(coin, 64), 64, 0.2)[1] == pytest.approx(0.2, rel=1e-6)


# ---------------------------------------------------------------------------------------------- one round
def run_accept(P, Q, drafts, mode, tau, temperature=0.0, uniforms=None, div="js", onehot=False, lossless=(), **knobs):
    k = len(drafts)
    n = P.shape[1]
    q_stats = np.zeros((k + 1, 3), np.float32)
    q_prob = np.ones(k)
    if onehot:
        Q = np.full((k, n), -np.inf, np.float32)
        Q[np.arange(k), drafts] = 0.0
    elif temperature > 0:
        for i in range(k):
            mx, cut, lz = S.processed(Q[i], n, temperature, 0, 1.0, 0.0)
            q_stats[i] = (mx, cut, lz)
            q_prob[i] = S.prob(Q[i], drafts[i], temperature, mx, cut, lz)
    out = round_out(k)
    us = np.zeros(k + 1) if uniforms is None else uniforms
    strict = np.zeros(k, np.uint8)
    strict[list(lossless)] = 1
    draft = Drafts(Q, np.asarray(drafts, np.int32), q_prob, q_stats, np.full(k, int(onehot), np.uint8), lossless=strict)
    rule = Rule(MODES.index(mode), DIVERGENCES.index(div), float(tau), 50, **knobs)
    acc, nxt = accept_round(
        P, draft, k, n, rule, Sampling(float(temperature), 0, 1.0, 0.0), us, out, new_budget(None, k)
    )
    return acc, nxt, out.reason.copy(), out.divergence.copy()


@pytest.mark.parametrize("mode", NEW_MODES)
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
@pytest.mark.parametrize("onehot", [False, True])
def test_tau_zero_is_exactly_sd(mode, temperature, onehot):
    for seed in range(12):
        P, Q, drafts = random_round(seed, spread=0.2 + 0.2 * seed)
        us = np.random.default_rng(seed).random(len(drafts) + 1)
        sd = run_accept(P, Q, drafts, "sd", 0.0, temperature, us, onehot=onehot)
        got = run_accept(P, Q, drafts, mode, 0.0, temperature, us, onehot=onehot)
        assert got[:2] == sd[:2] and np.array_equal(got[2], sd[2]), (seed, got, sd)
        assert np.all(np.isnan(got[3])), "tau = 0 evaluates no rule"


@pytest.mark.parametrize("mode", NEW_MODES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("onehot", [False, True])
def test_accepted_slots_never_fall_as_tau_grows(mode, temperature, onehot):
    taus = [0.0, 0.001, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.95, 1.0, 1.05, 1.5, 2.0, 5.0, 1e9]
    divs = DIVERGENCES if mode == "fsd-entropy" else ("js",)
    for div in divs:
        for seed in range(8):
            P, Q, drafts = random_round(seed, spread=0.3 + 0.2 * seed)
            us = np.random.default_rng(seed).random(len(drafts) + 1)
            prev = -1
            for tau in taus:
                acc, *_ = run_accept(P, Q, drafts, mode, tau, temperature, us, div, onehot, relaxed_k=1 + seed)
                assert acc >= prev, (div, seed, tau)
                prev = acc


@pytest.mark.parametrize("mode", NEW_MODES)
def test_rules_rescue_only_where_sd_failed_and_record_the_rescuing_tau(mode):
    P, Q, drafts = random_round(1, spread=0.8)
    tau = 1e9
    acc, _, reason, crit = run_accept(P, Q, drafts, mode, tau)
    assert acc >= 1
    for i in range(acc):
        agrees = drafts[i] == int(np.argmax(P[i]))
        assert reason[i] == (BY_SD if agrees else BY_FUZZY)
        assert np.isnan(crit[i]) == agrees, "the rule is evaluated only where the SD test failed"
        if not agrees:
            div = compute("js", P[i], Q[i]) if mode == "fsd-entropy" else None
            want = ref.critical_tau(mode, P[i], drafts[i], divergence=div)
            assert close(crit[i], want, rtol=1e-3), (i, crit[i], want)
    # the recorded value is the smallest tau that rescues: just above it the slot is accepted, below it not
    P, Q, drafts = random_round(5, spread=1.5)
    drafts[0] = int(np.argsort(-P[0])[1])  # the target's second choice: the SD test fails, the rules can rescue
    _, _, _, crit = run_accept(P, Q, drafts, mode, 1e9)
    c = crit[0]
    assert math.isfinite(c) and c > 0
    assert run_accept(P, Q, drafts, mode, c * 1.001 + 1e-9)[2][0] == BY_FUZZY
    assert run_accept(P, Q, drafts, mode, c * 0.999)[2][0] == REJECTED


@pytest.mark.parametrize("mode", TAU_MODES)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("onehot", [False, True])
def test_a_lossless_only_slot_is_judged_as_sd_judges_it(mode, temperature, onehot):
    """A slot flagged lossless-only (a token that would end the reply: round.py) is never rescued, by any rule at
    any tau: it is accepted and, if not, replaced exactly as `sd` would with the same uniforms; the slots before
    it are judged by the rule as before (here every one is rescued or passes)."""
    rescued_before = 0
    for seed in range(16):
        P, Q, drafts = random_round(seed, spread=1.0 + 0.2 * seed)
        k = len(drafts)
        us = np.random.default_rng(seed).random(k + 1)
        j = seed % k
        drafts[j] = int(np.argsort(-P[j])[1 + seed % 3])  # not the target's argmax: greedy SD fails there
        loose = run_accept(P, Q, drafts, mode, 1e9, temperature, us, onehot=onehot, relaxed_k=500)
        got = run_accept(P, Q, drafts, mode, 1e9, temperature, us, onehot=onehot, lossless=[j], relaxed_k=500)
        assert got[0] <= loose[0] and np.array_equal(got[2][:j], loose[2][:j])  # the slots before j: as before
        if got[0] < j:
            continue  # the rule itself stopped before j (fsd-entropy on a sure row)
        rescued_before += int(np.sum(got[2][:j] == BY_FUZZY))
        # from slot j on, the round is sd's: the same uniforms, the slots before j accepted as they were
        sd_us = us.copy()
        sd_us[:j] = 0.0  # u = 0 passes the SD test wherever p~(d) > 0: sd reaches j like the rule did
        sd_drafts = list(drafts)
        sd_drafts[:j] = [int(np.argmax(P[i])) if got[2][i] == BY_FUZZY else drafts[i] for i in range(j)]
        sd = run_accept(P, Q, sd_drafts, "sd", 0.0, temperature, np.where(np.arange(k + 1) < j, 0.0, us), onehot=onehot)
        assert got[2][j] != BY_FUZZY, (seed, j, got)
        if temperature == 0.0:
            assert got[0] == j and got[1] == int(np.argmax(P[j])), (seed, j, got)
        assert sd[0] >= j
        assert (got[0] > j) == (sd[0] > j) and (got[0] > j or got[1] == sd[1]), (seed, j, got, sd)
    if mode != "fsd-entropy":
        assert rescued_before > 0  # the flag is per slot: the rule still rescued before it


@pytest.mark.parametrize("mode", NEW_MODES)
def test_nan_rows_never_accept(mode):
    P, Q, drafts = random_round(2)
    drafts = [(int(np.argmax(P[i])) + 1) % P.shape[1] for i in range(len(drafts))]  # SD fails everywhere
    P[0, 5] = np.nan
    acc, _, reason, crit = run_accept(P, Q, drafts, mode, 1e9)
    assert acc == 0 and reason[0] == REJECTED and math.isnan(crit[0])


def test_names_are_consistent():
    assert set(TAU_MODES) == {"fsd", "fsd-paper", *NEW_MODES}
    assert SD == MODES.index("sd") and FSD_ENTROPY == MODES.index("fsd-entropy")
