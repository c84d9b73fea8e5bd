"""The quality budget (kernels/budget.py): the per-token loss against float64 references (greedy on the target's
recorded logits, sampled on fixed rows, and the sampled emission distribution it is defined on), the hard cap
under a forced sequence of expensive rescues and on real replies of every length, B = 0 is exactly `sd`, the
controller moves the threshold, and the setting's surfaces (Python, CLI, chat, HTTP) with the tau + budget error."""

from __future__ import annotations

import math

import numpy as np
import pytest
from click.testing import CliRunner
from scipy import stats as sps

from fsd_local import ConfigError, Engine, Settings
from fsd_local.kernels import divergence
from fsd_local.kernels import sampling as S
from fsd_local.kernels.accept import (
    CASCADE,
    FSD,
    FSD_PAPER,
    RELAXED,
    TYPICAL,
    Drafts,
    Rule,
    Sampling,
    accept_round,
    round_out,
)
from fsd_local.kernels.budget import (
    CAPPED,
    G_HI,
    LOSS,
    REFUSED,
    TAU,
    TAU_HI,
    TAU_START,
    TOKENS,
    G,
    new_budget,
    sampled_loss,
    stop_at,
)
from fsd_local.llama.model import Model, ModelOptions
from fsd_local.stream import TextStream

ALPHA = 1e-3
PROMPTS = ["the cat sat on the mat", "we ran far away, very far", "a b c", "über € é!"]
LOSSY = ("fsd", "fsd-entropy", "typical", "cascade", "relaxed", "fsd-paper")


# ------------------------------------------------------------------ greedy loss on recorded logits
def _reference_losses(path, prompt_ids, out_ids):
    """log p(top) - log p(emitted) in float64, from a fresh evaluation of prompt + reply in one batch."""
    m = Model(ModelOptions(path, n_ctx=512, n_threads=1))
    try:
        seq = list(prompt_ids) + list(out_ids)
        m.decode(seq, f"from:{len(prompt_ids) - 1}")
        rows = m.logits(len(out_ids) + 1)[: len(out_ids)].astype(np.float64)
    finally:
        m.close()
    lp = rows - rows.max(axis=1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(axis=1, keepdims=True))
    return lp.max(axis=1) - lp[np.arange(len(out_ids)), out_ids]


@pytest.mark.parametrize("settings", [{"tau": 0.4}, {"quality_budget": 0.3}, {"mode": "typical", "tau": 1.0}])
def test_greedy_loss_equals_the_float64_reference_on_the_targets_logits(tiny_engine, tiny_pair, settings):
    prompt = tiny_engine.tokenize("the cat sat on the mat")
    out = tiny_engine.generate(prompt, max_tokens=40, ignore_eos=True, **settings)
    ref = _reference_losses(tiny_pair[1], prompt, out.token_ids)
    st = out.stats
    assert st["accepted_fuzzy"] > 0 and st["loss_sum"] > 0
    assert st["loss_sum"] == pytest.approx(ref.sum(), abs=2e-2)  # batch shapes differ: ~1e-3 per token
    assert st["loss_per_token"] == pytest.approx(ref.mean(), abs=1e-3)
    assert st["not_chosen_share"] == pytest.approx(np.mean(ref > 1e-3), abs=0.03)


# ------------------------------------------------------------------ sampled loss
def _processed_ref(x, t, top_k):
    z = x.astype(np.float64) / t
    if top_k:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    return p / p.sum()


def _rescue_set(mode, x, tau, eps, alpha, k):
    praw = np.exp(x.astype(np.float64) - x.max())
    praw /= praw.sum()
    if mode == TYPICAL:
        h = -np.sum(praw * np.log(praw))
        return (1 - praw) / (1 - min(eps, alpha * math.exp(-h))) <= tau
    if mode == CASCADE:
        return 1 - praw / praw.max() <= tau
    if mode == RELAXED:
        rank = np.array([(x > v).sum() for v in x])
        return (rank < k) & (praw.max() - praw <= tau)
    return np.ones(len(x), bool)


def _reference_sampled_loss(mode, x, y, t, top_k, tau, eps=0.09, alpha=0.3, k=3):
    """(max(0, E_p~[log p] - E_r[log p]), r, P(rescue)): r the distribution the rule emits from at the slot and p
    the target's raw softmax at temperature 1, in float64."""
    p, q = _processed_ref(x, t, top_k), _processed_ref(y, t, top_k)
    if mode == FSD_PAPER:
        r, rescued = q, 1.0
    else:
        a = _rescue_set(mode, x, tau, eps, alpha, k)
        over = np.maximum(q - p, 0)
        rescued = over[a].sum()
        rejected = over[~a].sum()
        under = np.maximum(p - q, 0)
        r = np.minimum(p, q) + np.where(a, over, 0) + rejected * under / under.sum()
    if rescued == 0:  # the rule rescues nothing here: nothing to charge
        return 0.0, r, rescued
    logp = x.astype(np.float64) - np.logaddexp.reduce(x.astype(np.float64))
    return max(0.0, float(np.sum(p * logp) - np.sum(r * logp))), r, rescued


def _kernel_sampled_loss(mode, x, y, t, top_k, tau, k=3):
    n = len(x)
    ps = np.array(S.processed(x, n, t, top_k, 1.0, 0.0), np.float32)
    qs = np.array(S.processed(y, n, t, top_k, 1.0, 0.0), np.float32)
    lx = float(np.logaddexp.reduce(x.astype(np.float64)))
    none = np.zeros(0, np.int64)
    return sampled_loss(mode, x, lx, y, False, 0, n, t, ps, qs, tau, k, 0.09, 0.3, none, -1, none, y, -1)


@pytest.mark.parametrize("mode", [FSD, FSD_PAPER, TYPICAL, CASCADE, RELAXED])
@pytest.mark.parametrize("t,top_k", [(1.0, 0), (0.7, 0), (1.5, 0), (1.0, 6)])
def test_sampled_loss_equals_the_float64_reference(mode, t, top_k):
    rng = np.random.default_rng(mode * 10 + int(t * 10) + top_k)
    for trial in range(5):
        x = (rng.standard_normal(12) * 1.5).astype(np.float32)
        y = (x + rng.standard_normal(12) * 0.8).astype(np.float32)
        tau = 0.4 if mode != TYPICAL else 0.9
        ref, _, rescued = _reference_sampled_loss(mode, x, y, t, top_k, tau)
        got, got_rescued = _kernel_sampled_loss(mode, x, y, t, top_k, tau)
        assert math.isfinite(ref)  # finite where the draft's top-k holds tokens outside the target's, too
        assert got == pytest.approx(ref, rel=2e-3, abs=1e-6), trial  # float32 normalisers
        assert got_rescued == pytest.approx(rescued, rel=2e-3, abs=1e-6), trial


@pytest.mark.parametrize("share", [None, 1.0, 0.4])
@pytest.mark.parametrize(
    "mode,tau", [(TYPICAL, 0.9), (CASCADE, 0.5), (FSD, 1.0), (FSD, 0.05), (FSD, 0.02), (FSD_PAPER, 0.05)]
)
def test_sampled_loss_is_defined_on_the_distribution_the_rule_really_emits(mode, tau, share):
    """Drafts drawn from q~, one slot through accept_round. With no budget (share None) the first emitted token
    follows r, the distribution the loss is measured on, and the rule rescues with the probability a rescue's
    charge divides by. Under a budget whose room at the reply's first token is a share of the slot's loss (1: all
    of it; 0.4), the slot emits from (1 - share) p~ + share r and is charged share x its loss on every draw, SD
    test passed or not: its expected loss, exactly. fsd at tau 1.0 is above js's bound: the budget decides that
    slot without its divergence; at 0.05 the divergence (0.030) is computed first and passes, at 0.02 it fails:
    the slot is sd's, nothing charged."""
    n, t = 8, 1.0
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(n) * 1.5).astype(np.float32)
    y = (x + rng.standard_normal(n)).astype(np.float32)
    closed = mode in (FSD, FSD_PAPER) and divergence.compute("js", x, y) > tau
    assert closed == (tau == 0.02)
    loss, r, rescued = _reference_sampled_loss(mode, x, y, t, 0, tau)
    p, q = _processed_ref(x, t, 0), _processed_ref(y, t, 0)
    P, Q = np.stack([x, x]), y[None, :].copy()
    mx, cut, lz = S.processed(y, n, t, 0, 1.0, 0.0)
    stats = np.array([[mx, cut, lz], [0, 0, 0]], np.float32)
    out = round_out(1)
    rule, sampling = Rule(mode, 0, tau, 50), Sampling(t, 0, 1.0, 0.0)
    s = 0.0 if closed else 1.0 if share is None else share
    counts, fuzzy = np.zeros(n), 0
    draws = 20000
    for d, u0, u1 in zip(rng.choice(n, draws, p=q), rng.random(draws), rng.random(draws)):
        budget = new_budget(None if share is None else loss * share, 1)
        budget.state[TAU], budget.state[G] = tau, G_HI  # the budget's threshold is the rule's; every rescue worth it
        drafts = Drafts(Q, np.array([d], np.int32), np.array([q[d]]), stats, np.zeros(1, np.uint8))
        acc, nxt = accept_round(P, drafts, 1, n, rule, sampling, np.array([u0, u1]), out, budget)
        counts[d if acc else nxt] += 1
        fuzzy += out.reason[0] == 2
        if share is not None:
            assert budget.loss[0] == pytest.approx(s * loss, rel=1e-3) == budget.state[LOSS]
            assert budget.state[LOSS] <= budget.bound  # the hard cap at the first token
    emit = (1 - s) * p + s * r
    assert sps.chisquare(counts[emit > 0], emit[emit > 0] * draws).pvalue > ALPHA
    want = s * rescued
    assert fuzzy / draws == pytest.approx(want, abs=4 * math.sqrt(want / draws) + 1e-3)


# ------------------------------------------------------------------ the hard cap
def _forced_round(k, n, costs, plain=()):
    """A greedy round whose target prefers token 0 everywhere while the draft proposes token 1, each costing
    costs[i] below the top (the slots in `plain` draft token 0 instead: the target's own choice)."""
    P = np.full((k + 1, n), -5.0, np.float32)
    P[:, 0] = 5.0
    P[:k, 1] = 5.0 - np.asarray(costs, np.float32)
    tokens = np.array([0 if i in plain else 1 for i in range(k)], np.int32)
    q_stats = np.zeros((k + 1, 3), np.float32)
    drafts = Drafts(np.zeros((k, n), np.float32), tokens, np.ones(k), q_stats, np.zeros(k, np.uint8))
    actual = P[:k, 0].astype(np.float64) - P[:k, 1]  # what the rows say, float32 rounding included
    return P, drafts, np.where(tokens == 1, actual, 0.0)


def _forced_accept(budget, P, drafts, k, n):
    out = round_out(k)
    budget.state[TAU] = TAU_HI  # cascade rescues any cost below -log(1 - TAU_HI): all of these,
    budget.state[G] = G_HI  # and every one of them is worth its loss: only the cap refuses
    rule, sampling = Rule(CASCADE, 0, 0.0, 50), Sampling(0.0, 0, 1.0, 0.0)
    return accept_round(P, drafts, k, n, rule, sampling, np.zeros(k + 1), out, budget)


def test_a_forced_sequence_of_expensive_rescues_is_refused_once_it_would_pass_the_budget():
    """Every draft is one the rule rescues; rescues cost 0.02 .. 0.9 nats. Greedy, a round is decided whole (none
    of it is shown before): the kernel must accept exactly the longest prefix of the round a running-loss
    reference affords at the round's end, and the reply keeps B at every round's end."""
    n, k, bound = 16, 4, 0.1
    rng = np.random.default_rng(0)
    budget = new_budget(bound, k)
    loss_ref, tokens_ref, per_token, ends, refused = 0.0, 0, [], [], 0
    for _ in range(200):
        P, drafts, costs = _forced_round(k, n, rng.choice([0.02, 0.05, 0.3, 0.9], size=k))
        acc, nxt = _forced_accept(budget, P, drafts, k, n)
        # the reference: the most drafts m whose rescues fit B x (tokens so far + the round's m + 1)
        expected = max(m for m in range(k + 1) if loss_ref + costs[:m].sum() <= bound * (tokens_ref + m + 1))
        refused += expected < k
        assert (acc, nxt) == (expected, 0)
        loss_ref += costs[:expected].sum()
        tokens_ref += acc + 1
        per_token.extend(budget.loss[: acc + 1])
        ends.append(len(per_token))
        assert budget.state[LOSS] == pytest.approx(loss_ref) and budget.state[TOKENS] == tokens_ref
    cum = np.cumsum(per_token)
    assert np.all(cum[np.array(ends) - 1] <= bound * np.array(ends) + 1e-12)  # the reply at every round's end
    assert refused > 50 and cum[-1] > 0.8 * bound * len(cum)  # the cap bound, and the budget was spent
    assert budget.state[REFUSED] == budget.state[CAPPED] == refused  # every refusal was the cap's


def test_a_rescue_is_paid_for_by_the_tokens_of_its_own_round():
    """B 0.1, a reply's first round of 4 drafts: a rescue at slot 0 costing 0.3 is more than the 0.1 of its own
    token, but the round emits 5 tokens (0.5) if the drafts after it are kept: taken. Two rescues (0.25 + 0.2)
    are taken together although the first alone would not fit before the second's slot; 0.6 is refused."""
    n, k = 16, 4
    for costs, plain, expected in [
        ([0.3, 0, 0, 0], (1, 2, 3), 4),
        ([0.25, 0.2, 0, 0], (2, 3), 4),
        ([0.6, 0, 0, 0], (1, 2, 3), 0),
        ([0.05, 0.5, 0, 0], (2, 3), 1),  # the second rescue would take the round's 5 tokens past 0.5
    ]:
        budget = new_budget(0.1, k)
        P, drafts, c = _forced_round(k, n, costs, plain)
        acc, _ = _forced_accept(budget, P, drafts, k, n)
        assert acc == expected, costs
        assert budget.state[LOSS] == pytest.approx(c[:acc].sum())
        assert budget.state[LOSS] <= 0.1 * (acc + 1) + 1e-12


def test_the_draft_that_ends_the_reply_is_a_point_the_budget_holds_at():
    """A stop string or end of generation at draft 1: the reply would end with 2 of the round's tokens, so a
    rescue at slot 0 must fit 0.2 there even though the full round (5 tokens) could pay 0.3."""
    n, k = 16, 4
    for stop, expected in [(None, 4), (1, 0), (3, 4)]:
        budget = new_budget(0.1, k)
        stop_at(budget, stop)
        P, drafts, _ = _forced_round(k, n, [0.3, 0, 0, 0], (1, 2, 3))
        acc, _ = _forced_accept(budget, P, drafts, k, n)
        assert acc == expected, stop


def test_text_stream_finds_the_piece_that_completes_a_stop_string():
    text = TextStream(("</s>", "END"))
    assert text.push(b"hello <") == "hello "  # "<" is held: it may start a stop string
    assert text.stop_index([b"/", b"s", b">", b"more"]) == 2
    assert text.stop_index([b" E", b"N", b"D"]) == 2
    assert text.stop_index([b"\xc3", b"\xa9 E", b"ND!"]) == 2  # a character split across pieces
    assert text.stop_index([b"x", b"y"]) is None
    assert text.push(b"/s") == "" and not text.stopped  # stop_index consumed nothing
    assert TextStream(()).stop_index([b"a"]) is None


def test_the_engine_tells_the_budget_which_draft_ends_the_reply(tiny_engine):
    eng = tiny_engine
    words = eng.tokenize(" the cat sat", add_special=False)
    pieces = [eng.token_bytes(t) for t in words]
    first = next(i for i in range(len(words)) if b"cat" in b"".join(pieces[: i + 1]))
    assert 0 < first < len(words) - 1

    def ends(stop, ignore_eos, drafts):  # what a generation with these settings says before a round
        with eng.generation(eng.tokenize("x"), stop=stop, ignore_eos=ignore_eos) as g:
            return g.ctx.ends_reply(drafts)

    assert ends(("cat",), False, words) == first
    assert ends((), False, words) is None
    eos = eng.target.eos
    assert ends((), False, [words[0], eos, words[1]]) == 1
    assert ends((), True, [words[0], eos, words[1]]) is None


@pytest.mark.parametrize("mode", ["fsd", "typical", "cascade", "relaxed", "fsd-entropy"])
@pytest.mark.parametrize("bound", [0.05, 0.3, 1.0])
def test_no_reply_exceeds_its_budget_at_any_length(tiny_engine, mode, bound):
    rescued = 0
    for prompt in PROMPTS[:2]:
        for max_tokens in (1, 5, 33):
            out = tiny_engine.generate(prompt, mode=mode, quality_budget=bound, max_tokens=max_tokens, draft_max=5)
            st = out.stats
            assert st["loss_sum"] <= bound * st["tokens"] + 1e-9, (prompt, max_tokens)
            assert st["quality_budget"] == bound
            rescued += st["accepted_fuzzy"]
    assert rescued > 0 or bound < 0.3  # the budget is spent, not merely kept
    cut = tiny_engine.generate(PROMPTS[0], mode=mode, quality_budget=bound, max_tokens=40, stop=["e"])
    assert cut.finish_reason in ("stop", "length")
    assert cut.stats["loss_sum"] <= bound * cut.stats["tokens"] + 1e-9


@pytest.mark.parametrize("mode", ["fsd", "typical", "cascade", "relaxed", "fsd-paper"])
def test_sampled_replies_keep_their_budget_and_spend_it(tiny_engine, mode):
    spent = 0.0
    for seed in range(6):
        out = tiny_engine.generate(
            PROMPTS[seed % 2], mode=mode, quality_budget=0.5, temperature=0.8, seed=seed, max_tokens=30
        )
        st = out.stats
        assert st["loss_sum"] <= 0.5 * st["tokens"] + 1e-9
        spent += st["loss_sum"]
    assert spent > 0


# ------------------------------------------------------------------ B = 0 is sd
@pytest.mark.parametrize("mode", LOSSY)
def test_greedy_budget_zero_is_exactly_sd(tiny_engine, mode):
    for prompt in PROMPTS:
        sd = tiny_engine.generate(prompt, mode="sd", max_tokens=48, draft_max=4)
        zero = tiny_engine.generate(prompt, mode=mode, quality_budget=0.0, max_tokens=48, draft_max=4)
        assert zero.token_ids == sd.token_ids, prompt
        assert zero.stats["accepted_fuzzy"] == 0 and zero.stats["loss_sum"] == 0.0


@pytest.mark.parametrize("mode", ["fsd", "typical", "cascade"])
def test_sampled_budget_zero_draws_what_sd_draws(tiny_engine, mode):
    for seed in range(4):
        sd = tiny_engine.generate(PROMPTS[0], mode="sd", temperature=0.9, seed=seed, max_tokens=30)
        zero = tiny_engine.generate(
            PROMPTS[0], mode=mode, quality_budget=0.0, temperature=0.9, seed=seed, max_tokens=30
        )
        assert zero.token_ids == sd.token_ids


def test_sampled_budget_zero_keeps_the_targets_distribution(small_vocab_pair):
    draft, target = small_vocab_pair
    with Engine(target=target, draft=draft, n_ctx=128, n_threads=1) as eng:
        prompt = eng.tokenize("the sky")
        m = Model(ModelOptions(target, n_ctx=128, n_threads=1))
        try:
            m.decode(prompt, "last")
            row = m.logits(1)[0].astype(np.float64)
        finally:
            m.close()
        p = np.exp(row - row.max())
        p /= p.sum()
        counts = np.zeros(eng.n_vocab)
        for seed in range(2000):
            out = eng.generate(prompt, max_tokens=4, seed=seed, temperature=1.0, draft_max=3, quality_budget=0.0)
            counts[out.token_ids[0]] += 1
        expected = p[: eng.n_vocab] * counts.sum()
        big = expected >= 5
        obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
        assert sps.chisquare(obs[exp > 0], exp[exp > 0]).pvalue > ALPHA


# ------------------------------------------------------------------ the controller and the statistics
def test_the_threshold_moves_with_the_budget_and_is_reported(tiny_engine):
    rich = tiny_engine.generate(PROMPTS[1], quality_budget=3.0, max_tokens=60, ignore_eos=True)
    poor = tiny_engine.generate(PROMPTS[1], quality_budget=0.002, max_tokens=60, ignore_eos=True)
    th_rich, th_poor = rich.stats["threshold"], poor.stats["threshold"]
    assert th_rich["max"] > TAU_START and th_poor["min"] < TAU_START
    assert th_poor["min"] <= th_poor["mean"] <= th_poor["max"]
    assert rich.stats["accepted_fuzzy"] > poor.stats["accepted_fuzzy"]
    assert rich.stats["loss_per_token"] > poor.stats["loss_per_token"]
    assert 0 <= poor.stats["rescues_capped"] <= poor.stats["rescues_refused"]  # the cap's share of the refusals
    # the next reply of the same kind starts where this one left the threshold
    again = tiny_engine.generate(PROMPTS[1], quality_budget=3.0, max_tokens=1)  # one round: the first threshold
    assert again.stats["threshold"]["min"] == pytest.approx(th_rich["last"])
    plain = tiny_engine.generate(PROMPTS[1], tau=0.3, max_tokens=20)
    assert plain.stats["quality_budget"] is None and plain.stats["threshold"] is None
    assert plain.stats["loss_per_token"] >= 0 and 0 <= plain.stats["not_chosen_share"] <= 1
    # sampled without a budget a rescue's loss is measured too: taus and budgets compare on one axis
    sampled = tiny_engine.generate(PROMPTS[1], tau=0.5, temperature=0.9, seed=1, max_tokens=30)
    assert sampled.stats["accepted_fuzzy"] > 0 and sampled.stats["loss_per_token"] > 0
    assert sampled.stats["not_chosen_share"] > 0


# ------------------------------------------------------------------ the setting's surfaces
def test_tau_and_budget_together_and_other_bad_values_are_clear_errors():
    with pytest.raises(ConfigError, match="both set"):
        Settings(tau=0.2, quality_budget=0.1)
    with pytest.raises(ConfigError, match="both set"):
        Settings().with_(tau=0.2, quality_budget=0.1)  # one request that sets both
    # a request that sets one over defaults that set the other: the request's knob wins, the other is set aside
    assert Settings(tau=0.2).with_(quality_budget=0.1).tau == 0.0
    assert Settings(quality_budget=0.1).with_(tau=0.3).quality_budget is None
    assert Settings(quality_budget=0.1).with_(tau=0.0).quality_budget == 0.1
    with pytest.raises(ConfigError, match="lossy mode"):
        Settings(mode="sd", quality_budget=0.1)
    with pytest.raises(ConfigError, match="quality_budget=-0.1 must be >= 0"):
        Settings(quality_budget=-0.1)
    s = Settings(quality_budget=0.1)
    assert s.with_(quality_budget=None).quality_budget is None  # None turns it off
    assert s.with_(tau=None).quality_budget == 0.1


def test_cli_flag(tiny_pair):
    from fsd_local.cli.main import cli

    d, t = tiny_pair
    runner = CliRunner()
    assert "--quality-budget" in runner.invoke(cli, ["generate", "--help"]).output
    base = ["generate", "--target", t, "--draft", d, "--max-tokens", "12", "--threads", "1", "the cat"]
    ok = runner.invoke(cli, [*base, "--quality-budget", "0.2"])
    assert ok.exit_code == 0, ok.output
    assert "budget spent" in ok.output
    bad = runner.invoke(cli, [*base, "--quality-budget", "0.2", "--tau", "0.3"])
    assert bad.exit_code != 0 and "both set" in bad.output and "Traceback" not in bad.output


def test_chat_budget_command_and_summary_line(tiny_engine):
    from fsd_local.cli.chat import ChatSession, parse_command
    from fsd_local.cli.options import summary_line

    # a fixed draft length: whether `auto` drafts hangs on live timing, and a run that never drafts spends nothing
    session = ChatSession(tiny_engine, Settings(max_tokens=12, draft_policy="fixed", draft_max=4))
    assert session.apply(parse_command("/budget 0.2")) == "budget = 0.2"
    for _ in session.reply("hello"):
        pass
    assert session.last is not None
    line = summary_line(session.last.stats, session.last.finish_reason)
    assert f"budget spent {session.last.stats['loss_per_token']:.3f} of 0.2 nats/token" in line
    assert "budget 0.2" in session.stats_text()
    assert session.apply(parse_command("/tau 0.3")) == "tau = 0.3"  # sets the budget aside
    assert session.settings.quality_budget is None
    assert session.apply(parse_command("/budget 0.1")) == "budget = 0.1" and session.settings.tau == 0.0
    assert session.apply(parse_command("/budget off")) == "budget = None"
    assert session.apply(parse_command("/tau 2")) == "tau = 2.0"  # js <= ln 2: every draft is kept
    for _ in session.reply("hello again"):  # a tau run's line says the loss it spent too
        pass
    st = session.last.stats
    assert st["loss_per_token"] > 0 and f"loss {st['loss_per_token']:.3f} nats/token" in summary_line(st, "stop")


def test_server_field(tiny_engine):
    import httpx

    from fsd_local.server import BackgroundServer

    with BackgroundServer(tiny_engine, model_name="tiny-pair") as srv:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "quality_budget": 0.2}, timeout=30)
        assert r.status_code == 200, r.text
        fsd = r.json()["fsd"]
        assert fsd["quality_budget"] == 0.2 and fsd["settings"]["quality_budget"] == 0.2
        assert fsd["loss_sum"] <= 0.2 * fsd["tokens"] + 1e-9
        srv_tau = tiny_engine.defaults
        tiny_engine.defaults = srv_tau.with_(tau=0.3)  # a server started with --tau: a request's budget wins
        try:
            r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "quality_budget": 0.2}, timeout=30)
            assert r.status_code == 200 and r.json()["fsd"]["settings"]["tau"] == 0.0
        finally:
            tiny_engine.defaults = srv_tau
        bad = httpx.post(srv.url + "/v1/chat/completions", json={**body, "quality_budget": 0.2, "tau": 0.3}, timeout=30)
        assert bad.status_code == 400 and "both set" in bad.json()["error"]["message"]


# ------------------------------------------------------------------ bench and calibrate
def test_bench_budgets_axis_runs_beside_fixed_taus_and_reports_the_worst_reply(tiny_engine, tmp_path):
    from fsd_local.bench.frontier import mark_frontier
    from fsd_local.bench.plot import plot
    from fsd_local.bench.prompts import Prompt
    from fsd_local.bench.report import format_table
    from fsd_local.bench.runner import build_configs, run_bench, summarise

    configs = build_configs(["fsd", "typical"], ["js"], [0.3], [4], [0.0], policies=["fixed"], budgets=[0.05, 0.3])
    budgeted = [c for c in configs if c.budget is not None]
    assert [(c.mode, c.budget, c.tau) for c in budgeted] == [
        ("fsd", 0.05, None),
        ("fsd", 0.3, None),
        ("typical", 0.05, None),
        ("typical", 0.3, None),
    ]
    assert len(build_configs(["fsd"], ["js"], [], [4], [0.0], policies=["fixed"], budgets=[0.1])) == 3  # ar, sd, B
    prompts = [Prompt(p) for p in PROMPTS[:3]]
    rows = mark_frontier(summarise(run_bench(tiny_engine, prompts, configs, max_tokens=24, repeats=1)))
    for r in rows:
        assert r["tokens_per_target_call"] >= 1.0 and r["loss_per_token"] >= 0.0
        if r["quality_budget"] is not None:
            assert r["loss_worst_reply"] <= r["quality_budget"] + 1e-9
            assert r["loss_per_token"] <= r["loss_worst_reply"] + 1e-12 and r["threshold_mean"] > 0
    assert any(r["on_frontier_loss"] for r in rows)
    assert next(r for r in rows if r["mode"] == "ar")["loss_per_token"] == 0.0
    table = format_table(rows)
    assert "loss/tok" in table and "worst" in table and "tok/call" in table
    path = tmp_path / "frontier.png"
    plot(rows, str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_calibrate_reports_the_smallest_budget_that_reaches_a_speed(tiny_engine):
    from fsd_local.bench.calibrate import Budget, calibrate, format_report
    from fsd_local.bench.prompts import Prompt

    prompts = [Prompt(p) for p in PROMPTS[:2]]
    goal = Budget("speed", 2.8)
    result = calibrate(tiny_engine, prompts, budget=goal, max_tokens=24, repeats=1, steps=3)
    b = result["quality_budget"]
    assert result["tau"] is None and 0 < b <= 1.0
    visited = {v["tau"]: v for v in result["visited"]}
    assert visited[b]["tokens_per_target_call"] >= 2.8 and visited[b]["meets"]
    assert all(not v["meets"] for x, v in visited.items() if x < b)
    assert f"smallest B reaching tokens per target call >= 2.8: B = {b:.4f}" in format_report(result, goal)


# ------------------------------------------------------------------ the real pair
def test_on_the_real_f16_pair_budgets_hold_and_zero_is_sd(real_engine_f16, real_pair_f16):
    eng = real_engine_f16
    prompt = eng.chat_prompt([{"role": "user", "content": "Explain to a ten-year-old what a computer program is."}])
    sd = eng.generate(prompt, mode="sd", max_tokens=40, draft_max=6)
    assert eng.generate(prompt, quality_budget=0.0, max_tokens=40, draft_max=6).token_ids == sd.token_ids
    out = eng.generate(prompt, quality_budget=0.2, max_tokens=40, draft_max=6, ignore_eos=True)
    st = out.stats
    assert 0 < st["loss_sum"] <= 0.2 * st["tokens"] + 1e-9 and st["accepted_fuzzy"] > 0
    ref = _reference_losses(real_pair_f16[1], prompt, out.token_ids)
    assert st["loss_sum"] == pytest.approx(ref.sum(), abs=0.05)  # F16 batch shapes: <= ~0.04 per logit


def test_the_hard_cap_shares_an_expensive_sampled_slot_down_to_what_the_reply_has_earned():
    """Sampled, slot by slot: a slot where the rule rescues (fsd, js <= tau always) and the price allows (g at its
    top), whose loss is >= 4.5 nats. At a reply's first token B 0.2 leaves room for 0.2: the cap alone cuts the
    slot to the share 0.2 / loss of its rescues, charged exactly the room; the rescue is taken only where the SD
    test's uniform, given the failure, falls in that share (0.99 does not; a tenth of the share does). With 60
    tokens behind it, the whole slot fits and is charged its loss."""
    n, t, bound = 16, 1.0, 0.2
    x = np.full(n, -2.0, np.float32)
    x[0] = 3.0  # the target wants token 0
    y = np.full(n, -2.0, np.float32)
    y[1] = 3.0  # the draft proposes token 1
    loss, _, _ = _reference_sampled_loss(FSD, x, y, t, 0, 1.0)
    assert loss >= 4.5
    P, Q = np.stack([x, x]), y[None, :].copy()
    q_stats = np.array([S.processed(y, n, t, 0, 1.0, 0.0), [0, 0, 0]], np.float32)
    q1 = S.prob(y, 1, t, *S.processed(y, n, t, 0, 1.0, 0.0))
    p1 = S.prob(x, 1, t, *S.processed(x, n, t, 0, 1.0, 0.0))
    drafts = Drafts(Q, np.array([1], np.int32), np.array([q1]), q_stats, np.zeros(1, np.uint8))
    rule, sampling = Rule(FSD, 0, 0.0, 50), Sampling(t, 0, 1.0, 0.0)
    share = bound / loss
    inside = (p1 + 0.1 * share * (q1 - p1)) / q1  # fails the SD test, and given that, lies in the share
    for tokens, u, taken in ((0, 0.99, False), (0, inside, True), (60, 0.99, True)):
        budget, out = new_budget(bound, 1), round_out(1)
        budget.state[TAU], budget.state[G], budget.state[TOKENS] = 1.0, G_HI, tokens
        acc, nxt = accept_round(P, drafts, 1, n, rule, sampling, np.array([u, 0.3]), out, budget)
        assert (acc == 1 and out.reason[0] == 2) if taken else (acc == 0 and nxt != 1)
        if tokens == 0:
            assert budget.state[CAPPED] == budget.state[REFUSED] == 1
            assert budget.state[LOSS] == pytest.approx(bound, rel=1e-6) and budget.state[LOSS] <= bound
        else:
            assert budget.state[CAPPED] == budget.state[REFUSED] == 0
            assert budget.state[LOSS] == pytest.approx(loss, rel=1e-3) and loss <= bound * (tokens + 1)
        assert budget.loss[0] == budget.state[LOSS]
