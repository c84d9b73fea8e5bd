"""A draft of another vocabulary runs in the engine (drafting/across.py): its rows carried onto the target's ids,
its cache following the text. Greedy `sd` and `fsd` at tau 0 emit `ar`'s ids on tiny F32 pairs of two tokenizers
(shared tokens, the target's own tokens, byte fallback, words split differently, ends of generation); the
divergences that are infinite off the shared tokens rescue nothing; bad pairs get one-line errors; SmolLM2
drafts for Gemma 3."""

from __future__ import annotations

import numpy as np
import pytest

import support.tinymodels as tm
from fsd_local import ConfigError, Engine, VocabularyMismatchError
from fsd_local.llama.model import Model
from fsd_local.llama.options import ModelOptions
from fsd_local.llama.vocab import check_compatible

CHAT_PROMPTS = ("Explain how a refrigerator keeps food cold.", "Describe the water cycle in simple terms.")
PROMPT = "the cab and a cab, the end. the ab and é! a € and ü ß the band"


_add_tokenizer = tm.add_tokenizer


def _eos_at_im_end(w, tokens, scores, types, eos: int = 2) -> None:
    """The SentencePiece metadata of tinymodels.add_tokenizer, but ending a turn with <|im_end|>."""
    _add_tokenizer(w, tokens, scores, types, eos=tokens.index("<|im_end|>"))


@pytest.fixture(scope="module")
def files(tmp_path_factory, cross_pair, monkeypatch_module):
    """Three pairs through the map, each target at least as large as its draft: `twin` (the tiny draft's weights
    and tokens, another EOS, for the noisy target of the same base: drafts accepted and rejected), `bpe` (byte-level
    BPE for a larger SentencePiece target: the target writes bytes in byte-fallback tokens), `spm` (SentencePiece
    for a larger BPE target: whole-word tokens the draft spells in letters)."""
    d = tmp_path_factory.mktemp("across_engine")
    spm, bpe = cross_pair
    control = ("<|im_end|>",)
    monkeypatch_module.setattr(tm, "add_tokenizer", _eos_at_im_end)
    twin = str(tm.write_tiny_gguf(d / "twin.gguf", seed=1, control=control))
    monkeypatch_module.undo()
    return {
        "twin": (twin, str(tm.write_tiny_gguf(d / "noisy.gguf", seed=2, noise=0.1, control=control))),
        "bpe": (bpe, str(tm.write_tiny_gguf(d / "big.gguf", seed=4, n_layer=3, n_embd=128, control=control))),
        "spm": (spm, str(tm.write_tiny_gguf(d / "bigbpe.gguf", seed=5, n_layer=3, n_embd=128, tokenizer="bpe"))),
        "letters": str(tm.write_tiny_gguf(d / "letters.gguf", seed=5, n_layer=1, n_embd=16, byte_tokens=False)),
    }


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def engine(pair, n_ctx: int = 512, **kw) -> Engine:
    draft, target = pair
    return Engine(target=target, draft=draft, n_ctx=n_ctx, n_threads=1, draft_policy="fixed", draft_max=4, **kw)


def check_follows(eng: Engine) -> None:
    """After a call, the draft's cache brought to the text holds the draft's own tokens of it, nothing else (of a
    text ending inside a character: of its longest whole prefix)."""
    a = eng.across
    assert a is not None
    text = eng.cached_tokens()
    a.start()
    while not a.sync(text):  # a text ending inside a character is followed up to it
        text = text[:-1]
        a.start()
    assert eng.draft is not None and eng.draft.tokens == a.follower.ids


@pytest.mark.parametrize("name", ["twin", "bpe", "spm"])
def test_greedy_sd_and_fsd_at_tau_0_emit_ars_ids(files, name):
    with engine(files[name]) as eng:
        a = eng.across
        assert a is not None and eng.n_vocab == eng.target.n_vocab
        ar = eng.generate(PROMPT, max_tokens=40, mode="ar", temperature=0)
        sd = eng.generate(PROMPT, max_tokens=40, mode="sd", temperature=0)
        check_follows(eng)
        fsd = eng.generate(PROMPT, max_tokens=40, mode="fsd", tau=0.0, temperature=0)
        assert sd.token_ids == ar.token_ids == fsd.token_ids
        assert sd.stats["drafted"] > 0 and fsd.stats["accepted_fuzzy"] == 0
        if name == "twin":  # the same weights and tokens: drafts are accepted and, with the noisy target, rejected
            assert 0.2 < sd.stats["acceptance_rate"] < 1.0 and sd.stats["target_calls"] < len(sd.token_ids)
        else:  # tokens the draft has no id for (byte-fallback twins, whole words) in the target's reply
            assert any(a.draft_token(t) < 0 for t in ar.token_ids)


def test_a_model_drafting_for_itself_through_the_map_accepts_every_greedy_token(files, cross_pair):
    """The twin is the tiny SentencePiece model but for its EOS id: the map's path, the same distributions."""
    with engine((files["twin"][0], cross_pair[0])) as eng:
        assert eng.across is not None
        out = eng.generate(PROMPT, max_tokens=40, mode="sd", temperature=0)
        assert out.stats["acceptance_rate"] == 1.0 and out.stats["accepted_sd"] == out.stats["drafted"] > 0


def test_the_reply_ends_at_the_targets_end_of_turn(files):
    with engine(files["twin"]) as eng:
        a = eng.across
        assert a is not None and eng.draft is not None
        # the draft's end of turn (its EOS, <|im_end|>) is carried to the target's own <|im_end|>
        im_end = eng.target.tokenize("<|im_end|>", add_special=False)
        assert len(im_end) == 1 and a.draft_token(im_end[0]) == eng.draft.eos
        ar = eng.generate(PROMPT, max_tokens=200, mode="ar", temperature=0, logit_bias={im_end[0]: 4.0})
        sd = eng.generate(PROMPT, max_tokens=200, mode="sd", temperature=0, logit_bias={im_end[0]: 4.0})
        assert sd.token_ids == ar.token_ids and sd.finish_reason == ar.finish_reason


def test_fsd_js_rescues_and_kl_rescues_nothing_off_the_shared_tokens(files):
    with engine(files["twin"]) as eng:
        js = eng.generate(PROMPT, max_tokens=40, mode="fsd", divergence="js", tau=0.6, temperature=0)
        kl = eng.generate(PROMPT, max_tokens=40, mode="fsd", divergence="kl", tau=50.0, temperature=0)
        sd = eng.generate(PROMPT, max_tokens=40, mode="sd", temperature=0)
    assert js.stats["accepted_fuzzy"] > 0
    # KL(p || q') is infinite (q' is 0 on the target's own tokens): no tau passes it, fsd is sd
    assert kl.stats["accepted_fuzzy"] == 0 and kl.token_ids == sd.token_ids


def test_sampled_sd_runs_on_the_targets_vocabulary(files):
    with engine(files["spm"]) as eng:
        out = eng.generate(PROMPT, max_tokens=40, mode="sd", temperature=0.9, seed=5, ignore_eos=True)
        assert len(out.token_ids) == 40 and all(0 <= t < eng.target.n_vocab for t in out.token_ids)
        check_follows(eng)


# prompts after which the target gives its own tokens at least 1% (bpe ~2%, spm ~3%)
@pytest.mark.parametrize(("name", "text"), [("bpe", "the cab and"), ("spm", "the cab and a cab, the")])
def test_sampled_sd_keeps_the_targets_two_token_distribution(files, name, text):
    """The first two tokens of sampled `sd` (drafted through the map, judged, the residual drawn where rejected,
    the draft following a proposed token as its own of the same bytes) against the target's own joint
    distribution (test_dense's machinery); the target's own tokens (q' = 0 there: the byte-fallback twins of its
    letters for `bpe`, whole words the draft spells in letters for `spm`) are reached only through the residual."""
    from test_dense import _first_two, _pvalue

    draft, target = files[name]
    n = 2000
    with engine((draft, target), n_ctx=128) as eng:
        a = eng.across
        assert a is not None
        prompt = eng.tokenize(text)
        v = eng.n_vocab
        counts = np.zeros((v, v), np.int64)
        for seed in range(n):
            out = eng.generate(prompt, max_tokens=4, mode="sd", temperature=1.0, seed=seed, ignore_eos=True)
            assert out.stats["drafted"] >= 1
            counts[out.token_ids[0], out.token_ids[1]] += 1
        own = np.array([a.draft_token(t) < 0 for t in range(v)])
    joint = _first_two(target, prompt, 1.0)
    assert _pvalue(counts.ravel(), joint.ravel()) > 1e-3
    # the test reaches the target's own tokens (at least 1% of the first token's mass: 20 draws expected)
    assert joint[own].sum() > 0.01 and counts[own].sum() > 0


def test_ar_ids_beyond_the_drafts_vocabulary_are_a_valid_next_prompt(files):
    """The target's vocabulary (293) is larger than the draft's (277): `ar` may emit any of its ids, and a next
    turn's prompt holding them is checked against the target's vocabulary."""
    with engine(files["bpe"]) as eng:
        assert eng.draft is not None and eng.target.n_vocab > eng.draft.n_vocab
        prompt = eng.tokenize(PROMPT)
        out = eng.generate(prompt, max_tokens=40, mode="ar", temperature=0)
        assert max(out.token_ids) >= eng.draft.n_vocab
        nxt = eng.generate(prompt + out.token_ids, max_tokens=8, mode="sd", temperature=0)
        assert nxt.finish_reason == "length"


def test_bad_pairs_are_refused_in_one_line(files):
    spm, bigbpe = files["spm"]
    bpe, _ = files["bpe"]
    with pytest.raises(ConfigError, match=r"is larger than target .* swap --draft and --target") as e:
        engine((bigbpe, spm))
    assert "\n" not in str(e.value)
    with pytest.raises(VocabularyMismatchError, match="no byte-fallback tokens") as v:
        engine((files["letters"], bpe))
    assert "\n" not in str(v.value)
    with engine(files["spm"]) as eng, pytest.raises(ConfigError, match="draft-only decodes the draft's own"):
        eng.generate(PROMPT, max_tokens=4, mode="draft-only")


def test_a_batch_runs_drafting_across_tokenizers_alone_and_ar_in_the_batch(files):
    """Engine(parallel=2) on a map pair: the batch cannot run a speculative call (the follower keeps one draft
    cache), so it runs alone between the batch's calls; both write the ids of a one-call engine."""
    kw = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    with engine(files["bpe"]) as eng:
        alone = {m: eng.generate("the cat sat", mode=m, **kw).token_ids for m in ("ar", "sd")}
    with engine(files["bpe"], n_ctx=1024, parallel=2) as eng:
        assert eng.batch is not None and eng.across is not None
        assert not eng.batch.takes(eng.defaults.with_(mode="sd")) and eng.batch.takes(eng.defaults.with_(mode="ar"))
        assert {m: eng.generate("the cat sat", mode=m, **kw).token_ids for m in ("ar", "sd")} == alone


def test_the_pairing_is_the_map(files):
    draft, target = files["spm"]
    d, t = (Model(ModelOptions(p, vocab_only=True), r) for p, r in ((draft, "draft"), (target, "target")))
    try:
        p = check_compatible(d, t)
        assert p.path == "map" and p.vocab_map is not None
    finally:
        d.close()
        t.close()


@pytest.mark.real
def test_smollm2_drafts_for_gemma_3(real_pair, gemma_path):
    with Engine(
        target=gemma_path, draft=real_pair[0], n_ctx=1024, n_threads=2, draft_policy="fixed", draft_max=4
    ) as eng:
        assert eng.across is not None and eng.n_vocab == 262144
        messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
        sd = eng.chat(messages, max_tokens=32, mode="sd", temperature=0)
        assert sd.stats["accepted_sd"] > 0 and sd.stats["target_calls"] < len(sd.token_ids)
        assert all(0 <= t < 262144 for t in sd.token_ids) and sd.text.strip()
        fsd = eng.chat(messages, max_tokens=32, mode="fsd", divergence="js", tau=0.3, temperature=0)
        assert len(fsd.token_ids) == 32 or fsd.finish_reason == "stop"
        check_follows(eng)


@pytest.mark.real
def test_greedy_sd_and_fsd_at_tau_0_emit_ars_ids_for_gemma_3_on_f16(real_pair_f16, gemma_f16):
    """SmolLM2-135M drafting for Gemma 3 270M through the map, both in F16 (token ids compare exactly there)."""
    with Engine(
        target=gemma_f16, draft=real_pair_f16[0], n_ctx=1024, n_threads=2, draft_policy="fixed", draft_max=4
    ) as eng:
        assert eng.across is not None
        drafted = 0
        for text in CHAT_PROMPTS:
            messages = [{"role": "user", "content": text}]
            ar = eng.chat(messages, max_tokens=32, mode="ar", temperature=0)
            sd = eng.chat(messages, max_tokens=32, mode="sd", temperature=0)
            fsd = eng.chat(messages, max_tokens=32, mode="fsd", tau=0.0, temperature=0)
            assert sd.token_ids == ar.token_ids == fsd.token_ids, text
            assert fsd.stats["accepted_fuzzy"] == 0
            drafted += sd.stats["accepted_sd"]
        assert drafted > 0


@pytest.mark.real
def test_smollm2_drafting_for_itself_through_the_map_accepts_every_greedy_token(real_pair_f16):
    """SmolLM2-135M (F16) for its own copy whose end of generation is another id: the pair takes the map, every
    piece shared and carried to itself, so each greedy draft is the target's token."""
    from gguf import GGUFReader

    from fsd_local.pairs.demo import upscale
    from fsd_local.paths import cache_dir

    draft = real_pair_f16[0]
    r = GGUFReader(draft)
    n_layer = int(r.fields["llama.block_count"].contents())
    eos = int(r.fields["tokenizer.ggml.eos_token_id"].contents())
    del r
    twin = cache_dir() / "f16" / f"smollm2-135m.F16.eos{eos + 1}.gguf"
    if not twin.exists():
        upscale(draft, twin, list(range(n_layer)), overrides={"tokenizer.ggml.eos_token_id": eos + 1})
    with Engine(target=str(twin), draft=draft, n_ctx=1024, n_threads=2, draft_policy="fixed", draft_max=4) as eng:
        assert eng.across is not None and eng.pairing.path == "map"
        for text in CHAT_PROMPTS:
            sd = eng.chat([{"role": "user", "content": text}], max_tokens=32, mode="sd", temperature=0)
            assert sd.stats["accepted_sd"] == sd.stats["drafted"] > 0, (text, sd.stats)
            assert sd.stats["target_calls"] < len(sd.token_ids)
