"""Several sequences in one context (llama/seq_batch.py, llama/kv_cache.py) on tiny F32 and F16 models: a
sequence's logits in a mixed batch are its logits decoded alone, truncating or emptying one sequence leaves the
others as they were, every mirror matches its cache, and bad batches are refused in words."""

from __future__ import annotations

import numpy as np
import pytest

from fsd_local.errors import ContextOverflowError, ModelLoadError
from fsd_local.llama.bindings import lc
from fsd_local.llama.model import Model, ModelOptions
from fsd_local.llama.seq_batch import SeqBatch
from support.tinymodels import write_tiny_gguf

# A sequence alone replays exactly its own decodes in a one-sequence context: the only difference is which other
# sequences share the batch and, unified, where its cells lie among theirs. That still moves the logits a little
# (measured here, default KV type and flash attention: <= 4e-3 on F32 weights, <= 6.4e-3 on F16, at logits ~12;
# flash attention off with an F32 cache: <= 3.4e-6): the engine's tolerance for other batch shapes
# (tests/test_engine.py KV_ATOL), which one stale cache entry exceeds; a row of another sequence is off by ~1-10
ATOL = 2e-2
WORD = 259  # the first word token of the tiny vocabulary; 33 words follow it


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("seqs")
    return {
        "f32": str(write_tiny_gguf(d / "f32.gguf", seed=2, noise=0.1)),
        "f16": str(write_tiny_gguf(d / "f16.gguf", seed=2, noise=0.1, dtype=np.float16, n_embd=128, n_ff=256)),
    }


def _model(path, n_seq=1, unified=True, n_ctx=512, n_batch=64):
    opts = ModelOptions(path, n_ctx=n_ctx, n_batch=n_batch, n_threads=1, n_seq=n_seq, kv_unified=unified)
    return Model(opts, "target")


def _words(rng, n):
    return [int(t) for t in rng.integers(WORD, WORD + 33, size=n)]


def _in_sync(m: Model) -> None:
    """Every sequence's cache holds exactly the positions its mirror lists."""
    assert m.tokens is m.seqs[0]
    for s, toks in enumerate(m.seqs):
        assert lc.llama_memory_seq_pos_max(m.mem, s) == len(toks) - 1, s


# (tokens added, logits) per sequence and step; None: the sequence sits the step out. Step 0 prefills prompts of
# different lengths; then verify-like runs (rows on every token), plain steps, a prefill chunk with no rows.
SCRIPT = [
    [(9, "last"), (5, "from:0"), (13, "last"), (3, "last")],
    [(5, "from:0"), (1, "last"), None, (7, "none")],
    [(1, "last"), (3, "from:0"), (6, "from:2"), (1, "last")],
    [None, (1, "last"), (2, "from:0"), (5, "from:0")],
    [(4, "from:0"), (4, "from:0"), (1, "last"), (1, "last")],
]


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "per-slot"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_a_sequence_in_a_mixed_batch_gets_its_logits_alone(tiny, dtype, unified):
    """Runs of different lengths from four sequences in one decode (a per-slot cache splits such a batch by
    sequence and computes its rows out of batch order), with rewinds between steps as rejections make them."""
    rng = np.random.default_rng(0)
    multi = _model(tiny[dtype], n_seq=4, unified=unified)
    alone = [_model(tiny[dtype]) for _ in range(4)]
    batch = SeqBatch(multi)
    try:
        for step, runs in enumerate(SCRIPT):
            todo = [(s, _words(rng, run[0]), run[1]) for s, run in enumerate(runs) if run]
            for s, toks, logits in todo:
                batch.add(s, toks, logits)
            batch.decode()
            for s, toks, logits in todo:
                alone[s].decode(toks, logits)
                assert multi.seqs[s] == alone[s].tokens
                if logits == "none":
                    assert batch.row_range(s)[1] == 0
                    continue
                want = alone[s].logits()
                got = batch.rows(s)
                assert got.shape == want.shape
                np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=f"step {step} seq {s}")
                assert (got.argmax(1) == want.argmax(1)).all()  # greedy picks the same tokens
            for s in range(1, 4):  # rejections: each sequence but 0 drops its last token or two
                cut = len(multi.seqs[s]) - (s + step) % 3
                multi.truncate(cut, s)
                alone[s].truncate(cut)
            _in_sync(multi)
    finally:
        for m in (multi, *alone):
            m.close()


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "per-slot"])
def test_greedy_tokens_of_four_sequences_batched_equal_each_alone_f16(tiny, unified):
    """Four greedy continuations decoded together, each step one batch of every sequence's last token."""
    rng = np.random.default_rng(1)
    prompts = [[1, *_words(rng, n)] for n in (4, 11, 7, 2)]

    def greedy(m: Model, prompt, steps=12):
        m.clear()
        m.decode(prompt)
        out = []
        for _ in range(steps):
            out.append(int(m.logits(1)[0].argmax()))
            m.decode([out[-1]])
        return out

    single = _model(tiny["f16"])
    try:
        expected = [greedy(single, p) for p in prompts]
    finally:
        single.close()
    m = _model(tiny["f16"], n_seq=4, unified=unified)
    batch = SeqBatch(m)
    try:
        for s, p in enumerate(prompts):
            batch.add(s, p)
        batch.decode()
        got: list[list[int]] = [[] for _ in prompts]
        for _ in range(12):
            for s in range(4):
                got[s].append(int(batch.rows(s)[0].argmax()))
            for s in range(4):
                batch.add(s, [got[s][-1]])
            batch.decode()
        assert got == expected
        _in_sync(m)
    finally:
        m.close()


def _fresh_next_logits(path, tokens):
    """The logits after `tokens` from a fresh context that evaluates them from scratch."""
    m = _model(path)
    try:
        m.decode(tokens)
        return m.logits(1)[0].copy()
    finally:
        m.close()


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "per-slot"])
def test_rewinding_or_emptying_one_sequence_leaves_the_others_intact(tiny, unified):
    path = tiny["f32"]
    rng = np.random.default_rng(2)
    m = _model(path, n_seq=3, unified=unified)
    batch = SeqBatch(m)
    try:
        texts = [[1, *_words(rng, n)] for n in (12, 15, 9)]
        for s, t in enumerate(texts):
            batch.add(s, t, "none")
        batch.decode()
        m.truncate(6, 1)
        assert m.seqs[1] == texts[1][:6] and m.seqs[0] == texts[0] and m.seqs[2] == texts[2]
        # sequence 2 keeps its common prefix with a new text; sequence 0 is emptied for a new conversation
        other = texts[2][:5] + _words(rng, 4)
        assert m.keep_common_prefix(other, seq_id=2) == 5 + (other[5] == texts[2][5])
        m.drop(0)
        assert m.seqs[0] == [] and m.tokens == []
        _in_sync(m)
        nxt = {0: [1, *_words(rng, 3)], 1: _words(rng, 1), 2: other[len(m.seqs[2]) :]}
        for s, t in nxt.items():
            batch.add(s, t)
        batch.decode()
        for s, t in nxt.items():
            assert m.seqs[s][-len(t) :] == t
            want = _fresh_next_logits(path, m.seqs[s])
            np.testing.assert_allclose(batch.rows(s)[-1], want, rtol=0, atol=ATOL, err_msg=f"seq {s}")
        _in_sync(m)
    finally:
        m.close()


def test_sequence_zero_is_what_single_sequence_callers_use(tiny):
    """Model.decode, logits, truncate and keep_common_prefix work on sequence 0 of a context of several, beside
    another sequence's decodes, exactly as in a context of one."""
    path = tiny["f32"]
    m, single = _model(path, n_seq=2), _model(path)
    batch = SeqBatch(m)
    try:
        for model in (m, single):
            model.decode([1, 260, 261, 262, 263], "from:0")
        np.testing.assert_allclose(m.logits(), single.logits(), rtol=0, atol=ATOL)
        batch.add(1, [1, 270, 271, 272, 273, 274, 275, 276], "from:0")  # more rows than the last decode output
        batch.decode()
        for model in (m, single):
            model.truncate(3)
            model.decode([264, 265])
        assert m.tokens == single.tokens == [1, 260, 261, 264, 265]
        np.testing.assert_allclose(m.logits(1), single.logits(1), rtol=0, atol=ATOL)
        assert m.keep_common_prefix([1, 260, 270, 271]) == 2 and m.tokens == [1, 260]
        assert m.seqs[1] == [1, 270, 271, 272, 273, 274, 275, 276]
        _in_sync(m)
    finally:
        m.close()
        single.close()


def test_cache_sizes_per_slot_and_unified(tiny):
    per_slot = _model(tiny["f32"], n_seq=4, unified=False, n_ctx=1024)
    unified = _model(tiny["f32"], n_seq=4, unified=True, n_ctx=1024)
    try:
        assert (per_slot.n_seq, per_slot.n_ctx, per_slot.n_cells) == (4, 256, 1024)  # a quarter each
        assert (unified.n_seq, unified.n_ctx, unified.n_cells) == (4, 1024, 1024)  # all of it, shared
    finally:
        per_slot.close()
        unified.close()


def test_full_caches_are_refused_in_words_and_change_nothing(tiny):
    per_slot = _model(tiny["f32"], n_seq=2, unified=False, n_ctx=512, n_batch=512)
    try:
        batch = SeqBatch(per_slot)
        batch.add(0, [WORD] * 200, "none")
        with pytest.raises(ContextOverflowError, match=r"sequence 1 of the target context is full \(256 tokens\)"):
            batch.add(1, [WORD] * 257, "none")
        batch.decode()  # what was added before the refusal
        assert len(per_slot.seqs[0]) == 200 and per_slot.seqs[1] == []
        _in_sync(per_slot)
    finally:
        per_slot.close()
    unified = _model(tiny["f32"], n_seq=2, unified=True, n_ctx=256, n_batch=256)
    try:
        batch = SeqBatch(unified)
        batch.add(0, [WORD] * 150, "none")
        batch.decode()
        batch.add(0, [WORD] * 50, "none")
        with pytest.raises(ContextOverflowError, match=r"256 tokens shared by 2 sequences"):
            batch.add(1, [WORD] * 57, "none")  # fits its sequence, not the cells the cache and the batch leave
        batch.add(1, [WORD] * 56, "none")
        batch.decode()
        with pytest.raises(ContextOverflowError, match="shared by 2 sequences"):
            unified.decode([WORD])  # sequence 0's own path counts the other sequence's cells too
        assert [len(t) for t in unified.seqs] == [200, 56]
        _in_sync(unified)
    finally:
        unified.close()


def test_bad_batches_are_refused_in_words(tiny):
    m = _model(tiny["f32"], n_seq=2, n_batch=16)
    batch = SeqBatch(m)
    try:
        with pytest.raises(ValueError, match=r"sequence 2 asked; its context holds sequences 0\.\.1"):
            batch.add(2, [WORD])
        batch.add(0, [WORD, WORD + 1])
        with pytest.raises(ValueError, match="sequence 0 already has tokens in this batch"):
            batch.add(0, [WORD])
        with pytest.raises(ValueError, match="17 batch entries; a decode takes at most 16"):
            batch.add(1, [WORD] * 15)
        with pytest.raises(ValueError, match="logits must be 'last', 'none' or 'from:J'"):
            batch.add(1, [WORD], "from:3")
        batch.decode()
        with pytest.raises(ValueError, match="sequence 1 had no tokens in the last batch decode"):
            batch.rows(1)
        batch.add(1, [WORD], "none")
        batch.decode()
        with pytest.raises(ValueError, match="sequence 1 asked no logit rows"):
            batch.rows(1)
    finally:
        m.close()
    with pytest.raises(ModelLoadError, match="0 sequences asked; a context holds 1 to 256"):
        _model(tiny["f32"], n_seq=0)


def test_a_failed_batch_decode_leaves_every_mirror_matching_its_cache(tiny):
    m = _model(tiny["f32"], n_seq=3)
    batch = SeqBatch(m)
    try:
        batch.add(0, [1, 260, 261])
        batch.add(2, [1, 262])
        batch.decode()
        batch.add(0, [263])
        batch.add(1, [1, 264])
        batch.add(2, [m.n_vocab + 5])  # not a token of this vocabulary: llama.cpp refuses the whole batch
        with pytest.raises(RuntimeError, match="llama_decode failed for the target model"):
            batch.decode()
        assert m.seqs == [[1, 260, 261], [], [1, 262]]
        _in_sync(m)
        batch.add(1, [1, 264])  # the batch is empty again and the context usable
        batch.decode()
        assert batch.rows(1).shape == (1, m.n_vocab)
    finally:
        m.close()
