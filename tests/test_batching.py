"""Several calls on one Engine at once (batching.py) on tiny F32 and F16 GGUFs: a call's greedy token ids alone
equal its ids among four in one batch (ar, sd, fsd); calls that join, leave or are cancelled mid-stream leave
the others' ids as they were; a grammar's forced tokens proposed in a batch as alone; the batch policy's choice
under load on injected costs; a long prompt joining in chunks; sampled calls in a batch keep the target's
distribution. Nothing is timed."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from fsd_local import CancelToken, Engine
from fsd_local.batching import BatchPrices
from fsd_local.drafting.cost_model import VerifyCost
from support.batchsim import F16_DRAFT, F16_TARGET, WIDE_DRAFT, WIDE_TARGET, extend
from support.tinymodels import write_tiny_gguf
from tests.test_forced import PROFILE

PROMPTS = ["the cat sat", "a dog ran far", "once upon a time", "hello there my"]
GREEDY = {"temperature": 0.0, "draft_policy": "fixed", "draft_max": 4, "max_tokens": 24, "ignore_eos": True}
MODES = {"ar": {"mode": "ar"}, "sd": {"mode": "sd"}, "fsd": {"mode": "fsd", "tau": 0.4}}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    d = tmp_path_factory.mktemp("batching")
    f16 = {"dtype": np.float16, "n_embd": 128, "n_ff": 256}
    return {
        "f32": (str(write_tiny_gguf(d / "d32.gguf", seed=1)), str(write_tiny_gguf(d / "t32.gguf", seed=2, noise=0.1))),
        "f16": (
            str(write_tiny_gguf(d / "d16.gguf", seed=1, **f16)),
            str(write_tiny_gguf(d / "t16.gguf", seed=2, noise=0.1, **f16)),
        ),
    }


def _engine(pair, parallel=1, **kw):
    draft, target = pair
    return Engine(target=target, draft=draft, n_ctx=2048 if parallel > 1 else 512, n_threads=1, parallel=parallel, **kw)


def _alone(pair, prompts, settings):
    with _engine(pair) as eng:
        return [eng.generate(p, **settings).token_ids for p in prompts]


def _together(eng, prompts, settings, each=None):
    """Every prompt's call from its own thread, started together (`settings`: one dict, or one per prompt);
    `each(i, stream)` may read a stream itself."""
    out: list = [None] * len(prompts)
    per = settings if isinstance(settings, list) else [settings] * len(prompts)

    def run(i):
        stream = eng.stream(prompts[i], **per[i])
        out[i] = each(i, stream) if each else [p for p in stream][-1].completion

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    with eng.batch.paused():  # every call waiting before the first round: they run together from the start
        for t in threads:
            t.start()
        while len(eng.batch.waiting) < len(prompts):
            time.sleep(0.001)
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_calls_tokens_alone_equal_its_tokens_in_a_batch_of_four(pairs, dtype, mode):
    settings = {**GREEDY, **MODES[mode]}
    alone = _alone(pairs[dtype], PROMPTS, settings)
    with _engine(pairs[dtype], parallel=4) as eng:
        out = _together(eng, PROMPTS, settings)
        assert eng.batch.peak == 4  # the four ran in one batch
    assert [c.token_ids for c in out] == alone
    assert all(c.finish_reason == "length" and len(c.token_ids) == 24 for c in out)
    if mode != "ar":
        assert all(c.stats["drafted"] > 0 for c in out)


def test_calls_that_join_leave_or_are_cancelled_mid_stream_leave_the_others_alone(pairs):
    """Call 0 runs long; call 1 joins once 0 has streamed; call 2 is cancelled by its token after 3 pieces and
    call 3 by closing its stream after 3: 0 and 1 write what they write alone, 2 and 3 a prefix of theirs, and
    every slot is free again."""
    settings = {**GREEDY, **MODES["fsd"], "max_tokens": 40}
    alone = _alone(pairs["f32"], PROMPTS, settings)
    started = threading.Event()
    cancel = CancelToken()
    with _engine(pairs["f32"], parallel=4) as eng:

        def each(i, stream):
            if i == 1:
                started.wait(30)
                stream = eng.stream(PROMPTS[1], **settings)  # joins a batch already running
            ids = []
            for n, piece in enumerate(stream):
                ids += piece.token_ids
                if i == 0:
                    started.set()
                if n == 2 and i == 2:
                    cancel.set()
                if n == 2 and i == 3:
                    stream.close()
                    return ids, None
                if piece.completion is not None:
                    return ids, piece.completion
            return ids, None

        per = [dict(settings, cancel=cancel) if i == 2 else settings for i in range(4)]
        out = [None] * 4

        def run(i):
            out[i] = each(i, None if i == 1 else eng.stream(PROMPTS[i], **per[i]))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        eng.batch.join(30)
        assert sorted(eng.batch.free) == [0, 1, 2, 3] and not eng.batch.active
        assert eng.batch.peak >= 2
    assert out[0][1].token_ids == alone[0] and out[1][1].token_ids == alone[1]
    assert out[2][1].finish_reason == "cancelled"
    for i in (2, 3):
        ids = out[i][0]
        assert 0 < len(ids) < 40 and ids == alone[i][: len(ids)]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_forced_tokens_of_a_grammar_are_proposed_in_a_batch_as_alone(pairs, mode):
    """Two calls under a JSON schema with jump_forward beside two plain ones: each writes its ids alone, the
    schema calls' forced tokens verified in the batch's target decode (ar's as its proposal, sd/fsd's after and
    between the drafts, decoded by the draft model with its next draw)."""
    plain = {**GREEDY, **MODES[mode]}
    schema = {**plain, "json_schema": PROFILE, "max_tokens": 60, "ignore_eos": False}
    per = [schema if i % 2 == 0 else plain for i in range(4)]
    with _engine(pairs["f32"]) as eng:
        alone = [eng.generate(p, **kw) for p, kw in zip(PROMPTS, per)]
    with _engine(pairs["f32"], parallel=4) as eng:
        out = _together(eng, PROMPTS[:4], per)
        assert eng.batch.peak == 4
    assert [c.token_ids for c in out] == [c.token_ids for c in alone]
    for i in (0, 2):
        assert out[i].stats["forced_accepted"] > 0 and out[i].stats["forced"] == alone[i].stats["forced"]


def test_a_bad_call_fails_alone(pairs):
    """A prompt the context cannot hold is refused in words; the others run."""
    settings = {**GREEDY, **MODES["sd"]}
    with _engine(pairs["f32"], parallel=2) as eng:
        good = eng.generate(PROMPTS[0], **settings)
        with pytest.raises(Exception, match="context"):
            eng.generate("the " * 3000, **settings)
        again = eng.generate(PROMPTS[0], **settings)
    assert good.token_ids == again.token_ids == _alone(pairs["f32"], PROMPTS[:1], settings)[0]


def test_calls_a_batch_cannot_run_run_alone_between_its_calls(pairs):
    """draft-only and prompt lookup beside three batched calls: each runs by itself (the batch waits, then goes
    on), and every call writes its ids alone."""
    per = [{**GREEDY, **MODES["fsd"]}, {**GREEDY, "mode": "draft-only"}, {**GREEDY, **MODES["sd"], "drafter": "ngram"}]
    per.append({**GREEDY, **MODES["ar"]})
    with _engine(pairs["f32"]) as eng:
        alone = [eng.generate(p, **kw).token_ids for p, kw in zip(PROMPTS, per)]
    with _engine(pairs["f32"], parallel=4) as eng:
        assert [eng.batch.takes(eng._settings(None, kw)) for kw in per] == [True, False, False, True]
        out = [None] * 4

        def run(i):
            out[i] = eng.generate(PROMPTS[i], **per[i]).token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        eng.batch.join(30)
        assert sorted(eng.batch.free) == [0, 1, 2, 3] and not eng.batch.active
    assert out == alone


def _injected(eng, verify, draft, n):
    """The batch policy prices rounds by these curves (seconds, index = rows) and learns no live timing."""
    v, d = VerifyCost(), VerifyCost()
    for i, s in enumerate(extend(verify, n)[1:], 1):
        v.observe(i, s)
    for i, s in enumerate(extend(draft, 16)[1:], 1):
        d.observe(i, s)
    eng.batch.prices = BatchPrices(v, d, frozen=True)


def test_the_batch_policy_drafts_long_alone_and_stops_under_load(pairs):
    """The wide pair's measured costs (a compute-poor host) injected, a draft that is the target (every draft
    accepted) and the engine taught so by one fixed-k call: alone `auto` drafts long (>= 5), eight calls at once
    draft nothing, and every call still writes the target's greedy text."""
    draft, target = pairs["f32"]
    settings = {**GREEDY, **MODES["sd"], "draft_policy": "auto", "draft_max": 8, "max_tokens": 32}
    with Engine(target=target, draft=target, n_ctx=4096, n_threads=1, parallel=8) as eng:
        _injected(eng, WIDE_TARGET, WIDE_DRAFT, 8 * 9 + 1)
        eng.generate(PROMPTS[0], **{**settings, "draft_policy": "fixed", "max_tokens": 64})
        alone = eng.generate(PROMPTS[1], **settings)
        single = [plan.ks[0] for n, plan in eng.batch.plans if n == 1]
        eng.batch.plans.clear()
        out = _together(eng, [PROMPTS[i % 4] for i in range(8)], settings)
        full = [plan.ks for n, plan in eng.batch.plans if n == 8]
    assert single and single[0] >= 5
    assert alone.stats["drafted"] > 0
    assert full and all(ks == [0] * 8 for ks in full)
    with _engine((target, target)) as plain:
        want = [plain.generate(p, **{**settings, "mode": "ar"}).token_ids for p in PROMPTS]
    assert [c.token_ids for c in out] == [want[i % 4] for i in range(8)]


def test_where_drafting_never_pays_a_batch_of_auto_calls_is_plain_decoding(pairs):
    """The F16 demo pair's measured costs injected (its draft costs 0.7 of its target): four sd and fsd calls at
    once with `auto` draft k = 0 every round, the draft model never evaluates a token (not even the prompts), and
    each call writes what `ar` writes."""
    settings = {**GREEDY, "draft_policy": "auto", "draft_max": 8}
    per = [{**settings, **MODES["sd" if i % 2 else "fsd"]} for i in range(4)]
    with _engine(pairs["f16"], parallel=4) as eng:
        _injected(eng, F16_TARGET, F16_DRAFT, 4 * 9 + 1)
        out = _together(eng, PROMPTS[:4], per)
        assert eng.batch.peak == 4
        assert set(eng.batch.k_counts) == {0} and eng.batch.k_counts[0] >= 4 * 20
        assert all(plan.ks == [0] * n for n, plan in eng.batch.plans)
        assert not any(eng.draft.seqs)  # no draft decode ran: the prompts were never caught up
    ar = _alone(pairs["f16"], PROMPTS, {**GREEDY, "mode": "ar"})
    assert [c.token_ids for c in out] == ar
    assert all(c.stats["drafted"] == 0 for c in out)


def test_a_call_of_fixed_k_is_priced_beside_auto_calls_at_its_own_k(pairs):
    """The F16 demo pair's measured costs injected: one sd call whose settings fix k = 5 beside three `auto` calls
    (at most 4): every plan of the four holds the fixed call's 5 (its rows and draft decodes priced, never
    changed), and each call writes what `ar` writes."""
    auto = {**GREEDY, **MODES["sd"], "draft_policy": "auto", "draft_max": 4}
    per = [{**GREEDY, **MODES["sd"], "draft_max": 5, "max_tokens": 200}] + [auto] * 3  # room for k = 5 throughout
    with _engine(pairs["f16"], parallel=4) as eng:
        _injected(eng, F16_TARGET, F16_DRAFT, 4 * 9 + 1)
        out = _together(eng, PROMPTS[:4], per)
        four = [plan.ks for n, plan in eng.batch.plans if n == 4]
    assert four and all(sorted(ks)[-1] == 5 and sorted(ks)[-2] <= 4 for ks in four)
    assert out[0].stats["drafted"] > 0
    ar = _alone(pairs["f16"], PROMPTS, {**GREEDY, "mode": "ar"})
    assert [c.token_ids for c in out[1:]] == ar[1:]
    assert out[0].token_ids == _alone(pairs["f16"], PROMPTS[:1], {**GREEDY, "mode": "ar", "max_tokens": 200})[0]


def test_a_batch_that_plans_no_drafts_probes_and_comes_back_to_drafting(pairs):
    """The wide pair's measured costs injected, a draft that is the target (every draft accepted) and the
    engine's evidence under these settings one round of 8 refused drafts: two `auto` calls at once plan no
    drafts, one probes (2 drafts: batch_length.probe_pays), its accepted drafts bring the plans back to drafting,
    and each call still writes the target's greedy text."""
    draft, target = pairs["f32"]
    settings = {**GREEDY, **MODES["sd"], "draft_policy": "auto", "draft_max": 8, "max_tokens": 96}
    with Engine(target=target, draft=target, n_ctx=2048, n_threads=1, parallel=2) as eng:
        _injected(eng, WIDE_TARGET, WIDE_DRAFT, 2 * 9 + 1)
        eng.generate(PROMPTS[0], **{**settings, "draft_policy": "fixed", "draft_max": 1, "max_tokens": 1})
        # the settings' evidence (eng.policy.length's, which each call forks at its join): mean acceptance 1/3
        eng.policy.length.cost(("model", 0)).observe_acceptance(8, 0)
        out = _together(eng, PROMPTS[:2], settings)
        plans = [plan.ks for n, plan in eng.batch.plans if n == 2]
    assert plans[0] == [0, 0] and eng.batch.probes >= 1
    assert any(sum(ks) > 0 for ks in plans[1:]) and sum(c.stats["drafted"] for c in out) > 2
    with _engine((target, target)) as plain:
        want = [plain.generate(p, **{**settings, "mode": "ar"}).token_ids for p in PROMPTS[:2]]
    assert [c.token_ids for c in out] == want


def test_a_long_prompt_joins_in_chunks_while_the_others_keep_emitting(pairs):
    """A call with a 280-token prompt joins two streaming calls: every decode holding its prompt holds at most a
    chunk of it and the others' rows (each takes its round beside it), and all three write what they write alone;
    its draft model catches up in chunks too when it drafts (sd, fixed k: the same greedy text whatever k)."""
    settings = {**GREEDY, **MODES["sd"], "max_tokens": 60}
    long = " ".join(["the cat sat on the mat"] * 12)  # a token a character: ~280 tokens
    prompts = [PROMPTS[0], PROMPTS[1], long]
    alone = _alone(pairs["f32"], prompts, settings)
    with _engine(pairs["f32"], parallel=4) as eng:
        eng.batch.prefill_chunk = 16
        n_long = len(eng.tokenize(long))
        out = [None] * 3
        started = threading.Event()

        def run(i):
            if i == 2:
                started.wait(30)
            ids = []
            for piece in eng.stream(prompts[i], **settings):
                ids += piece.token_ids
                if i == 0 and len(ids) >= 4:
                    started.set()
            out[i] = ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        with eng.batch.paused():
            for t in threads[:2]:
                t.start()
            while len(eng.batch.waiting) < 2:
                time.sleep(0.001)
        threads[2].start()
        for t in threads:
            t.join(60)
        eng.batch.join(30)
        chunks = list(eng.batch.chunks)
    target = [c for c in chunks if c[2] == "target"]
    draft = [c for c in chunks if c[2] == "draft"]
    assert n_long > 250 and len(target) >= (n_long - 18) // 16
    assert all(c[3] == 16 and c[4] >= 1 for c in target)  # a chunk, and at least one other call's round beside it
    assert len({c[1] for c in target}) == 1 and len({c[0] for c in target}) == len(target)
    assert draft and all(c[3] == 16 for c in draft)
    assert out == alone


def test_sampled_calls_in_a_batch_keep_the_targets_two_token_distribution(small_vocab_pair):
    """Sampled sd with up to eight calls in each round (every seed its own call): the first two tokens follow the
    target's joint distribution at that temperature (chi-square over seeds), as one call alone does
    (test_dense.py)."""
    from concurrent.futures import ThreadPoolExecutor

    from test_dense import ALPHA, _first_two, _pvalue

    draft, target = small_vocab_pair
    t = 0.7
    settings = {"mode": "sd", "max_tokens": 4, "temperature": t, "ignore_eos": True}
    with Engine(
        target=target, draft=draft, n_ctx=1024, n_threads=1, parallel=8, draft_policy="fixed", draft_max=3
    ) as eng:
        prompt = eng.tokenize("the sky")
        n = eng.n_vocab
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda seed: eng.generate(prompt, seed=seed, **settings).token_ids, range(2000)))
        assert eng.batch.peak >= 4
    counts = np.zeros((n, n), np.int64)
    for ids in outs:
        counts[ids[0], ids[1]] += 1
    assert _pvalue(counts.ravel(), _first_two(target, prompt, t).ravel()) > ALPHA


def _evidence(eng) -> dict:
    """The engine's acceptance evidence of the draft model, by the mode of the settings it was gathered under."""
    state = eng.policy_state()["lengths"]
    by_mode = {key[0]: costs for key, costs in state["by_key"].items()}
    by_mode[state["key"][0]] = state["costs"]
    return {mode: costs[("model", 0)].pooled() for mode, costs in by_mode.items()}


def test_calls_of_mixed_settings_in_one_batch_feed_each_settings_own_evidence(pairs):
    """An sd call beside an fsd call (tau 0.69: every draft accepted): the engine's evidence under sd's settings
    is what the same sd call leaves alone, and fsd's is fsd's own, whichever joined last."""
    sd, fsd = {**GREEDY, **MODES["sd"]}, {**GREEDY, "mode": "fsd", "tau": 0.69}
    with _engine(pairs["f32"], parallel=2) as eng:
        eng.generate(PROMPTS[0], **sd)
        alone = _evidence(eng)["sd"]
    for order in ((sd, fsd), (fsd, sd)):
        with _engine(pairs["f32"], parallel=2) as eng:
            out = [None] * 2

            def run(i, kw=order):
                out[i] = [p for p in eng.stream(PROMPTS[0] if kw[i] is sd else PROMPTS[1], **kw[i])][-1].completion

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            with eng.batch.paused():
                for t in threads:
                    t.start()
                while len(eng.batch.waiting) < 2:
                    time.sleep(0.001)
            for t in threads:
                t.join(60)
            assert eng.batch.peak == 2
            mixed = _evidence(eng)
        f = out[order.index(fsd)]
        assert mixed["sd"] == alone
        assert f.stats["acceptance_rate"] == 1.0 and f.stats["drafted"] > 0 and mixed["fsd"][0] > alone[0]
