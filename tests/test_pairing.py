"""Drafts of any family for a target given alone (pairs/ranking.py): ranked by the speed-up the cost model expects
from the share the map carries and the size ratio, listed by `models --local`, chosen and said on stderr; a map
pair's prompt prices its draft's tokens for `auto`; the CLI says a pair's path across tokenizers. Tiny GGUFs of two
tokenizers, and SmolLM2 with Gemma 3."""

from __future__ import annotations

import json

import pytest

from fsd_local import Engine
from fsd_local.pairs.names import choose_draft, resolve
from fsd_local.pairs.ranking import ACCEPT_OTHER, ACCEPT_SAME, Ranked, best, expected_speedup
from support.clirun import invoke
from support.localstores import hub_file, isolate, lmstudio_file, ollama_model
from support.tinymodels import write_tiny_gguf

RUN = ["--threads", "1", "--ctx", "256", "--max-tokens", "6", "--draft-policy", "fixed", "--draft-max", "2"]


@pytest.fixture(scope="module")
def family(tmp_path_factory, cross_pair):
    """`big`: a SentencePiece target; `small`: its tokenizer, smaller; `bpe`: a byte-level BPE model (another
    family, smaller still); `huge`: a SentencePiece target some 80 times the BPE model's file."""
    d = tmp_path_factory.mktemp("pairing")
    return {
        "big": write_tiny_gguf(d / "big.gguf", seed=4, n_layer=3, n_embd=128, control=("<|im_end|>",)),
        "small": write_tiny_gguf(d / "small.gguf", n_layer=1, n_embd=64, control=("<|im_end|>",)),
        "bpe": cross_pair[1],
        "huge": write_tiny_gguf(d / "huge.gguf", n_layer=4, n_embd=512, n_ff=1024, control=("<|im_end|>",)),
    }


def test_the_expected_speedup_orders_share_and_size():
    assert expected_speedup(ACCEPT_SAME, 0.05) > expected_speedup(ACCEPT_SAME, 0.3) > 1.0
    assert expected_speedup(ACCEPT_OTHER, 0.05) < expected_speedup(ACCEPT_SAME, 0.05)
    assert expected_speedup(ACCEPT_OTHER * 0.5, 0.01) < expected_speedup(ACCEPT_OTHER, 0.01)
    assert expected_speedup(0.0, 0.01) == 1.0  # nothing accepted: plain decoding's rate, never below


def test_ranking_puts_the_targets_own_tokenizer_first_and_lists_the_other_family(tmp_path, monkeypatch, family):
    s = isolate(monkeypatch, tmp_path)
    ollama_model(s["ollama"], "tiny:big", family["big"])
    lmstudio_file(s["lmstudio"], "acme", "Tiny-GGUF", family["small"], filename="tiny-small.gguf")
    hub_file(s["huggingface"], "acme/Bpe-GGUF", "bpe.gguf", family["bpe"])
    choice = choose_draft(resolve("tiny:big", "target"))
    paths = [r.path for r in choice.ranked]
    assert paths == ["same", "map"] and choice.candidates == 2
    assert choice.draft is not None and choice.draft.name == "acme/Tiny-GGUF/tiny-small.gguf"
    other = choice.ranked[1]
    assert other.share > 0.9 and other.speedup == expected_speedup(ACCEPT_OTHER * other.share, other.ratio)
    listed = invoke(["models", "--local", "--json"])
    assert listed.exit_code == 0, listed.output
    big = next(m for m in json.loads(listed.stdout)["models"] if m["name"] == "tiny:big")
    assert [r["path"] for r in big["ranked_drafts"]] == ["same", "map"]
    text = invoke(["models", "--local"]).stdout
    assert "  ranked: acme/Tiny-GGUF/tiny-small.gguf [" in text and "another tokenizer (map, " in text


def test_a_target_alone_gets_another_familys_draft_where_it_pays(tmp_path, monkeypatch, family):
    """Only the BPE model can draft for `huge`: a file ~1% of the target's expects more than 1x, so it is chosen
    and said; for `big` (a third of its size) it is not expected to pay, and prompt lookup drafts instead."""
    s = isolate(monkeypatch, tmp_path / "huge")
    ollama_model(s["ollama"], "tiny:huge", family["huge"])
    hub_file(s["huggingface"], "acme/Bpe-GGUF", "bpe.gguf", family["bpe"])
    result = invoke(["generate", "the cab", "--target", "tiny:huge", *RUN, "--json"])
    assert result.exit_code == 0, result.output
    note = next(ln for ln in result.stderr.splitlines() if ln.startswith("draft: "))
    assert note.startswith("draft: acme/Bpe-GGUF/bpe.gguf [Hugging Face cache, ") and "another tokenizer (map, " in note
    assert "draft and target have different tokenizers (tokenizer types differ" in result.stderr
    assert json.loads(result.stdout)["stats"]["drafted"] > 0
    s = isolate(monkeypatch, tmp_path / "big")
    ollama_model(s["ollama"], "tiny:big", family["big"])
    hub_file(s["huggingface"], "acme/Bpe-GGUF", "bpe.gguf", family["bpe"])
    lookup = invoke(["generate", "the cab", "--target", "tiny:big", *RUN, "--json"])
    assert lookup.exit_code == 0, lookup.output
    assert "of other families acme/Bpe-GGUF/bpe.gguf [" in lookup.stderr and "not expected to pay" in lookup.stderr
    assert json.loads(lookup.stdout)["settings"]["drafter"] == "ngram"


def test_best_takes_another_family_only_above_1x(family):
    from fsd_local.pairs.local import LocalModel

    m = LocalModel("folder", "m", "m")
    assert best([Ranked(m, "map", 1.0, 0.4, 1.0), Ranked(m, "same", 1.0, 0.9, 0.99)]) is not None
    assert best([Ranked(m, "text", 0.9, 0.4, 1.0)]) is None
    assert best([Ranked(m, "text", 0.9, 0.01, 1.02)]) is not None


def test_a_map_pairs_prompt_prices_the_drafts_tokens(family):
    """`auto` on a map pair: the draft's batch of the prompt's text prices its tokens before it drafts, as a draft
    of the target's tokenizer prices them from its prompt."""
    with Engine(target=str(family["big"]), draft=family["bpe"], n_ctx=256, n_threads=1) as eng:
        assert eng.pairing is not None and eng.pairing.path == "map"
        assert eng.policy.length.measured_catch_up_seconds == 0.0
        with eng.generation("the cab and a cab, the end. the ab and", mode="sd", temperature=0):
            assert eng.policy.length.measured_catch_up_seconds > 0.0


@pytest.mark.real
def test_gemma_ranks_smollm2_through_the_map(tmp_path, monkeypatch, real_pair, gemma_path):
    """The demo's draft (SmolLM2-135M) is listed for Gemma 3 270M through the map at its measured share, and not
    chosen at a size ratio where the cost model expects no gain; for the demo's target it is the first draft."""
    s = isolate(monkeypatch, tmp_path)
    hub_file(s["huggingface"], "acme/Gemma-GGUF", "gemma.gguf", gemma_path)
    hub_file(s["huggingface"], "acme/Smol-GGUF", "smol-135m.gguf", real_pair[0])
    hub_file(s["huggingface"], "acme/Smol-GGUF", "smol-target.gguf", real_pair[1])
    gemma = choose_draft(resolve("acme/Gemma-GGUF/gemma.gguf", "target"))
    smol = next(r for r in gemma.ranked if r.model.name == "acme/Smol-GGUF/smol-135m.gguf")
    assert smol.path == "map" and smol.share > 0.9 and smol.speedup < 1.05
    target = choose_draft(resolve("acme/Smol-GGUF/smol-target.gguf", "target"))
    assert target.draft is not None and target.draft.name == "acme/Smol-GGUF/smol-135m.gguf"
    assert target.ranked[0].path == "same"


def test_a_draft_larger_than_its_target_is_said_in_one_line(family):
    """One tokenizer: the pair runs (exactly) with a one-line warning; across tokenizers it is refused (test_across_
    engine.py)."""
    result = invoke(
        ["generate", "the cab", "--target", str(family["small"]), "--draft", str(family["big"]), *RUN, "--json"]
    )
    assert result.exit_code == 0, result.output
    warnings = [ln for ln in result.stderr.splitlines() if ln.startswith("warning: ")]
    assert len(warnings) == 1 and f"draft {family['big']} (" in warnings[0]
    assert "is larger than target" in warnings[0] and warnings[0].endswith("swap --draft and --target?")


def test_draft_only_on_a_pair_of_two_tokenizers_is_refused_in_one_line(family):
    args = ["generate", "the cab", "--target", str(family["big"]), "--draft", family["bpe"], *RUN]
    result = invoke([*args, "--mode", "draft-only"])
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert result.exit_code != 0 and "Traceback" not in result.output and len(errors) == 1
    assert "draft-only decodes the draft's own tokens" in errors[0] and "use a speculative mode" in errors[0]
