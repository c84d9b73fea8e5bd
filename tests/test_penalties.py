"""The sampling chain's penalties and logit bias: the kernels against a plain reference of llama.cpp's rules, the
chain's per-position windows (a draft position sees the drafts before it, a rejected draft penalises nothing),
greedy exactness of sd and fsd at tau 0 against ar and against an independent token-by-token decoding, and the
sampled distribution of sd with penalties on (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from fsd_local import Engine
from fsd_local.chain import Chain
from fsd_local.errors import ConfigError
from fsd_local.kernels.penalties import Penalties, apply_bias, apply_mask, apply_penalties
from fsd_local.llama.model import Model, ModelOptions
from fsd_local.settings import Settings

ALPHA = 1e-3
PEN = dict(repeat_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25, repeat_last_n=16)


def reference(row, window, repeat=1.0, frequency=0.0, presence=0.0, bias=()):
    """llama.cpp's order and rules in float64: bias, then for each distinct token of the window: divide a
    positive logit by `repeat` (multiply a negative one), subtract count * frequency + presence."""
    x = row.astype(np.float64).copy()
    for t, b in bias:
        x[t] += b
    for t in set(window):
        c = list(window).count(t)
        x[t] = x[t] * repeat if x[t] <= 0 else x[t] / repeat
        x[t] -= c * frequency + presence
    return x


def test_penalty_kernel_matches_the_reference():
    rng = np.random.default_rng(0)
    n = 1000
    counts = np.zeros(n, np.int32)
    for trial in range(20):
        row = (rng.standard_normal(n) * 3).astype(np.float32)
        window = rng.integers(0, 40, size=int(rng.integers(0, 64))).astype(np.int32)  # many repeats
        pen = Penalties(float(rng.uniform(0.5, 2)), float(rng.uniform(-1, 1)), float(rng.uniform(-1, 1)))
        got = row.copy()
        apply_penalties(got, window, pen, counts)
        want = reference(row, window.tolist(), *pen)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
        assert not counts.any(), "the scratch counts must be left zero"
        untouched = np.setdiff1d(np.arange(n), window)
        assert np.array_equal(got[untouched], row[untouched])


def test_bias_and_mask_kernels():
    row = np.arange(70, dtype=np.float32)
    apply_bias(row, np.array([3, 69], np.int32), np.array([2.5, -np.inf]))
    assert row[3] == 5.5 and row[69] == -np.inf and row[4] == 4
    allowed = np.zeros(70, bool)
    allowed[[0, 5, 31, 32, 63, 64]] = True
    bits = np.packbits(np.append(allowed, np.zeros(26, bool)).reshape(-1, 32)[:, ::-1], axis=1)
    words = bits.view(">u4").astype(np.uint32).view(np.int32).ravel()  # bit i of word w = token 32 w + i
    x = np.ones(70, np.float32)
    apply_mask(x, 70, words)
    assert np.array_equal(np.isfinite(x), allowed)


def test_chain_scores_each_position_as_if_the_drafts_before_it_were_accepted():
    n = 50
    s = Settings(**PEN, logit_bias=["7+1.5", "9-inf"])
    seq = [1, 2, 3, 2, 5]
    chain = Chain(s, n).start(seq)
    rng = np.random.default_rng(1)
    rows = (rng.standard_normal((4, n)) * 2).astype(np.float32)
    drafts = [2, 7, 8]
    draft_rows = rows.copy()
    for j, d in enumerate(drafts):
        chain.draft_row(draft_rows[j], j)
        assert chain.push(d)
    target = rows.copy()
    chain.target_rows(target, len(drafts))
    bias = ((7, 1.5), (9, -np.inf))
    for j in range(len(drafts) + 1):
        want = reference(rows[j], (seq + drafts[:j])[-16:], 1.3, 0.25, 0.4, bias)
        np.testing.assert_allclose(target[j], want, rtol=1e-6, atol=1e-5)
        if j < len(drafts):
            assert np.array_equal(draft_rows[j], target[j]), "draft and target rows get the same processing"
    # the round kept one draft and emitted token 11: the rejected drafts 7, 8 penalise nothing afterwards
    chain.settle(1, 11)
    seq.extend([2, 11])
    nxt = rows[0].copy()
    chain.draft_row(nxt, 0)
    np.testing.assert_allclose(nxt, reference(rows[0], seq[-16:], 1.3, 0.25, 0.4, bias), rtol=1e-6, atol=1e-5)
    assert nxt[8] == pytest.approx(rows[0][8] + 0, abs=1e-6)


def test_default_settings_leave_the_rows_alone():
    chain = Chain(Settings(), 10).start([1, 2, 3])
    assert not chain.active
    row = np.arange(10, dtype=np.float32)
    chain.target_rows(row[None], 0)
    assert np.array_equal(row, np.arange(10, dtype=np.float32))


def _independent_greedy(path, prompt_ids, n_tokens, last_n, bias):
    """Token by token with the Model alone and the float64 reference: what `ar` with the chain must write."""
    m = Model(ModelOptions(path, n_ctx=512, n_threads=1))
    try:
        seq, out = list(prompt_ids), []
        m.decode(seq, "last")
        for _ in range(n_tokens):
            row = m.logits(1)[0]
            x = reference(row, seq[-last_n:], 1.3, 0.25, 0.4, bias)
            t = int(np.argmax(x))
            if m.is_eog(t):
                break
            out.append(t)
            seq.append(t)
            m.decode([t], "last")
        return out
    finally:
        m.close()


@pytest.mark.parametrize("prompt", ["the cat sat on the mat", "we ran far away, very far"])
def test_greedy_sd_fsd_and_ar_write_the_same_ids_with_penalties_and_bias(tiny_engine, prompt):
    ids = tiny_engine.tokenize(prompt)
    banned = tiny_engine.generate(ids, mode="ar", max_tokens=40).token_ids[3]  # a token greedy writes unbiased
    settings = dict(PEN, logit_bias=[f"{banned}-inf", "120+1.5"], max_tokens=60)
    ar = tiny_engine.generate(ids, mode="ar", **settings)
    plain = tiny_engine.generate(ids, mode="ar", max_tokens=60)
    assert ar.token_ids != plain.token_ids, "the penalties must change something here"
    assert banned not in ar.token_ids
    bias = ((120, 1.5), (banned, -np.inf))
    assert ar.token_ids == _independent_greedy(tiny_engine.target.path, ids, 60, 16, bias)
    for mode, drafter in (("sd", "model"), ("fsd", "model"), ("fsd", "ngram+model")):
        for k in (1, 4):
            out = tiny_engine.generate(ids, mode=mode, tau=0.0, draft_max=k, drafter=drafter, **settings)
            assert out.token_ids == ar.token_ids, (mode, drafter, k)
            assert out.stats["accepted_fuzzy"] == 0


@pytest.mark.real
def test_greedy_identity_on_the_real_f16_pair(real_engine_f16):
    eng = real_engine_f16
    prompt = eng.chat_prompt([{"role": "user", "content": "Write a short poem about the sea and the sky."}])
    settings = dict(repeat_penalty=1.2, presence_penalty=0.5, logit_bias=["30+1", "28-2"], max_tokens=48)
    ar = eng.generate(prompt, mode="ar", **settings)
    assert ar.token_ids != eng.generate(prompt, mode="ar", max_tokens=48).token_ids
    for mode in ("sd", "fsd"):
        out = eng.generate(prompt, mode=mode, tau=0.0, draft_max=4, **settings)
        assert out.token_ids == ar.token_ids, mode


def _softmax(x):
    p = np.exp(x - x[np.isfinite(x)].max())
    return p / p.sum()


def _first_two_tokens(target, prompt, n, last_n, chain):
    """The target's joint distribution of the next two tokens, each row processed by `chain` (float64)."""
    fresh = Model(ModelOptions(target, n_ctx=128, n_threads=1))
    try:
        fresh.decode(prompt, "last")
        p1 = _softmax(chain(fresh.logits(1)[0][:n], prompt[-last_n:]))
        joint = np.zeros((n, n))
        for t1 in np.nonzero(p1 > 1e-5)[0]:
            fresh.truncate(len(prompt))
            fresh.decode([int(t1)], "last")
            joint[t1] = p1[t1] * _softmax(chain(fresh.logits(1)[0][:n], (prompt + [int(t1)])[-last_n:]))
        return joint
    finally:
        fresh.close()


def _pvalue(counts, joint):
    expected = joint.ravel() * counts.sum()
    big = expected >= 5  # the rare cells pooled, so the chi-square approximation holds
    obs = np.append(counts.ravel()[big], counts.ravel()[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    return sps.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def test_sampled_sd_with_penalties_keeps_the_processed_target_distribution(small_vocab_pair):
    """The first two tokens' joint distribution: token 2 is scored with token 1 in the penalties' window (the
    draft's row and the target's alike), so sampled sd must follow the penalised target exactly."""
    draft, target = small_vocab_pair
    last_n, bias = 8, ((5, 2.0),)
    with Engine(target=target, draft=draft, n_ctx=128, n_threads=1) as eng:
        prompt = eng.tokenize("the sky")
        n = eng.n_vocab
        counts = np.zeros((n, n), np.int64)
        for seed in range(2000):
            out = eng.generate(
                prompt,
                mode="sd",
                max_tokens=4,
                seed=seed,
                temperature=1.0,
                draft_max=3,
                ignore_eos=True,
                repeat_penalty=2.0,
                presence_penalty=1.5,
                frequency_penalty=1.0,
                repeat_last_n=last_n,
                logit_bias=["5+2"],
            )
            counts[out.token_ids[0], out.token_ids[1]] += 1
    penalised = _first_two_tokens(target, prompt, n, last_n, lambda x, w: reference(x, w, 2.0, 1.0, 1.5, bias))
    plain = _first_two_tokens(target, prompt, n, last_n, lambda x, w: x.astype(np.float64))
    assert _pvalue(counts, penalised) > ALPHA
    assert _pvalue(counts, plain) < ALPHA, "the penalties must matter in this test"


def test_bad_penalty_and_bias_settings_are_refused_with_a_clear_message(tiny_engine):
    for bad, words in (
        (dict(repeat_penalty=0), "repeat_penalty"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(repeat_last_n=-2), "repeat_last_n"),
        (dict(logit_bias=["12x3"]), r"TOKEN_ID\+BIAS"),
        (dict(logit_bias={"-4": 1}), "token id"),
        (dict(logit_bias=["5+nan"]), r"TOKEN_ID\+BIAS"),
    ):
        with pytest.raises(ConfigError, match=words):
            Settings(**bad)
    s = Settings(logit_bias={"7": "-inf", 3: 1.5}, repeat_penalty=1.1, json_schema='{"type": "object"}')
    assert s.logit_bias == ((3, 1.5), (7, -np.inf))
    assert Settings(**s.to_dict()) == s, "to_dict (the server's fsd.settings, strict JSON) reads back"
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        tiny_engine.generate("a", logit_bias=[f"{tiny_engine.n_vocab + 5}+1"], max_tokens=2)
