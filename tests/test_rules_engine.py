"""The lossy rules of kernels/rules.py in the engine, on tiny real llama.cpp models (F32: greedy ids comparable):
tau = 0 is exactly sd (greedy: token ids equal ar's; sampled: the first token has the target's distribution, a
chi-square test as for sd), with the draft model and with prompt lookup (no draft model), and a huge tau
rescues and moves the output."""

import numpy as np
import pytest
from test_engine import ALPHA, _chisquare_pvalue, _first_token_counts, _target_first_token_distribution

from fsd_local import Engine

NEW_MODES = ("typical", "cascade", "relaxed", "fsd-entropy")
PROMPTS = ["the cat sat on the mat", "a", "we ran far away, very far"]


@pytest.mark.parametrize("mode", NEW_MODES)
def test_greedy_tau0_equals_greedy_ar(tiny_engine, mode):
    for prompt in PROMPTS:
        ar = tiny_engine.generate(prompt, mode="ar", max_tokens=80)
        for k in (1, 3, 6):
            out = tiny_engine.generate(prompt, mode=mode, tau=0.0, draft_max=k, max_tokens=80)
            assert out.token_ids == ar.token_ids, (mode, k, prompt)
            assert out.stats["accepted_fuzzy"] == 0


@pytest.mark.parametrize("mode", NEW_MODES)
def test_a_large_tau_rescues_and_records_the_rule(tiny_engine, mode):
    out = tiny_engine.generate("the cat sat on the mat", mode=mode, tau=5.0, relaxed_k=50, max_tokens=60)
    st = out.stats
    assert st["accepted_fuzzy"] > 0 and "fuzzy" in out.origins
    assert st["divergences_computed"] > 0  # the smallest rescuing tau of each evaluated slot


@pytest.fixture(scope="module")
def target_only(tiny_pair):
    with Engine(target=tiny_pair[1], n_ctx=512, n_threads=1, draft_policy="fixed", draft_max=4) as eng:
        yield eng


@pytest.mark.parametrize("mode", NEW_MODES)
def test_the_rules_work_with_prompt_lookup_and_no_draft_model(target_only, mode):
    prompt = "the cat. the cat. the cat. the"
    ar = target_only.generate(prompt, mode="ar", max_tokens=40)
    exact = target_only.generate(prompt, mode=mode, tau=0.0, drafter="ngram", max_tokens=40)
    assert exact.token_ids == ar.token_ids and exact.stats["drafted"] > 0
    loose = target_only.generate(prompt, mode=mode, tau=1e6, drafter="ngram", relaxed_k=300, max_tokens=40)
    if mode != "fsd-entropy":  # the target rules take any token the target does not mask at a huge tau
        assert loose.stats["drafted"] > 0 and loose.stats["acceptance_rate"] == 1.0


@pytest.mark.parametrize("mode", NEW_MODES)
def test_sampled_tau0_preserves_the_target_distribution_and_a_huge_tau_shifts_it(small_vocab_pair, mode):
    draft, target = small_vocab_pair
    with Engine(target=target, draft=draft, n_ctx=128, n_threads=1, draft_policy="fixed", draft_max=4) as eng:
        prompt = eng.tokenize("the sky")
        p = _target_first_token_distribution(eng, prompt)
        n = 2000
        counts = _first_token_counts(eng, prompt, n, mode=mode, tau=0.0)
        assert _chisquare_pvalue(counts, p) > ALPHA
        shifted = _first_token_counts(eng, prompt, n, mode=mode, tau=1e6, relaxed_k=36)
        assert _chisquare_pvalue(shifted, p) < ALPHA, "a huge tau must shift the output to the draft"
        assert not np.array_equal(counts, shifted)


@pytest.mark.parametrize("mode", ["fsd", "fsd-paper", *NEW_MODES])
def test_only_the_lossless_test_ends_a_reply(tiny_engine, mode):
    """A token that would end the reply (here: complete a stop string; an end of generation is the same slot flag,
    round.py) is never rescued. Each stop string is a character the rule rescued in the reply without it: with
    the stop string the reply is the same up to that token, then goes on from the target's own token there
    instead of ending; wherever a stop string does end a reply, the token that completed it is the target's."""
    knobs = {"mode": mode, "tau": 1e9, "relaxed_k": 300, "max_tokens": 40}
    went_on = 0
    for prompt in PROMPTS + ["the sky is", "a dog ran"]:
        free = tiny_engine.generate(prompt, **knobs)
        pieces = [tiny_engine.token_bytes(t) for t in free.token_ids]
        firsts = {}  # a character's first token in the reply, when that token is the character alone
        for i, b in enumerate(pieces):
            for c in {chr(x) for x in b if chr(x).isalnum()}:
                firsts.setdefault(c, i if b == c.encode() else None)
        ids = tiny_engine.tokenize(prompt)
        own = lambda i: tiny_engine.generate(ids + free.token_ids[:i], mode="ar", max_tokens=1).token_ids  # noqa: E731
        cases = [(c, i) for c, i in sorted(firsts.items()) if i is not None and own(i) != free.token_ids[i : i + 1]]
        for stop, i in cases[:3]:  # the rule took a token the target would not write there
            out = tiny_engine.generate(prompt, stop=[stop], **knobs)
            assert out.token_ids[:i] == free.token_ids[:i], (prompt, stop)
            assert len(out.token_ids) > i and out.token_ids[i] != free.token_ids[i], (prompt, stop, out.finish_reason)
            went_on += 1
            if out.finish_reason == "stop":
                before = ids + out.token_ids[:-1]
                assert tiny_engine.generate(before, mode="ar", max_tokens=1).token_ids == out.token_ids[-1:]
    assert went_on >= 3
