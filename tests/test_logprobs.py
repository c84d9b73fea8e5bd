"""Log-probabilities: the target's log-softmax of each emitted token and its top alternatives, computed by the
acceptance kernel from the rows it saw, checked against a float64 recomputation (tests/support/reference.py) in the
kernel and end to end on real llama.cpp models (the tiny F32 GGUFs; the F16 SmolLM2 pair)."""

from __future__ import annotations

import numpy as np
import pytest

from fsd_local import ConfigError, Settings
from fsd_local.kernels import sampling as S
from fsd_local.kernels.accept import FSD, SD, Drafts, Rule, Sampling, accept_round, round_out
from fsd_local.kernels.budget import new_budget
from fsd_local.kernels.emit import emit_one
from fsd_local.kernels.names import DIVERGENCES
from support.reference import log_softmax

PROMPT = "the fox walks through the forest at night"


def reference_top(row, k):
    lp = log_softmax(row)  # float64
    ids = np.argsort(-np.asarray(row, np.float64), kind="stable")[:k]
    return lp, ids


@pytest.mark.parametrize("mode,tau,temperature", [(SD, 0.0, 0.0), (FSD, 0.4, 0.0), (FSD, 0.4, 0.8), (SD, 0.0, 1.0)])
def test_kernel_logprobs_match_float64(mode, tau, temperature):
    rng = np.random.default_rng(7)
    k, n, n_top = 5, 3000, 6
    for trial in range(20):
        P = (rng.standard_normal((k + 1, n)) * 3).astype(np.float32)
        Q = (P[:k] + rng.standard_normal((k, n))).astype(np.float32)
        drafts = np.array([int(np.argmax(Q[i])) for i in range(k)], np.int32)
        q_stats = np.zeros((k + 1, 3), np.float32)
        q_prob = np.ones(k)
        if temperature > 0:
            for i in range(k):
                q_stats[i] = S.processed(Q[i], n, temperature, 0, 1.0, 0.0)
                q_prob[i] = S.prob(Q[i], drafts[i], temperature, *q_stats[i])
        out = round_out(k, n_top)
        acc, nxt = accept_round(
            P,
            Drafts(Q, drafts, q_prob, q_stats, np.zeros(k, np.uint8)),
            k,
            n,
            Rule(mode, DIVERGENCES.index("js"), tau, 50),
            Sampling(temperature, 0, 1.0, 0.0),
            rng.random(k + 1),
            out,
            new_budget(None, k),
        )
        emitted = list(drafts[:acc]) + [int(nxt)]
        for j, tok in enumerate(emitted):
            lp, ids = reference_top(P[j], n_top)
            assert out.logprob[j] == pytest.approx(lp[tok], abs=1e-6)
            assert list(out.top_ids[j]) == list(ids)
            np.testing.assert_allclose(out.top_logprob[j], lp[ids], atol=1e-6)


def test_emit_one_fills_the_same_buffers_and_pads_a_short_vocabulary():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(4) * 2).astype(np.float32)
    out = round_out(2, 6)  # six alternatives asked, four tokens exist
    tok, lp = emit_one(x, 4, Sampling(0.0, 0, 1.0, 0.0), 0.0, np.zeros(3, np.float32), out)
    ref, ids = reference_top(x, 4)
    assert tok == ids[0] and lp == pytest.approx(ref[tok], abs=1e-6) and out.logprob[0] == lp
    assert list(out.top_ids[0]) == [*ids, -1, -1]
    np.testing.assert_allclose(out.top_logprob[0][:4], ref[ids], atol=1e-6)
    assert np.all(np.isneginf(out.top_logprob[0][4:]))


def record_rows(monkeypatch, model) -> dict[int, np.ndarray]:
    """Every logit row the engine reads from the target, in float64, by the cache position it scores (a later
    round's row for a position replaces an earlier one: it is the one the emitted token came from)."""
    rows: dict[int, np.ndarray] = {}
    read = model.logits

    def logits(n=None):
        out = read(n)
        base = len(model.tokens) - out.shape[0]
        for j in range(out.shape[0]):
            rows[base + j] = np.array(out[j], np.float64)
        return out

    monkeypatch.setattr(model, "logits", logits)
    return rows


def check_against_rows(c, rows, prompt_len, n_top):
    """c's logprobs against float64 log-softmax of the rows its tokens were chosen from."""
    assert len(c.logprobs) == len(c.origins) == len(c.token_ids) > 0
    for i, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        ref, ids = reference_top(rows[prompt_len + i - 1], n_top)
        assert lp == pytest.approx(ref[tok], abs=1e-6)
        if n_top:
            top = c.top_logprobs[i]
            assert [t for t, _ in top] == list(ids)
            np.testing.assert_allclose([v for _, v in top], ref[ids], atol=1e-6)


@pytest.mark.parametrize(
    "settings",
    [
        {"mode": "ar"},
        {"mode": "sd"},
        {"mode": "fsd", "tau": 0.4},
        {"mode": "fsd", "tau": 0.4, "temperature": 0.9, "top_p": 0.9, "seed": 3},
        {"mode": "fsd", "tau": 0.3, "drafter": "ngram+model"},
    ],
)
def test_engine_logprobs_match_a_float64_recomputation(tiny_engine, monkeypatch, settings):
    tiny_engine.reset()
    rows = record_rows(monkeypatch, tiny_engine.target)
    c = tiny_engine.generate(PROMPT, max_tokens=24, top_logprobs=4, **settings)
    check_against_rows(c, rows, len(tiny_engine.tokenize(PROMPT)), 4)
    assert set(c.origins) <= {"target", "sd", "fuzzy"}
    if settings.get("temperature", 0) == 0 and settings["mode"] != "fsd":
        assert [top[0][0] for top in c.top_logprobs] == c.token_ids  # greedy, lossless: the target's top token
    if settings["mode"] == "fsd":
        assert {"sd", "fuzzy"} & set(c.origins)


def test_streamed_pieces_carry_the_same_logprobs(tiny_engine):
    pieces = list(tiny_engine.stream(PROMPT, max_tokens=20, tau=0.3, logprobs=True))
    c = pieces[-1].completion
    assert c.top_logprobs is None  # logprobs without alternatives
    assert [x for p in pieces for x in (p.logprobs or [])] == c.logprobs
    assert [t for p in pieces for t in p.token_ids] == c.token_ids
    assert all(p.logprobs is not None and len(p.logprobs) == len(p.token_ids) for p in pieces[:-1])
    d = c.to_dict()
    assert d["logprobs"] == c.logprobs and d["origins"] == c.origins


def test_no_logprobs_unless_asked(tiny_engine):
    c = tiny_engine.generate(PROMPT, max_tokens=4)
    assert c.logprobs is None and c.top_logprobs is None and "logprobs" not in c.to_dict()


def test_logprob_settings_are_checked():
    assert Settings(top_logprobs=3).logprobs  # alternatives imply logprobs
    with pytest.raises(ConfigError, match="top_logprobs=21 must be >= 0 and <= 20"):
        Settings(top_logprobs=21)
    with pytest.raises(ConfigError, match="draft-only does not run the target"):
        Settings(mode="draft-only", logprobs=True)


@pytest.mark.real
def test_logprobs_match_a_float64_recomputation_on_the_f16_pair(real_engine_f16, monkeypatch):
    prompt = "The capital of France is"
    real_engine_f16.reset()
    rows = record_rows(monkeypatch, real_engine_f16.target)
    c = real_engine_f16.generate(prompt, mode="fsd", tau=0.3, max_tokens=32, top_logprobs=3)
    check_against_rows(c, rows, len(real_engine_f16.tokenize(prompt)), 3)
    assert {"sd", "fuzzy"} & set(c.origins)
