"""Which path a pair of different tokenizers takes (llama/vocab.py `pairing`), as `doctor`, `models --local` and
loading the pair say it: the tiny SentencePiece and BPE models, a vocabulary that cannot give its text back, and
SmolLM2 with Gemma 3."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fsd_local import Engine, ModelLoadError, VocabularyMismatchError
from fsd_local.cli import cli
from fsd_local.llama.doctor import compatibility
from support.localstores import hub_file, isolate, ollama_model
from support.tinymodels import write_tiny_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory, cross_pair):
    """The cross pair, a larger SentencePiece target and a small vocabulary without byte fallback (its text of
    anything outside its 36 tokens comes back as <unk>)."""
    d = tmp_path_factory.mktemp("across")
    spm, bpe = cross_pair
    return {
        "spm": spm,
        "bpe": bpe,
        "big": str(write_tiny_gguf(d / "big.gguf", seed=4, n_layer=3, n_embd=128, control=("<|im_end|>",))),
        "letters": str(write_tiny_gguf(d / "letters.gguf", seed=5, n_layer=1, n_embd=16, byte_tokens=False)),
    }


def test_the_path_of_each_pair(files):
    assert compatibility(files["spm"], files["big"]).path == "same"
    p = compatibility(files["bpe"], files["big"])
    assert p.path == "map" and p.reason == "tokenizer types differ: draft uses BPE, target uses SPM (sentencepiece)"
    assert p.vocab_map is not None and p.vocab_map.probe_share > 0.9
    back = compatibility(files["big"], files["bpe"])
    assert back.path == "map" and back.vocab_map is not None and back.vocab_map.share_of_target > 0.5
    refused = compatibility(files["letters"], files["bpe"])
    assert refused.path == "refused" and "has no byte-fallback tokens" in (refused.reason or "")


def test_doctor_says_the_path_and_the_shares(files):
    runner = CliRunner()
    result = runner.invoke(cli, ["doctor", "--json", "--target", files["big"], "--draft", files["bpe"]])
    r = json.loads(result.output)
    assert r["pairing"]["path"] == "map" and r["pairing"]["map"]["probe_share"] > 0.9
    assert r["compatible"] is True and result.exit_code == 0  # the engine runs it through the map
    text = runner.invoke(cli, ["doctor", "--target", files["big"], "--draft", files["bpe"]]).output
    assert "draft -> target: compatible across tokenizers: tokenizer types differ" in text
    assert "across tokenizers: the vocabulary map (" in text and "shared pieces" in text


def test_loading_a_pair_of_tokenizers_takes_the_map_or_names_the_refusal(files):
    with Engine(target=files["big"], draft=files["bpe"], n_ctx=64) as eng:
        assert eng.across is not None and eng.n_vocab == eng.target.n_vocab
    with pytest.raises(VocabularyMismatchError, match="no byte-fallback tokens"):
        Engine(target=files["bpe"], draft=files["letters"], n_ctx=64)


def test_models_local_lists_drafts_across_tokenizers(files, tmp_path, monkeypatch):
    s = isolate(monkeypatch, tmp_path)
    ollama_model(s["ollama"], "tiny:big", files["big"])
    hub_file(s["huggingface"], "acme/Bpe-GGUF", "bpe.gguf", files["bpe"])
    result = CliRunner().invoke(cli, ["models", "--local", "--json"])
    assert result.exit_code == 0, result.output
    by_name = {m["name"]: m for m in json.loads(result.output)["models"]}
    across = by_name["tiny:big"]["drafts_across"]
    assert [a["name"] for a in across] == ["acme/Bpe-GGUF/bpe.gguf"] and across[0]["problem"] is None
    assert across[0]["probe_share"] > 0.9 and by_name["tiny:big"]["drafts"] == []
    text = CliRunner().invoke(cli, ["models", "--local"]).output
    assert "across tokenizers: acme/Bpe-GGUF/bpe.gguf (" in text


@pytest.mark.real
def test_smollm2_and_gemma(real_pair, gemma_path):
    p = compatibility(real_pair[0], gemma_path)
    assert p.path == "map" and p.vocab_map is not None and p.vocab_map.shared_pieces == 46145
    assert compatibility(gemma_path, real_pair[0]).path == "map"


def test_a_gguf_without_a_tokenizer_is_refused_in_one_line(tmp_path, monkeypatch, files):
    import support.tinymodels as tm

    monkeypatch.setattr(tm, "add_tokenizer", lambda w, *a: w.add_tokenizer_model("no_vocab"))
    bare = str(tm.write_tiny_gguf(tmp_path / "bare.gguf"))
    monkeypatch.undo()
    for args in (
        ["doctor", "--target", files["spm"], "--draft", bare],
        ["doctor", "--target", bare, "--draft", files["spm"]],
    ):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert "has no tokenizer (no token list in the GGUF)" in result.output
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        Engine(target=bare, n_ctx=64)
