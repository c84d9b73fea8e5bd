"""The drafting helpers of issue 12: prompt lookup (ngram), the `auto` draft-length cost model, and the
divergences of a target row against a one-hot draft distribution."""

from __future__ import annotations

import math
import random
import re
from time import perf_counter

import numpy as np
import pytest

from fsd_local.drafting.ngram import MATCH_LENGTH_CAP, NgramDrafter, match_class

# ---------------------------------------------------------------------------------------------- ngram

CODE = """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)

def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)
"""


def word_tokens(text: str, vocab: dict) -> list[int]:
    """A stand-in tokenizer: words, punctuation and newlines become ids (real text, real repetition)."""
    return [vocab.setdefault(w, len(vocab)) for w in re.findall(r"\w+|[^\w\s]|\n", text)]


def brute_force(history, k, ngram_min, ngram_max, periodic=True):
    """The definition, by rescanning: longest n first, most recent earlier occurrence with a follower."""
    size = len(history)
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        tail = history[size - n :]
        for s in range(size - n - 1, -1, -1):
            if history[s : s + n] == tail:
                ext = list(history)
                out = []
                while len(out) < k and s + n + len(out) < len(ext):
                    out.append(ext[s + n + len(out)])
                    if periodic:
                        ext.append(out[-1])
                return out
    return []


def test_proposes_what_followed_the_earlier_occurrence():
    vocab: dict = {}
    toks = word_tokens(CODE, vocab)
    # the output has started rewriting the second function's loop: "for v in"
    history = toks + word_tokens("def variance(values):\n    m = mean(values)\n    total = 0\n    for v in", vocab)
    d = NgramDrafter(1, 3)
    got = d.propose(history, 5)
    assert got == word_tokens(" values:\n    total +", vocab)
    assert d.last_match[0] == 3
    assert got == brute_force(history, 5, 1, 3)


def test_longest_n_is_preferred_over_a_more_recent_shorter_match():
    #        0  1  2  3  4  5  6  7  8  9
    hist = [1, 2, 3, 40, 9, 3, 50, 9, 1, 2, 3]
    # the 3-gram (1, 2, 3) occurred at 0 (followed by 40); the unigram 3 occurred later, at 5 (followed by 50)
    d = NgramDrafter(1, 3)
    assert d.propose(hist, 1) == [40]
    assert d.last_match == (3, 0)
    assert NgramDrafter(1, 1).propose(hist, 1) == [50]


def test_most_recent_occurrence_wins():
    hist = [7, 8, 1, 7, 8, 2, 7, 8, 3, 5, 7, 8]
    assert NgramDrafter(1, 3).propose(hist, 1) == [3]
    assert NgramDrafter(1, 3).last_match is None  # fresh drafter, nothing proposed yet


def test_no_match_and_short_histories():
    d = NgramDrafter(1, 3)
    assert d.propose([1, 2, 3, 4, 5], 4) == []
    assert d.last_match is None
    assert d.propose([], 4) == []
    assert d.propose([9], 4) == []
    assert NgramDrafter(2, 3).propose([5, 1, 2, 5], 3) == []  # only a unigram matches; min is 2
    assert NgramDrafter(1, 3).propose([5, 1, 2, 5], 0) == []


def test_k_limits_and_periodic_continuation():
    hist = [1, 2, 3, 4, 5, 6, 1, 2]
    d = NgramDrafter(1, 3)
    assert d.propose(hist, 2) == [3, 4]
    assert d.propose(hist, 4) == [3, 4, 5, 6]
    # the continuation reaches the end of the history: it goes on with the proposal itself
    assert d.propose(hist, 8) == [3, 4, 5, 6, 1, 2, 3, 4]
    assert NgramDrafter(1, 3, periodic=False).propose(hist, 8) == [3, 4, 5, 6, 1, 2]
    # a repeated token is a period-1 pattern
    assert NgramDrafter(1, 3).propose([4, 9, 9, 9], 3) == [9, 9, 9]


def test_match_length_is_how_far_the_text_agrees_before_the_match():
    #        0  1  2  3  4  5  6  7  8  9
    hist = [1, 2, 3, 4, 9, 6, 2, 3, 4]
    d = NgramDrafter(1, 3)
    assert d.propose(hist, 1) == [9] and d.last_match == (3, 1)
    assert d.match_length == 3  # hist[0] = 1 differs from hist[5] = 6
    hist = [1, 2, 3, 4, 9, 1, 2, 3, 4]
    assert d.propose(hist, 1) == [9] and d.match_length == 4  # agrees back to the start of the text
    # a copied block: the agreement grows with every copied token, capped
    block = list(range(100, 150))
    d.propose(block + [0] + block[:40], 2)
    assert d.match_length == MATCH_LENGTH_CAP
    assert d.propose([5, 6], 2) == [] and d.match_length == 0
    # a periodic run agrees with itself shifted by its period
    d.propose([7, 7, 7, 7, 7, 7], 2)
    assert d.match_length == 5


def test_match_classes():
    assert [match_class(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 5]


@pytest.mark.parametrize("seed", range(6))
def test_random_histories_match_the_definition_with_appends_and_rewinds(seed):
    rng = random.Random(seed)
    lo, hi = rng.choice([(1, 3), (1, 4), (2, 3), (2, 2)])
    d = NgramDrafter(lo, hi)
    hist: list[int] = []
    for _ in range(300):
        r = rng.random()
        if r < 0.15 and hist:  # the engine's text shrinks (a new prompt sharing only a prefix)
            hist = hist[: rng.randrange(len(hist) + 1)] + [rng.randrange(6) for _ in range(rng.randrange(3))]
        else:
            hist = hist + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        k = rng.randrange(0, 7)
        assert d.propose(hist, k) == (brute_force(hist, k, lo, hi) if k > 0 else []), (hist, k)


@pytest.mark.parametrize("seed", range(4))
def test_rewind_leaves_exactly_a_fresh_index(seed):
    rng = random.Random(100 + seed)
    hist = [rng.randrange(5) for _ in range(400)]
    d = NgramDrafter(1, 4)
    d.sync(hist)
    for cut in (399, 350, 397, 120, 5, 1, 0):
        d.truncate(cut)
        fresh = NgramDrafter(1, 4)
        fresh.sync(hist[:cut])
        assert d.snapshot() == fresh.snapshot(), cut
        d.sync(hist)  # and growing back gives the full index again
        full = NgramDrafter(1, 4)
        full.sync(hist)
        assert d.snapshot() == full.snapshot()
    # sync with a history that diverges in the middle: rewind to the common prefix, then append
    other = hist[:200] + [9, 9, 8] + hist[300:]
    d.sync(other)
    fresh = NgramDrafter(1, 4)
    fresh.sync(other)
    assert d.snapshot() == fresh.snapshot()


def test_sync_accepts_tuples_and_numpy_ints():
    d = NgramDrafter()
    d.sync(tuple(np.array([1, 2, 3, 1, 2], dtype=np.int32)))
    assert d.propose(np.array([1, 2, 3, 1, 2], dtype=np.int64).tolist(), 2) == [3, 1]
    assert all(type(t) is int for t in d.snapshot()[0])


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        NgramDrafter(0, 3)
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)


def test_speed_for_a_4k_token_history(capsys):
    """Printed, not asserted (the machine is shared): the cost of indexing a 4k prompt and of one round."""
    rng = random.Random(0)
    vocab: dict = {}
    base = word_tokens(CODE, vocab)
    prompt = []
    while len(prompt) < 4096:  # text with repetition, like a code-edit prompt, plus noise tokens
        prompt += base[rng.randrange(len(base)) :][: rng.randrange(5, 40)] + [rng.randrange(1000, 49152)]
    prompt = prompt[:4096]
    d = NgramDrafter()
    t = perf_counter()
    d.sync(prompt)
    t_index = perf_counter() - t
    hist = list(prompt)
    rounds, hits = 300, 0
    t = perf_counter()
    for i in range(rounds):
        out = d.propose(hist, 8)
        hits += bool(out)
        hist.extend(out[:3] if out else [rng.randrange(1000, 49152)])  # the engine's seq grows by what it accepted
    t_round = (perf_counter() - t) / rounds
    t = perf_counter()
    for i in range(rounds):  # the caller keeps the index current itself: extend + draft
        out = d.draft(8)
        d.extend(out[:3] if out else [rng.randrange(1000, 49152)])
    t_draft = (perf_counter() - t) / rounds
    fresh = NgramDrafter()
    fresh.sync(d.snapshot()[0])
    assert fresh.snapshot() == d.snapshot()
    with capsys.disabled():
        print(
            f"\nngram: index 4096 tokens {t_index * 1e3:.2f} ms; propose(history) per round {t_round * 1e6:.1f} us "
            f"at ~{len(hist)} tokens ({hits}/{rounds} rounds matched); extend+draft {t_draft * 1e6:.1f} us"
        )


# ---------------------------------------------------------------------------------------------- one-hot divergences

from fsd_local.kernels import divergence as D
from fsd_local.kernels import onehot as O
from fsd_local.kernels import reference_onehot as R
from fsd_local.kernels.rows import row_lse

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


def test_onehot_speed(capsys):
    """Printed, not asserted: the O(1) forms against the general kernel on a one-hot row (262,144 entries)."""
    n = 262144
    x = logits(14, n)
    y = R.onehot_row(n, 7)
    lx, ly = row_lse(x, n), row_lse(y, n)
    lines = []
    for name in ("js", "tv", "kl", "topk-js"):
        kind = D.divergence_id(name)
        O.divergence_onehot(kind, x, lx, 7, n, 50)
        D.divergence(kind, x, lx, y, ly, n, 50)
        t = perf_counter()
        for _ in range(20):
            O.divergence_onehot(kind, x, lx, 7, n, 50)
        t1 = (perf_counter() - t) / 20
        t = perf_counter()
        for _ in range(20):
            D.divergence(kind, x, lx, y, ly, n, 50)
        t2 = (perf_counter() - t) / 20
        lines.append(f"{name} {t1 * 1e6:.1f} us vs general {t2 * 1e6:.0f} us")
    with capsys.disabled():
        print("\none-hot divergences, n=262144: " + "; ".join(lines))


# ---------------------------------------------------------------------------------------------- the `auto` cost model

from fsd_local.drafting.cost_model import CostModel, VerifyCost, best_k, expected_rates

MS = 1e-3


def simulate(cm, rounds, verify, draft_per_token, accept, seed=0):
    """Drive the model like the engine would, with synthetic costs and per-position acceptance (no timing).
    verify(n) -> seconds; accept: conditional acceptance of every position (a float or a list)."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(rounds):
        k = cm.choose_k()
        if k:
            cm.observe_draft(k, k * draft_per_token)
            n_acc = 0
            while n_acc < k and rng.random() < (accept if isinstance(accept, float) else accept[n_acc]):
                n_acc += 1
            cm.observe_acceptance(k, n_acc)
        cm.observe_verify(k + 1, verify(k + 1))
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
    free = CostModel(8, draft_cost_prior=0.0)
    k = free.choose_k()
    # before any measurement: a guess that explores (the acceptance is read optimistically while it rests on the
    # prior), neither a plain step nor k_max
    assert 1 <= k <= 6
    model = CostModel(8)
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
    assert v[9] == pytest.approx(30 * MS, rel=1e-6)  # beyond: the fitted slope
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
        lengths.observe(source if k else None, k, n_acc, 0.0, q4_verify(k + 1) * 0.4 + 6 * MS)
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
        lengths.observe(src if k else None, k, 0, 0.0, q4_verify(k + 1) * 0.4 + 6 * MS)
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
        lengths.observe(src if k else None, k, k, 0.0, q4_verify(k + 1) * 0.4 + 6 * MS)
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
        lengths.observe(None, 0, 0, 0.0, 20 * MS)
        lengths.observe(MODEL, 1, i % 2, 2 * MS, 24 * MS)
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


def test_choose_k_is_cheap(capsys):
    cm = CostModel(16, draft_cost_prior=0.0)
    simulate(cm, 20, f16_verify, 0.0, 0.8)
    t = perf_counter()
    for _ in range(200):
        cm.choose_k()
        cm.observe_verify(5, 26 * MS)
        cm.observe_acceptance(4, 2)
    per = (perf_counter() - t) / 200
    with capsys.disabled():
        print(f"\ncost model: choose_k + observations {per * 1e6:.1f} us a round (k_max 16)")


# ---------------------------------------------------------------------------------------------- grounded prompts


def test_grounded_prompts_file_parses_and_repeats_its_input():
    from pathlib import Path

    from fsd_local.bench.prompts import load_prompts

    path = Path(__file__).parent.parent / "fsd_local" / "data" / "prompts-grounded.jsonl"
    prompts = load_prompts(path)
    assert len(prompts) >= 8
    vocab: dict = {}
    for p in prompts:
        assert 300 <= len(p.text) <= 1200  # ~90-250 SmolLM2 tokens
        # what the answer has started to write is already in the prompt: prompt lookup finds it
        toks = word_tokens(p.text, vocab)
        assert NgramDrafter(1, 3).propose(toks, 4), p.text[-80:]


# recorded: one decode of a batch of n tokens on the padded 1.4 GB Q8_0 target (FSD.md "A cost-realistic target"),
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
    # through the model: the sizes measured once each (the engine's calibration), then rounds at k = 7
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
