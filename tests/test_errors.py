"""Bad input gets a clear error naming the problem and what to do."""

import math
import subprocess
import sys

import pytest

from fsd_local import ConfigError, ContextOverflowError, Engine, ModelLoadError, Settings, VocabularyMismatchError


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="target model file not found: .*nope.gguf"):
        Engine(target=str(tmp_path / "nope.gguf"))


def test_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        Engine(target=str(bad))


def test_truncated_gguf_is_refused_by_llama_cpp_with_its_reason(tmp_path, tiny_pair):
    _, target = tiny_pair
    data = open(target, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError, match="could not load target model"):
        Engine(target=str(cut))


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ModelLoadError, match="is a directory"):
        Engine(target=str(tmp_path))


def test_a_draft_of_another_vocabulary_larger_than_its_target_real_pair(real_pair, gemma_path):
    """Across tokenizers the pair runs through the vocabulary map (tests/test_across_engine.py); Gemma 3 270M
    drafting for the 44-layer SmolLM2 is a larger draft than its target, most likely the two swapped."""
    with pytest.raises(ConfigError, match=r"is larger than target .*swap --draft and --target") as err:
        Engine(target=real_pair[1], draft=gemma_path, n_ctx=256)
    assert "\n" not in str(err.value)


def test_mismatched_vocabularies_tiny(tmp_path):
    """One token differs: not one vocabulary, so the pair drafts through the map; a draft without byte fallback
    for a target it cannot spell is refused, naming why."""
    from support.tinymodels import WORDS, write_tiny_gguf

    a = write_tiny_gguf(tmp_path / "a.gguf")
    b = write_tiny_gguf(tmp_path / "b.gguf", words=WORDS[:-1] + ["ß"])
    with Engine(target=str(a), draft=str(b), n_ctx=64) as eng:
        assert eng.across is not None
    c = write_tiny_gguf(tmp_path / "c.gguf", n_layer=1, n_embd=16, byte_tokens=False)
    with pytest.raises(VocabularyMismatchError, match=r"cannot draft for target .*no byte-fallback tokens"):
        Engine(target=str(a), draft=str(c), n_ctx=64)


@pytest.mark.parametrize("tau,why", [(-0.1, "must be >= 0"), (math.nan, "finite"), (math.inf, "finite")])
def test_bad_tau(tau, why, tiny_engine):
    with pytest.raises(ConfigError, match=why):
        Settings(tau=tau)
    with pytest.raises(ConfigError, match=why):
        tiny_engine.generate("the", tau=tau)


@pytest.mark.parametrize(
    "field,value",
    [
        ("mode", "turbo"),
        ("divergence", "hellinger"),
        ("top_p", 0.0),
        ("temperature", -1.0),
        ("draft_max", 0),
        ("min_p", 1.0),
    ],
)
def test_bad_settings(field, value):
    with pytest.raises(ConfigError, match=field):
        Settings(**{field: value})


def test_prompt_longer_than_the_context(tiny_engine):
    n_ctx = tiny_engine.target.n_ctx
    with pytest.raises(ContextOverflowError, match=f"the prompt has {n_ctx + 5} tokens but the context holds"):
        tiny_engine.generate([5] * (n_ctx + 5))


def test_token_ids_outside_the_vocabulary(tiny_engine):
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        tiny_engine.generate([1, 10_000_000])


def test_speculative_mode_without_a_draft(tiny_pair):
    _, target = tiny_pair
    with Engine(target=target, n_ctx=128) as eng:
        assert eng.generate("the", mode="ar", max_tokens=3).token_ids
        with pytest.raises(ConfigError, match="needs a draft model"):
            eng.generate("the", mode="fsd")


def run_cli(*args, input=None):
    return subprocess.run(
        [sys.executable, "-m", "fsd_local.cli", *args], capture_output=True, text=True, input=input, timeout=300
    )


def test_cli_errors_are_one_line_without_traceback(tmp_path, tiny_pair):
    draft, target = tiny_pair
    cases = [
        (["generate", "hi", "--target", str(tmp_path / "x.gguf"), "--draft", draft], "not found"),
        (["generate", "hi", "--target", target, "--draft", draft, "--tau", "-1"], "tau"),
        (["generate", "hi", "--target", target, "--draft", draft, "--tau", "nan"], "tau"),
    ]
    for args, needle in cases:
        r = run_cli(*args)
        assert r.returncode != 0
        assert "Traceback" not in r.stderr
        assert needle in r.stderr
        assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) <= 3


def test_cli_generate_json(tiny_pair):
    import json

    draft, target = tiny_pair
    r = run_cli(
        "generate",
        "--target",
        target,
        "--draft",
        draft,
        "--max-tokens",
        "12",
        "--json",
        "--threads",
        "1",
        input="the cat",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "token_ids", "finish_reason", "stats"}
    for key in (
        "tokens",
        "rounds",
        "drafted",
        "accepted_sd",
        "accepted_fuzzy",
        "acceptance_rate",
        "mean_tokens_per_round",
        "target_logprob_mean",
        "seconds",
        "prompt_seconds",
        "tokens_per_second",
    ):
        assert key in out["stats"]
    assert set(out["stats"]["seconds"]) == {"draft", "target", "other"}
