"""Integration on the real SmolLM2 demo pair (docs/models.md): draft = SmolLM2-135M, target = its 44-layer
upscaled copy."""

import numpy as np
import pytest

from fsd_local import Engine
from fsd_local.llama.model import Model, ModelOptions
from fsd_local.stream import TextStream

pytestmark = pytest.mark.real

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


# llama.cpp's CPU kernels quantise activations per batch shape on quantised weights (repacked Q4 layouts on
# AVX2/AVX-512 hosts): there one batch and token-by-token evaluation differ by up to ~1.2 in the logits, so a
# near-tie can flip greedy sd against ar. On F16 weights they differ by <= 0.07: exact comparisons run there.
BATCH_SHAPE_NOISE_Q4 = 1.5


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_sd_and_fsd_tau0_emit_the_targets_greedy_tokens_on_f16(real_engine_f16, prompt):
    ar = real_engine_f16.generate(prompt, mode="ar", max_tokens=48)
    sd = real_engine_f16.generate(prompt, mode="sd", max_tokens=48)
    fsd0 = real_engine_f16.generate(prompt, mode="fsd", tau=0.0, max_tokens=48)
    assert sd.token_ids == ar.token_ids == fsd0.token_ids
    assert sd.stats["acceptance_rate"] > 0.2  # the pair really speculates
    assert sd.stats["target_calls"] < ar.stats["target_calls"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_sd_on_the_quantised_pair_differs_from_ar_only_at_a_near_tie(real_engine, real_pair, prompt):
    """The quantised check that reports instead of flaking: where sd and ar part ways, the two tokens must have
    been within the batch-shape noise of each other in the target's own logits at that position."""
    ar = real_engine.generate(prompt, mode="ar", max_tokens=48).token_ids
    sd = real_engine.generate(prompt, mode="sd", max_tokens=48).token_ids
    n = next((i for i, (a, b) in enumerate(zip(ar, sd)) if a != b), None)
    print(
        f"\n{prompt!r}: greedy sd == ar for {n if n is not None else min(len(ar), len(sd))} tokens"
        + (" (identical)" if n is None else f", then {sd[n]} vs {ar[n]}")
    )
    if n is None:
        assert ar == sd or min(len(ar), len(sd)) < 48  # one stopped at end-of-generation
        return
    m = Model(ModelOptions(real_pair[1], n_ctx=512, n_threads=2))
    try:
        m.decode(real_engine.tokenize(prompt) + ar[:n], "last")
        row = m.logits(1)[0]
        margin = abs(float(row[ar[n]]) - float(row[sd[n]]))
    finally:
        m.close()
    print(f"  target logit margin between them: {margin:.3f} (batch-shape noise bound {BATCH_SHAPE_NOISE_Q4})")
    assert margin < BATCH_SHAPE_NOISE_Q4


def test_huge_tau_accepts_everything_on_the_real_pair(real_engine):
    out = real_engine.generate("The capital of France is", tau=1e9, max_tokens=41, draft_max=4)
    assert out.stats["acceptance_rate"] == 1.0
    if out.finish_reason == "length":
        assert out.stats["rounds"] == 9  # 8 rounds of 5 and one of 1
    draft_alone = real_engine.generate("The capital of France is", mode="draft-only", max_tokens=4)
    assert out.token_ids[:4] == draft_alone.token_ids


def test_fuzzy_rescue_is_used_and_recorded(real_engine):
    # (tokens per round need not grow with tau over free generation: the text itself changes; the
    # fixed-context monotonicity is tested in test_sampling.py)
    prompt = "Write a short story about a robot who learns to paint."
    fsd = real_engine.generate(prompt, mode="fsd", tau=0.3, divergence="js", max_tokens=64)
    assert fsd.stats["accepted_fuzzy"] > 0
    assert fsd.origins.count("fuzzy") == fsd.stats["accepted_fuzzy"] or fsd.finish_reason == "stop"
    q = fsd.stats["divergence_quantiles"]
    assert 0 <= q["q10"] <= q["q50"] <= q["q90"] <= np.log(2) + 1e-6


def test_kv_invariant_on_the_real_pair(real_pair):
    draft, target = real_pair
    with Engine(target=target, draft=draft, n_ctx=512, n_threads=2, draft_policy="fixed", draft_max=4) as eng:
        seq = eng.tokenize("The quick brown fox")
        out = eng.generate(seq, mode="fsd", tau=0.1, temperature=0.8, seed=5, max_tokens=40)
        assert out.stats["drafted"] > out.stats["accepted_sd"] + out.stats["accepted_fuzzy"]
        seq = seq + out.token_ids
        for model, path in ((eng.target, target), (eng.draft, draft)):
            assert model.tokens == seq[: len(model.tokens)]
            model.decode(seq[len(model.tokens) :], "last")
            got = model.logits(1)[0].copy()
            fresh = Model(ModelOptions(path, n_ctx=512, n_threads=2))
            fresh.decode(seq, "last")
            want = fresh.logits(1)[0]
            assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
            assert int(np.argmax(got)) == int(np.argmax(want))
            fresh.close()


def test_streamed_text_never_splits_a_utf8_character_with_real_token_bytes(real_engine):
    text = "naïve café — 日本語 🙂🚀 über"
    tokens = real_engine.tokenize(text, add_special=False)
    pieces = [real_engine.target.piece(t) for t in tokens]
    assert any(len(p) and (p[0] & 0xC0) == 0x80 for p in pieces), "expected tokens that split a character"
    stream = TextStream()
    out = [stream.push(p) for p in pieces] + [stream.flush()]
    assert all("\ufffd" not in o for o in out)
    assert "".join(out) == text


def test_chat_turn_two_reuses_turn_one(real_engine):
    msgs = [{"role": "user", "content": "Name a colour."}]
    first = real_engine.chat(msgs, max_tokens=16, tau=0.2)
    msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Another one?"}]
    second = real_engine.chat(msgs, max_tokens=16, tau=0.2)
    assert second.stats["prompt_evaluated"] < second.stats["prompt_tokens"] // 2
