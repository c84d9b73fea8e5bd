"""llama.cpp's backend samplers (llama/samplers.py, device_picks.py), forced on for this CPU build
(FSD_LOCAL_BACKEND_SAMPLING=on) and checked against the host path on the tiny F32 models: greedy, the same tokens
(sd, ar, draft-only, and the draft's picks); sampled plain steps, the target's distribution (a chi-square of the
first token over seeds) and a seed's replay; the choice of which picks go to the device, and that a CPU build
makes none by default."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine import ALPHA, _chisquare_pvalue, _fresh_logits

from fsd_local import Engine
from fsd_local.llama.samplers import ENV, wanted


@pytest.fixture()
def device_sampling(monkeypatch):
    monkeypatch.setenv(ENV, "on")


def _engine(pair, **kw):
    d, t = pair
    return Engine(target=t, draft=d, n_ctx=256, n_threads=1, draft_policy="fixed", draft_max=4, **kw)


GREEDY = [
    {"mode": "sd"},
    {"mode": "ar"},
    {"mode": "draft-only"},
    {"mode": "fsd", "tau": 0.0},
    {"mode": "sd", "draft_policy": "auto"},
]


@pytest.mark.parametrize("settings", GREEDY, ids=lambda s: " ".join(f"{k}={v}" for k, v in s.items()))
def test_greedy_picks_on_the_device_are_the_hosts(tiny_pair, monkeypatch, settings):
    """The same tokens, round for round, with the picks made by the device's argmax (F32 models: the rows the host
    reads are the device's own)."""
    monkeypatch.setenv(ENV, "off")
    with _engine(tiny_pair) as eng:
        host = [eng.generate(p, max_tokens=40, ignore_eos=True, **settings) for p in ("the cat", "a dog ran")]
        assert not eng.target.sampler.active
    monkeypatch.setenv(ENV, "on")
    with _engine(tiny_pair) as eng:
        dev = [eng.generate(p, max_tokens=40, ignore_eos=True, **settings) for p in ("the cat", "a dog ran")]
        model = eng.draft if settings["mode"] == "draft-only" else eng.target
        assert model.sampler.active
        if settings["mode"] == "sd" and settings.get("draft_policy") != "auto":
            assert eng.draft.sampler.active and eng.target.sampler.kind == (0.0, 0xFFFFFFFF)
    for h, d in zip(host, dev):
        assert d.token_ids == h.token_ids
        if settings.get("draft_policy") != "auto":  # auto's draft lengths follow the measured costs
            assert d.stats["accepted_sd"] == h.stats["accepted_sd"] and d.stats["rounds"] == h.stats["rounds"]


def test_what_needs_a_row_stays_on_the_host(tiny_pair, device_sampling):
    """Sampled rounds (the SD test reads p~ and q~), a divergence that may rescue (the draft's rows), log-
    probabilities and the chain's processing keep their picks on the host."""
    with _engine(tiny_pair) as eng:
        for settings, target, draft in [
            ({"mode": "sd"}, True, True),
            ({"mode": "fsd", "tau": 0.3}, False, False),
            ({"mode": "typical", "tau": 0.5}, False, True),
            ({"mode": "sd", "temperature": 0.7}, False, False),
            ({"mode": "sd", "logprobs": True}, False, False),
            ({"mode": "sd", "repeat_penalty": 1.2}, False, False),
            ({"mode": "ar", "temperature": 0.7}, True, False),
            ({"mode": "ar", "top_logprobs": 2}, False, False),
        ]:
            eng.generate("the cat", max_tokens=6, **settings)
            assert (eng.target.sampler.active, eng.draft.sampler.active) == (target, draft), settings


def test_sampled_plain_steps_on_the_device_follow_the_target(small_vocab_pair, device_sampling):
    """ar at temperature 0.7 with the draw on the device: the first token's distribution is the target's p~
    (chi-square over seeds), a seed replays its tokens, and seeds differ."""
    d, t = small_vocab_pair
    with Engine(target=t, draft=d, n_ctx=128, n_threads=1) as eng:
        prompt = eng.tokenize("the sky")
        counts = np.zeros(eng.n_vocab, np.int64)
        for seed in range(1500):
            out = eng.generate(prompt, mode="ar", temperature=0.7, max_tokens=1, seed=seed)
            counts[out.token_ids[0]] += 1
        assert eng.target.sampler.active
        a = eng.generate(prompt, mode="ar", temperature=0.7, max_tokens=12, seed=5, ignore_eos=True)
        b = eng.generate(prompt, mode="ar", temperature=0.7, max_tokens=12, seed=5, ignore_eos=True)
        c = eng.generate(prompt, mode="ar", temperature=0.7, max_tokens=12, seed=6, ignore_eos=True)
    row = _fresh_logits(t, prompt).astype(np.float64) / 0.7
    p = np.exp(row - row.max())
    assert _chisquare_pvalue(counts, p / p.sum()) > ALPHA
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_a_cpu_build_samples_on_the_host_by_default(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert not wanted(-1, False, 18)  # no GPU offload in this build
    monkeypatch.setenv(ENV, "on")
    assert wanted(0, False, 18)
