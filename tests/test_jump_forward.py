"""Jump-forward in the round: the tokens a grammar forces proposed free and judged by the target (round.py `force`,
kernels/accept.py FORCED), driven through the engine's public `generation` and `round`: token ids the same with
and without on F32 and F16 models; a forced run verified whole, dropped after a rejected draft, cut by max_tokens
and the context, a long literal over several rounds, the grammar's end; never fuzzy, never charged to a budget;
sampled output in the target's constrained distribution (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from fsd_local import Engine
from fsd_local.drafting.proposer import MODEL
from fsd_local.kernels.accept import BY_SD
from fsd_local.round import FORCED_MAX, Proposal, force, forced_flags, verify
from fsd_local.settings import CHAT_DEFAULTS
from tests.test_forced import PROFILE

LITERAL = "the quick brown fox jumps over the lazy dog."  # 44 tokens on the tiny vocabulary, all forced
PROMPTS = ["the cat sat", "we ran far", "a dog", "is it?"]


def _both(eng: Engine, prompt, **kw):
    return [eng.generate(prompt, jump_forward=on, **kw) for on in (True, False)]


@pytest.mark.parametrize("mode", ["ar", "sd", "fsd"])
def test_greedy_ids_are_the_same_with_and_without_jump_forward(tiny_engine, mode):
    """sd and ar are lossless: the same ids; fsd at tau 0 is sd (its forced slots are never rescued anyway)."""
    saved = 0
    for prompt in PROMPTS:
        on, off = _both(tiny_engine, prompt, mode=mode, json_schema=PROFILE, max_tokens=60, tau=0.0)
        assert on.token_ids == off.token_ids and on.finish_reason == off.finish_reason, prompt
        assert on.stats["forced_accepted"] > 0 and off.stats["forced"] == 0
        assert on.stats["forced_accepted"] == on.origins.count("forced")
        saved += off.stats["target_calls"] - on.stats["target_calls"]
    assert saved > 0


# llama.cpp's F16 logits differ by up to 0.04 between batch shapes (docs/measurements/numerics.md): a forced batch
# may flip a near tie the single-token decode breaks the other way, and the replies part there
NEAR_TIE = 0.05


def _part_at_a_near_tie(on, off) -> bool:
    i = next((i for i, (a, b) in enumerate(zip(on.token_ids, off.token_ids)) if a != b), None)
    if i is None:
        return len(on.token_ids) == len(off.token_ids)
    gaps = [abs(out.top_logprobs[i][0][1] - out.top_logprobs[i][1][1]) for out in (on, off)]
    return max(gaps) < NEAR_TIE and {on.token_ids[i], off.token_ids[i]} == {t for t, _ in on.top_logprobs[i][:2]}


def test_greedy_ids_are_the_same_on_the_f16_demo_pair(real_engine_f16):
    """The same ids with and without, up to a near tie that batch shapes break either way on F16."""
    messages = [{"role": "user", "content": "Describe a chef in Rome as a JSON profile: name, age, languages."}]
    for mode in ("ar", "sd"):
        on, off = [
            real_engine_f16.chat(
                messages, mode=mode, json_schema=PROFILE, jump_forward=j, max_tokens=80, top_logprobs=2
            )
            for j in (True, False)
        ]
        assert _part_at_a_near_tie(on, off), mode
        assert on.stats["forced_accepted"] >= 10 and on.text.startswith('{"name":"')
        if mode == "ar" and on.token_ids == off.token_ids:  # a target call fewer for every forced token (the
            calls = off.stats["target_calls"] - on.stats["forced_accepted"]  # grammar's end may add its EOS)
            assert on.stats["target_calls"] in (calls, calls + 1)
        assert on.stats["target_calls"] < off.stats["target_calls"]


def test_ar_verifies_a_forced_run_whole_as_a_batch_of_its_own(tiny_engine):
    with tiny_engine.generation("the cat sat", mode="ar", json_schema=PROFILE) as g:
        step = tiny_engine.round(g)
        run = b'{"name":"'
        assert step.proposal is not None and step.proposal.source is None and step.proposal.n == len(run)
        assert step.accepted == len(run) and step.batch == len(run) + 1  # the prompt's last token, then the run
        assert step.emitted.origins == ["forced"] * len(run) + ["target"]
        assert b"".join(tiny_engine.token_bytes(t) for t in step.emitted.tokens[:-1]) == run
        assert (step.out.reason[: len(run)] == BY_SD).all() and not step.loss.any()
        g.advance(step)
        step = tiny_engine.round(g)  # inside the free string nothing is forced: a plain step
        assert step.proposal is None and step.batch == 1


def test_a_forced_run_after_a_rejected_draft_is_dropped_with_it(tiny_engine):
    """sd: a draft closing the name, the grammar's ',"age":' after it; the target writes on in the name, so the
    run goes with the draft, and the reply is still the target's own."""
    kw = dict(json_schema=PROFILE, max_tokens=40)
    ref = tiny_engine.generate("we ran far", mode="ar", jump_forward=False, **kw).token_ids
    quote = tiny_engine.tokenize('"', add_special=False)[-1]
    assert ref[9] != quote  # the name's first letters are the target's
    with tiny_engine.generation("we ran far", mode="sd", draft_policy="fixed", **kw) as g:
        ctx = g.ctx
        first = Proposal(len(force(ctx, 0, 0)), None, 0, 0.0, forced=forced_flags(ctx, 9))
        step = verify(tiny_engine.target, ctx, first)
        assert step.accepted == 9 and step.emitted.tokens == ref[:10]
        g.advance(step)
        d = ctx.buffers.drafts
        d.tokens[0], d.prob[0], d.onehot[0] = quote, 1.0, 0
        assert ctx.chain.push(quote)
        run = force(ctx, 1, 0)
        assert b"".join(tiny_engine.token_bytes(t) for t in run) == b',"age":'
        n = 1 + len(run)
        step = verify(tiny_engine.target, ctx, Proposal(n, MODEL, 1, 0.0, forced=forced_flags(ctx, n)))
        assert step.accepted == 0 and step.emitted.tokens == [ref[10]] and step.emitted.origins == ["target"]
        finish = g.advance(step)[0]
        while finish is None and (finish := g.stop_reason()) is None:
            finish = g.advance(tiny_engine.round(g))[0]
        assert g.reply.tokens == ref and "forced" in g.reply.origins


def test_the_draft_model_stops_at_a_run_behind_its_draft(tiny_engine):
    """sd, fixed k 16: a proposal is the grammar's run, the draft model's drafts, and the run the grammar forces
    after the last of them (a lossless rule drafts no further); the draft model has decoded none of that run."""
    tails = 0
    for prompt in PROMPTS[:2]:  # on "the cat sat" the grammar forces no run behind a draft; on "we ran far" it does
        tails += _drafts_then_a_run(tiny_engine, prompt)
    assert tails > 0


def test_a_lossy_rule_drafts_on_behind_a_run(tiny_engine):
    """fsd at tau 0.6, fixed k 16: a lossy rule keeps most drafts, so the draft model drafts on behind a run (a
    draft after a forced slot that follows a draft)."""
    on = 0
    for prompt in PROMPTS[:2]:
        with tiny_engine.generation(prompt, mode="fsd", tau=0.6, draft_max=16, json_schema=PROFILE, max_tokens=60) as g:
            while g.stop_reason() is None:
                step = tiny_engine.round(g)
                p = step.proposal
                if p is not None and p.forced is not None and p.source == MODEL:
                    f = p.forced[: p.n].tolist()
                    tail = f[f.index(False) :]
                    on += True in tail and False in tail[tail.index(True) :]
                if g.advance(step)[0] is not None:
                    break
    assert on > 0


def _drafts_then_a_run(eng: Engine, prompt: str) -> int:
    """Checks each round of one reply (test above); returns how many proposals ended with a run behind a draft."""
    tails = 0
    with eng.generation(prompt, mode="sd", draft_max=16, json_schema=PROFILE, max_tokens=60) as g:
        while g.stop_reason() is None:
            step = eng.round(g)
            p = step.proposal
            if p is not None and p.forced is not None and p.source == MODEL:
                f = p.forced[: p.n].tolist()
                head = f.index(False)  # the draft model's first draft
                made = f[head:].count(False)
                assert f[head:] == [False] * made + [True] * (len(f) - head - made) and made <= 16
                if f[-1]:  # a run behind the last draft: the draft's cache ends before that draft
                    tails += 1
                    assert len(eng.draft.tokens) == len(g.ctx.seq) + head + made - 1
            if g.advance(step)[0] is not None:
                break
    return tails


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_a_forced_run_stops_at_max_tokens(tiny_engine, mode):
    on, off = _both(tiny_engine, "a dog", mode=mode, json_schema=PROFILE, max_tokens=5)
    assert on.token_ids == off.token_ids and on.text == '{"nam' and on.finish_reason == "length"
    assert on.stats["target_calls"] == 1 and on.stats["forced_accepted"] == 4  # the room: 4 drafts, 1 bonus


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_a_long_literal_is_verified_over_rounds_to_the_grammar_end(tiny_engine, mode):
    """Each round at most FORCED_MAX forced tokens; the last completes the grammar and its bonus token is the end
    of generation (the only token the grammar then allows: never forced, the target's)."""
    grammar = f'root ::= "{LITERAL}"'
    on, off = _both(tiny_engine, "we ran far", mode=mode, grammar=grammar, max_tokens=100)
    assert on.text == off.text == LITERAL and on.token_ids == off.token_ids
    assert on.finish_reason == off.finish_reason == "stop"
    assert on.stats["target_calls"] == 3 and off.stats["target_calls"] == (len(LITERAL) if mode == "ar" else 9)
    assert on.origins[:FORCED_MAX] == ["forced"] * FORCED_MAX and on.stats["forced"] == on.stats["forced_accepted"]
    if mode == "ar":  # 16 forced and the bonus, twice; then the last 10 and the end of generation
        assert on.stats["forced_accepted"] == len(LITERAL) - 2 and on.origins[FORCED_MAX] == "target"
    else:  # past the cap the draft model draws what the mask leaves it (the one token), k = 4 a round
        assert on.origins[FORCED_MAX : FORCED_MAX + 4] == ["sd"] * 4


def test_a_forced_run_stops_at_the_context(tiny_pair):
    d, t = tiny_pair
    with Engine(target=t, draft=d, n_ctx=256, n_threads=1, draft_policy="fixed", draft_max=4) as eng:
        prompt = eng.tokenize("we ran far " * 30)[: eng.target.n_ctx - 20]  # 20 tokens of room: the literal
        for mode in ("ar", "sd"):
            on, off = _both(eng, prompt, mode=mode, grammar=f'root ::= "{LITERAL}"', max_tokens=100)
            assert on.token_ids == off.token_ids and on.finish_reason == off.finish_reason == "length"
            assert len(on.token_ids) == 21 and LITERAL.startswith(on.text)  # the room, and one bonus token
            assert on.stats["target_calls"] < off.stats["target_calls"]


def test_a_grammar_that_forces_nothing_changes_nothing(tiny_engine):
    for mode in ("ar", "sd"):
        on, off = _both(tiny_engine, "the cat sat", mode=mode, grammar='root ::= [a-z]+ "."', max_tokens=30)
        assert on.token_ids == off.token_ids and on.stats["forced"] == 0
        assert on.stats["target_calls"] == off.stats["target_calls"]


@pytest.mark.parametrize("sampled", [False, True])
def test_forced_slots_are_never_fuzzy_nor_charged_to_the_budget(tiny_engine, sampled):
    kw = dict(CHAT_DEFAULTS, seed=3) if sampled else {}
    budget = {"quality_budget": 0.5}
    for extra in ({"tau": 0.6}, budget):
        with tiny_engine.generation("a dog", mode="fsd", json_schema=PROFILE, max_tokens=60, **extra, **kw) as g:
            forced = 0
            while g.stop_reason() is None:
                step = tiny_engine.round(g)
                p = step.proposal
                if p is not None and p.forced is not None:
                    slots = np.flatnonzero(p.forced[: step.accepted])
                    assert (step.out.reason[slots] == BY_SD).all() and not step.loss[slots].any()
                    assert all(step.emitted.rescues[i] is None for i in slots)
                    forced += len(slots)
                if g.advance(step)[0] is not None:
                    break
            assert forced > 0 and g.stats.forced_accepted == forced


def _joint(eng: Engine, grammar: str, n: int, **kw) -> dict[tuple[int, int], int]:
    counts: dict[tuple[int, int], int] = {}
    for seed in range(n):
        ids = eng.generate("the cat", grammar=grammar, seed=seed, max_tokens=8, **kw).token_ids
        counts[ids[0], ids[4]] = counts.get((ids[0], ids[4]), 0) + 1
    return counts


def test_sampled_output_keeps_the_targets_constrained_distribution(tiny_engine):
    """A choice of two tokens, three forced, a choice of two: the joint of the two choices with jump-forward (ar:
    the forced run verified, the second choice its bonus; sd: the draft's first choice, the run after it dropped
    when the target rejects it) against the target's own probabilities, read off its top alternatives."""
    grammar = 'root ::= ("s" | "t") "xyz" ("s" | "t")'
    s, t = (max(i for i in range(tiny_engine.n_vocab) if tiny_engine.token_bytes(i) == c) for c in (b"s", b"t"))
    bytes_st = [i for i in range(tiny_engine.n_vocab) if tiny_engine.token_bytes(i) in (b"s", b"t") and i < min(s, t)]
    kw = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, logit_bias={i: float("-inf") for i in bytes_st})
    p: dict[tuple[int, ...], float] = {}
    for seed in range(40):  # the first choice's distribution, and the second's after either
        out = tiny_engine.generate(
            "the cat", grammar=grammar, mode="ar", jump_forward=False, seed=seed, max_tokens=8, top_logprobs=3, **kw
        )
        p.update({(tok,): float(np.exp(lp)) for tok, lp in out.top_logprobs[0] if tok in (s, t)})
        first = out.token_ids[0]
        p.update({(first, tok): float(np.exp(lp)) for tok, lp in out.top_logprobs[4] if tok in (s, t)})
    cells = [(a, b) for a in (s, t) for b in (s, t)]
    assert set(p) == {(s,), (t,), *cells} and abs(p[s,] + p[t,] - 1) < 1e-5
    expected = np.array([p[a,] * p[a, b] for a, b in cells])
    n = 1200
    assert expected.min() * n > 10  # every cell is seen: the test can tell the distributions apart
    for mode in ("ar", "sd"):
        counts = _joint(tiny_engine, grammar, n, mode=mode, **kw)
        assert set(counts) <= set(cells)
        observed = np.array([counts.get(c, 0) for c in cells])
        assert chisquare(observed, expected * n / expected.sum()).pvalue > 0.001, (mode, observed, expected * n)


def test_the_end_of_generation_is_never_forced(tiny_engine):
    """The grammar's end allows only the end of the reply: the target's bonus token, not a forced slot, and not
    in the reply."""
    grammar = 'root ::= "we ran."'
    for mode in ("ar", "sd"):
        with tiny_engine.generation("a dog", mode=mode, grammar=grammar, max_tokens=30) as g:
            steps = []
            while g.stop_reason() is None:
                steps.append(tiny_engine.round(g))
                if g.advance(steps[-1])[0] is not None:
                    break
            last = steps[-1]
            assert tiny_engine.target.is_eog(last.emitted.tokens[-1]) and last.emitted.origins[-1] == "target"
            assert g.reply.origins == ["forced"] * len(g.reply.tokens)
            assert b"".join(tiny_engine.token_bytes(t) for t in g.reply.tokens) == b"we ran."
