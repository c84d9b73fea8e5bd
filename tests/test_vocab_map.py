"""The vocabulary map between two GGUF models (llama/vocab_table.py, llama/vocab_map.py): tiny models of two
tokenizers (SentencePiece with byte fallback, byte-level BPE), the real SmolLM2 -> Gemma 3 pair, and the cache."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fsd_local.llama import vocab_map as vm
from fsd_local.llama.model import Model
from fsd_local.llama.options import ModelOptions
from fsd_local.llama.vocab_table import BYTE, CONTROL, NORMAL, table_of
from support.reference_vocab import reference_target_of
from support.tinymodels import WORDS


def token(table, text: bytes, kind: int | None = None) -> int:
    """The id of the token of `table` rendering `text` (of `kind`, where given)."""
    ids = [i for i in range(table.n_vocab) if table.piece(i) == text and (kind is None or table.kind[i] == kind)]
    assert ids, text
    return ids[0]


def special(table, text: bytes) -> int:
    return int(table.special_ids[table.special_text.index(text)])


@pytest.fixture(scope="module")
def tables(cross_pair):
    spm, bpe = cross_pair
    return table_of(spm), table_of(bpe)


def test_tables_hold_llama_cpps_pieces(cross_pair, tables):
    for path, table in zip(cross_pair, tables):
        m = Model(ModelOptions(path, vocab_only=True), "t")
        try:
            assert table.n_vocab == m.n_vocab
            assert all(table.piece(i) == m.piece(i) for i in range(m.n_vocab))
            assert table.bos == m.bos and table.eos == m.eos and table.add_bos == m.add_bos
        finally:
            m.close()
    spm, bpe = tables
    assert spm.kind[token(spm, b"\x00")] == BYTE and bpe.kind[token(bpe, b"\x00")] == NORMAL
    assert spm.tokenizer == "llama" and bpe.tokenizer == "gpt2"
    assert bpe.end == special(bpe, b"<|im_end|>")  # the chat template's end of an assistant's turn
    # no template: the end of turn, which llama.cpp finds by its text (<|im_end|>), not the end of sequence
    assert spm.end == spm.eot == special(spm, b"<|im_end|>") != spm.eos


def test_spm_draft_for_a_bpe_target(tables):
    spm, bpe = tables
    m = vm.build_map(spm, bpe)
    carried = {spm.piece(d): bpe.piece(int(t)) for d, t in enumerate(m.target_of) if t >= 0 and spm.piece(d)}
    assert all(a == b for a, b in carried.items())  # the same bytes, always
    assert m.target_of[token(spm, b"a")] == token(bpe, b"a")
    assert m.target_of[token(spm, b" ")] == token(bpe, b" ")  # SentencePiece's space marker is a space
    assert m.target_of[token(spm, "é".encode())] == token(bpe, "é".encode())  # a whole word of both
    assert m.target_of[token(spm, "€".encode())] == -1  # the BPE target writes it in three byte tokens
    # byte fallback: each byte token of the draft goes to the target's token of that byte, the zero byte too
    for b in (0x00, 0x41, 0xE2, 0xFF):
        assert m.target_of[token(spm, bytes([b]), BYTE)] == token(bpe, bytes([b]))
    # control tokens by their text, ends of generation to the token ending the target's reply
    assert m.target_of[special(spm, b"<|im_end|>")] == special(bpe, b"<|im_end|>")
    assert m.target_of[spm.eos] == bpe.end
    assert m.target_of[spm.bos] == -1 and m.target_of[0] == -1  # <s>, <unk>: nothing to carry
    # target-only: the whole-word merges of the BPE target
    for word in (b"the", b" and", b"ab"):
        assert m.draft_of[token(bpe, word)] == -1
    assert m.draft_of[bpe.end] in (spm.eos, special(spm, b"<|im_end|>"))
    # several draft tokens to one target token: both ends of generation, and a letter with its byte-fallback twin
    # (the BPE target has one token per byte), the letter read first
    extra = m.extra.tolist()
    assert [bpe.end, max(spm.eos, special(spm, b"<|im_end|>"))] in extra
    for t, d in extra:
        if t != bpe.end:
            assert (
                spm.kind[d] == BYTE and spm.kind[m.draft_of[t]] == NORMAL and spm.piece(m.draft_of[t]) == spm.piece(d)
            )
    assert len(extra) == 1 + sum(1 for w in WORDS if len(w.replace("▁", " ").encode()) == 1)


def test_bpe_draft_for_an_spm_target(tables):
    spm, bpe = tables
    m = vm.build_map(bpe, spm)
    for word in (b"the", b" and", b"ab"):  # a split the target makes differently: the draft's words are its own
        assert m.target_of[token(bpe, word)] == -1
    assert m.target_of[token(bpe, b"t")] == token(spm, b"t", NORMAL)
    # a byte the SentencePiece target has only as a byte-fallback token goes to that token
    assert m.target_of[token(bpe, b"\xe2")] == token(spm, b"\xe2", BYTE)
    assert m.target_of[token(bpe, b"\x00")] == token(spm, b"\x00", BYTE)
    assert m.target_of[special(bpe, b"<|im_end|>")] == special(spm, b"<|im_end|>")
    assert m.target_of[special(bpe, b"<|endoftext|>")] == spm.end  # an end of generation without a twin
    assert m.target_of[special(bpe, b"<|im_start|>")] == -1


def test_the_map_is_its_reference_on_the_tiny_pair(tables):
    spm, bpe = tables
    for d, t in ((spm, bpe), (bpe, spm), (spm, spm)):
        m = vm.build_map(d, t)
        ref = reference_target_of(d, t)
        by_bytes = {i: int(x) for i, x in enumerate(m.target_of) if x >= 0 and d.kind[i] != CONTROL}
        assert by_bytes == ref


def test_a_model_maps_to_itself(tables):
    for t in tables:
        m = vm.build_map(t, t)
        assert m.identity and m.extra.shape == (0, 2)
        assert m.share_of_draft == m.share_of_target == 1.0 and m.probe_share == 1.0


@pytest.mark.real
def test_the_real_pair(real_pair, gemma_path):
    smol, gemma = table_of(real_pair[0]), table_of(gemma_path)
    m = vm.build_map(smol, gemma)
    # measured by comparing every token's bytes (docs/shared facts): 46,145 shared pieces
    assert (m.shared_pieces, m.draft_pieces, m.target_pieces) == (46145, 49135, 255784)
    assert m.probe_share > 0.9
    for d, t in ((smol, gemma), (gemma, smol)):
        got = vm.build_map(d, t)
        by_bytes = {i: int(x) for i, x in enumerate(got.target_of) if x >= 0 and d.kind[i] != CONTROL}
        assert by_bytes == reference_target_of(d, t)
    # SmolLM2's ends of generation (<|im_end|> ends its turns) go to Gemma's end: no chat template in this
    # file, so its end of turn, <end_of_turn>
    assert gemma.piece(gemma.end) == b"" and gemma.special_text[list(gemma.special_ids).index(gemma.end)] == (
        b"<end_of_turn>"
    )
    assert {int(m.target_of[e]) for e in smol.eog} == {gemma.end}
    back = vm.build_map(gemma, smol)
    assert smol.end == smol.eos and {int(back.target_of[e]) for e in gemma.eog} == {smol.end}
    assert vm.build_map(gemma, gemma).identity


def test_the_map_is_kept_on_disk_per_pair_of_files(cross_pair, monkeypatch):
    spm, bpe = cross_pair
    first = vm.map_between(spm, bpe)
    monkeypatch.setattr(vm, "build_map", lambda *a: pytest.fail("built again for unchanged files"))
    again = vm.map_between(spm, bpe)
    for name in ("target_of", "draft_of", "extra"):
        assert np.array_equal(getattr(first, name), getattr(again, name))
    assert again.to_dict() == first.to_dict()
    monkeypatch.undo()
    st = os.stat(bpe)
    os.utime(bpe, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the file changed: built again
    built = []
    real_build = vm.build_map
    monkeypatch.setattr(vm, "build_map", lambda *a: built.append(1) or real_build(*a))
    vm.map_between(spm, bpe)
    assert built == [1]
