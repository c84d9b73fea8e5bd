"""The text path across tokenizers (drafting/text_draft.py): the draft writes text in its own tokens, the target's
tokens of it are proposed one-hot and judged exactly. Greedy `sd` emits `ar`'s ids on tiny F32 pairs of two
tokenizers both ways; sampled `sd` keeps the target's distribution; the pairing takes the text path where the map
carries too little, and refuses in one line what cannot be aligned; SmolLM2 drafts text for Gemma 3."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats as sps

import support.tinymodels as tm
from fsd_local import ConfigError, Engine, VocabularyMismatchError
from fsd_local.drafting.text_draft import TextDraft
from fsd_local.llama.model import Model
from fsd_local.llama.options import ModelOptions
from fsd_local.llama.vocab import MIN_PROBE_SHARE, choose_path, pairing
from fsd_local.llama.vocab_map import map_between
from fsd_local.llama.vocab_table import table_of

PROMPT = "the cab and a cab, the end. the ab and é! a € and ü ß the band"


@pytest.fixture(scope="module")
def files(tmp_path_factory, cross_pair):
    """`twin`: the tiny SentencePiece draft for a noisy target of its weights that ends a turn with another id
    (drafts accepted and rejected); `bpe`: the byte-level BPE draft for a larger SentencePiece target (which writes
    bytes in byte-fallback tokens); `spm`: the SentencePiece draft for a larger BPE target (whole words the draft
    spells in letters); `letters`: SentencePiece without byte fallback, which cannot tokenise the other's text."""
    d = tmp_path_factory.mktemp("text_path")
    spm, bpe = cross_pair
    mp = pytest.MonkeyPatch()
    original = tm.add_tokenizer
    mp.setattr(
        tm,
        "add_tokenizer",
        lambda w, tokens, scores, types: original(w, tokens, scores, types, eos=tokens.index("<|im_end|>")),
    )
    noisy = str(tm.write_tiny_gguf(d / "noisy.gguf", seed=2, noise=0.1, control=("<|im_end|>",)))
    mp.undo()
    return {
        "twin": (spm, noisy),
        "bpe": (bpe, str(tm.write_tiny_gguf(d / "big.gguf", seed=4, n_layer=3, n_embd=128, control=("<|im_end|>",)))),
        "spm": (spm, str(tm.write_tiny_gguf(d / "bigbpe.gguf", seed=5, n_layer=3, n_embd=128, tokenizer="bpe"))),
        "letters": str(tm.write_tiny_gguf(d / "letters.gguf", seed=5, n_layer=1, n_embd=16, byte_tokens=False)),
    }


def engine(pair, n_ctx: int = 512, **kw) -> Engine:
    draft, target = pair
    kw = {"draft_policy": "fixed", "draft_max": 4, **kw}
    return Engine(target=target, draft=draft, n_ctx=n_ctx, n_threads=1, across="text", **kw)


@pytest.mark.parametrize("name", ["twin", "bpe", "spm"])
def test_greedy_sd_on_the_text_path_emits_ars_ids(files, name):
    with engine(files[name]) as eng:
        assert isinstance(eng.across, TextDraft) and eng.n_vocab == eng.target.n_vocab
        ar = eng.generate(PROMPT, max_tokens=40, mode="ar", temperature=0)
        sd = eng.generate(PROMPT, max_tokens=40, mode="sd", temperature=0)
        fsd = eng.generate(PROMPT, max_tokens=40, mode="fsd", tau=0.0, temperature=0)
        assert sd.token_ids == ar.token_ids == fsd.token_ids
        assert sd.stats["drafted"] > 0
        if name == "twin":  # the draft's weights: its text is mostly the target's, not always
            assert 0.2 < sd.stats["acceptance_rate"] < 1.0 and sd.stats["target_calls"] < len(sd.token_ids)
        # a second call on the same text reuses the draft's cache, and still follows it exactly
        again = eng.generate(PROMPT, max_tokens=40, mode="sd", temperature=0)
        assert again.token_ids == ar.token_ids


def test_the_text_path_proposes_the_targets_tokens_of_the_drafts_text(files):
    """Words the target has whole ("the", " and") come out as its own tokens of the text the draft spelled in
    letters; a text whose last character is incomplete is proposed up to it."""
    with engine(files["spm"]) as eng:
        a = eng.across
        assert isinstance(a, TextDraft)
        seq = eng.tokenize("a cab", add_special=False)
        ids = a.target_tokens(seq, b" the band")
        assert a.spells(ids, b" the band") and len(ids) < len(b" the band")
        assert eng.target.detokenize(ids) == " the band"
        cut = a.target_tokens(seq, " é".encode()[:-1] + b"")
        assert a.spells(cut, b" ")


def test_sampled_sd_on_the_text_path_keeps_the_targets_distribution(files):
    """The first token of sampled `sd` against the target's own softmax: a one-hot proposal judged by the SD test
    and the residual draw emits p whatever was proposed."""
    draft, target = files["bpe"]
    m = Model(ModelOptions(target, n_ctx=128, n_threads=1), "target")
    try:
        prompt = m.tokenize("the cab and")
        m.decode(prompt, "last")
        row = m.logits(1)[0].astype(np.float64)
    finally:
        m.close()
    p = np.exp(row - row.max())
    p /= p.sum()
    n = 1200
    counts = np.zeros(p.shape[0], np.int64)
    drafted = 0
    with engine((draft, target), n_ctx=128) as eng:
        for seed in range(n):
            out = eng.generate(prompt, max_tokens=3, mode="sd", temperature=1.0, seed=seed, ignore_eos=True)
            drafted += out.stats["drafted"] > 0
            counts[out.token_ids[0]] += 1
    assert drafted > n // 2
    expected = p * n
    big = expected >= 5
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    assert sps.chisquare(obs, exp).pvalue > 1e-3


def test_the_pairing_takes_the_text_path_where_the_map_carries_too_little(files):
    draft, target = files["bpe"]
    vm = map_between(draft, target)
    dt, tt = table_of(draft), table_of(target)
    assert choose_path(vm, dt, tt) == ("map", None)
    assert choose_path(vm, dt, tt, "text") == ("text", None)
    low = type(vm)(**{**vm.__dict__, "probe_share": MIN_PROBE_SHARE / 2})
    assert choose_path(low, dt, tt) == ("text", None)
    # a target that cannot tokenise every byte: refused, the share and the reason in one sentence
    path, why = choose_path(low, dt, table_of(files["letters"]))
    assert path == "refused" and why is not None and "25% of the draft's tokens" in why
    assert "cannot tokenise the draft's text" in why and "\n" not in why


def test_texts_that_cannot_be_aligned_are_refused_in_one_line(files):
    """A draft without byte fallback cannot read the target's text on either path; an unknown path is named."""
    bpe, _ = files["bpe"]
    with pytest.raises(ConfigError, match=r"across must be one of auto, map, text .* not 'words'"):
        Engine(target=bpe, draft=files["letters"], n_ctx=128, n_threads=1, across="words")
    with pytest.raises(VocabularyMismatchError, match="no byte-fallback tokens") as e:
        Engine(target=bpe, draft=files["letters"], n_ctx=128, n_threads=1, across="text")
    assert "\n" not in str(e.value) and "fsd-local models --local" in str(e.value)


def test_doctor_pairing_names_the_text_path(files):
    draft, target = files["spm"]
    d, t = (Model(ModelOptions(p, vocab_only=True), r) for p, r in ((draft, "draft"), (target, "target")))
    try:
        p = pairing(d, t, "text")
        assert p.path == "text" and p.describe().startswith("the text path")
        assert pairing(d, t).path == "map"
    finally:
        d.close()
        t.close()


@pytest.mark.real
def test_smollm2_drafts_text_for_gemma_3(real_pair, gemma_path):
    with Engine(
        target=gemma_path, draft=real_pair[0], n_ctx=1024, n_threads=2, draft_policy="fixed", draft_max=4, across="text"
    ) as eng:
        assert isinstance(eng.across, TextDraft)
        messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
        sd = eng.chat(messages, max_tokens=32, mode="sd", temperature=0)
        assert sd.stats["accepted_sd"] > 0 and sd.stats["target_calls"] < len(sd.token_ids)
        assert all(0 <= t < 262144 for t in sd.token_ids) and sd.text.strip()
