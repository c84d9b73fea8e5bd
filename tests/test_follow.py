"""A draft of another vocabulary follows the accepted text (drafting/follow.py): after every change its cache
holds its own tokens of exactly the text the target's tokens render to, reusing all but a short tail; on the
tiny models of two tokenizers and on SmolLM2 following Gemma 3."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fsd_local.drafting.follow import BACK, BACK_MAX, TextFollower
from fsd_local.llama.model import Model
from fsd_local.llama.options import ModelOptions

TEXT = (
    "the cab and a cab, the end. <|im_end|>\nthe ab and é! a € and the cab? the é, é and €€ then. "
    "abandon the band at dawn, and the bee. "
)


def load(path, n_ctx=2048, vocab_only=False, exact=False):
    """exact: F32 caches and no flash attention (whose CPU kernel rounds through F16 by batch shape)."""
    kv = "f32" if exact else "f16"
    opts = ModelOptions(path, n_ctx=n_ctx, n_threads=1, vocab_only=vocab_only, cache_type_k=kv, cache_type_v=kv)
    return Model(dataclasses.replace(opts, flash_attn=False) if exact else opts, "m")


@pytest.fixture(scope="module")
def models(cross_pair):
    spm, bpe = cross_pair
    loaded = {"spm": load(spm), "bpe": load(bpe)}
    yield loaded
    for m in loaded.values():
        m.close()


def rounds(seq, rng, start=8):
    """Prefixes of seq as rounds reach them: 1-5 tokens at a time, now and then one taken back (a rejection
    whose replacement differs is a text that shrinks, then grows again)."""
    i = start
    yield seq[:i], 0
    while i < len(seq):
        j = min(len(seq), i + int(rng.integers(1, 6)))
        if rng.random() < 0.2 and j - i > 1:
            yield seq[: j - 1], i - 1
            yield seq[:j], j - 2
        else:
            yield seq[:j], i - 1
        i = j


def check_follows(f: TextFollower, seq) -> None:
    d = f.draft
    assert d.tokens == f.ids
    text = b"".join(f._render_target(t, i) for i, t in enumerate(seq))
    assert bytes(f.text) == f.lead + text
    assert f._render(f.ids[len(f.head) :]) == f.lead + text


@pytest.mark.parametrize(("draft", "target"), [("bpe", "spm"), ("spm", "bpe")])
def test_the_draft_follows_the_text_round_by_round(models, draft, target):
    d, t = models[draft], models[target]
    d.clear()
    f = TextFollower(d, t)
    seq = t.tokenize(TEXT)
    rng = np.random.default_rng(len(draft))
    decoded = []
    for prefix, start in rounds(seq, rng):
        n_before = len(d.tokens)
        if f.sync(prefix, start):
            check_follows(f, prefix)
            decoded.append(len(d.tokens) - min(n_before, len(d.tokens)))
        else:  # only a text ending inside a character is not followed
            text = b"".join(f._render_target(x, i) for i, x in enumerate(prefix))
            with pytest.raises(UnicodeDecodeError):
                text.decode("utf-8")
    # a space-prefix reader starts every tail at a space: here twice more than BACK_MAX tokens back, before
    # "<|im_end|>\n", which it reads as a dozen plain-text tokens
    assert f.misaligned == 0 and f.far_back <= (2 if f.lead else 0)
    # the text as a whole, tokenised by the draft, is what it followed round by round
    assert f.ids[len(f.head) :] == f._tokenize(bytes(f.text)[len(f.lead) :] if f.lead else bytes(f.text))
    # never the whole context: each round decodes its new text and a short tail
    assert max(decoded[1:]) <= 5 + BACK + BACK_MAX


def test_the_draft_reads_each_text_as_its_own_tokenizer_would(models):
    """SentencePiece with add_space_prefix reads ' ' + text, special tokens' text as plain text; byte-level BPE
    parses its own control tokens."""
    spm, bpe = models["spm"], models["bpe"]
    spm.clear()
    bpe.clear()
    f = TextFollower(spm, bpe)
    assert f.lead == b" " and f.head == [spm.bos]
    assert f.sync(bpe.tokenize("<|im_start|>user\nthe cab<|im_end|>\n"))
    assert spm.tokens[0] == spm.bos and 292 not in spm.tokens  # no special token parsed
    g = TextFollower(bpe, spm)
    assert g.lead == b"" and g.head == []
    assert g.sync(spm.tokenize("the cab<|im_end|>"))
    im_end = bpe.tokenize("<|im_end|>", add_special=False)
    assert len(im_end) == 1 and bpe.tokens[-1] == im_end[0]


def test_a_character_split_over_tokens_waits_until_it_is_whole(models):
    spm, bpe = models["spm"], models["bpe"]
    spm.clear()
    f = TextFollower(spm, bpe)
    seq = bpe.tokenize("a €")
    assert [bpe.piece(x) for x in seq[-3:]] == [b"\xe2", b"\x82", b"\xac"]  # three byte tokens of the target
    assert f.sync(seq[:-3])
    assert not f.sync(seq[:-2], len(seq) - 4) and not f.sync(seq[:-1], len(seq) - 3)
    assert f.sync(seq, len(seq) - 2)
    assert spm.piece(spm.tokens[-1]) == "€".encode()  # the draft's own token of the whole character
    check_follows(f, seq)


def test_the_cache_is_the_one_a_fresh_context_computes(models, cross_pair):
    """The KV invariant: after any sequence of syncs the draft's next row equals a fresh context's over the same
    tokens (F32 weights and caches: only the batch shapes differ)."""
    d, fresh = load(cross_pair[1], exact=True), load(cross_pair[1], exact=True)
    try:
        f = TextFollower(d, models["spm"])
        seq = models["spm"].tokenize(TEXT)
        for prefix, start in rounds(seq, np.random.default_rng(9)):
            f.sync(prefix, start)
        fresh.decode(list(d.tokens), "last")
        np.testing.assert_allclose(d.logits(1)[0], fresh.logits(1)[0], atol=1e-5)
    finally:
        d.close()
        fresh.close()


def test_a_new_text_shares_only_its_common_prefix(models):
    d, t = models["bpe"], models["spm"]
    d.clear()
    f = TextFollower(d, t)
    assert f.sync(t.tokenize("the cab and the band"))
    kept = list(d.tokens)
    assert f.sync(t.tokenize("the cab and a dawn"))
    check_follows(f, t.tokenize("the cab and a dawn"))
    assert d.tokens[:3] == kept[:3]


@pytest.mark.real
@pytest.mark.parametrize("reverse", [False, True])
def test_smollm2_and_gemma_follow_each_other(real_pair, gemma_path, reverse):
    from fsd_local.llama.vocab_table import PROBE_TEXT

    paths = (gemma_path, real_pair[0]) if reverse else (real_pair[0], gemma_path)
    d, t = load(paths[0], n_ctx=4096), load(paths[1], vocab_only=True)
    try:
        f = TextFollower(d, t)
        seq = t.tokenize(PROBE_TEXT + "emoji 😀 done 🎉!")
        steps = 0
        for prefix, start in rounds(seq, np.random.default_rng(1), start=40):
            steps += 1
            if f.sync(prefix, start):
                check_follows(f, prefix)
        assert f.misaligned == 0 and f.far_back == 0 and f.sync(seq, len(seq) - 1)
        assert f.ids[len(f.head) :] == f._tokenize(bytes(f.text))
    finally:
        d.close()
        t.close()


@pytest.mark.real
def test_a_byte_the_draft_has_no_token_for(real_pair, gemma_path):
    """SmolLM2's byte-level vocabulary has no token for 0x04 (llama.cpp leaves such a byte out); Gemma writes it
    with a byte-fallback token. The draft reads the text without it and goes on following exactly after it."""
    d, t = load(real_pair[0]), load(gemma_path, vocab_only=True)
    try:
        f = TextFollower(d, t)
        seq = t.tokenize("The code \x04 is sent, then the reply comes back and the line closes.")
        for prefix, start in rounds(seq, np.random.default_rng(2), start=3):
            assert f.sync(prefix, start)
        assert f.misaligned >= 1 and f.far_back == 0
        assert f._render(f.ids) == bytes(f.text).replace(b"\x04", b"")
        assert f.exact[-1] and f.id_ends[-1] == len(f.text) and d.tokens == f.ids
    finally:
        d.close()
        t.close()


def test_a_word_the_target_writes_in_letters_is_one_token_of_the_draft(models):
    """The SentencePiece target writes ' the' as four tokens; the BPE draft reads the tail again as the text
    grows ('t', then 'th', then 'the', by its merges) and ends with its own two tokens, ' ' and 'the'."""
    d, t = models["bpe"], models["spm"]
    d.clear()
    f = TextFollower(d, t)
    seq = t.tokenize("a cab and the")
    assert [t.piece(x) for x in seq[-4:]] == [b" ", b"t", b"h", b"e"]
    assert f.sync(seq[:-4])
    n = len(d.tokens)
    for i in range(len(seq) - 3, len(seq) + 1):
        assert f.sync(seq[:i], i - 2)
        check_follows(f, seq[:i])
    assert [d.piece(x) for x in d.tokens[n:]] == [b" ", b"the"]
