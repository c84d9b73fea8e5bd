"""Constrained output (GBNF grammars, JSON schemas) through llguidance's masks, on both models' rows: every reply
follows its grammar in every mode (greedy and sampled, huge tau, prompt lookup), the matcher's state after a round
is the state of the emitted text (rejected drafts rolled back), greedy sd == ar under a grammar, JSON replies of
the real demo pair parse and validate, and bad grammars, schemas and files are refused with a clear message."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from click.testing import CliRunner

from fsd_local.chain import Chain
from fsd_local.cli import cli
from fsd_local.errors import ConfigError
from fsd_local.settings import Settings

# the tiny models' vocabulary: bytes, a-z, a few punctuation marks
GBNF = 'root ::= ("yes" | "no") ", " word (" " word)? "."\nword ::= [a-z] [a-z] [a-z]?'
GBNF_RE = re.compile(r"(yes|no), [a-z]{2,3}( [a-z]{2,3})?\.")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "student": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "student"],
    "additionalProperties": False,
}
PEOPLE = [
    "a retired teacher from Lyon",
    "a young programmer in Tokyo",
    "a farmer in Kenya",
    "a student in Boston",
    "a chef in Rome",
    "a nurse in Toronto",
    "a painter in Madrid",
    "a pilot in Dubai",
    "a fisherman in Norway",
    "a musician in Vienna",
]


@pytest.mark.parametrize(
    "settings",
    [
        dict(mode="ar"),
        dict(mode="sd", draft_max=4),
        dict(mode="fsd", tau=0.3, draft_max=4),
        dict(mode="fsd", tau=10.0, draft_max=6),  # every draft rescued, if it were not masked
        dict(mode="fsd", tau=10.0, drafter="ngram"),  # prompt lookup proposes what the prompt holds
        dict(mode="fsd", tau=0.3, temperature=1.0, seed=3),
        dict(mode="sd", temperature=0.8, seed=5, repeat_penalty=1.3),
        dict(mode="draft-only"),
    ],
)
def test_every_mode_writes_what_the_grammar_allows(tiny_engine, settings):
    for prompt in ("the cat sat on the mat", "yes, yes, no. no, yes", "über € é!"):
        out = tiny_engine.generate(prompt, grammar=GBNF, max_tokens=40, **settings)
        assert GBNF_RE.fullmatch(out.text), (settings, out.text)
        assert out.finish_reason == "stop"


def test_greedy_sd_equals_ar_under_a_grammar(tiny_engine):
    for prompt in ("the cat sat", "no, it ran"):
        ar = tiny_engine.generate(prompt, mode="ar", grammar=GBNF, max_tokens=40)
        for k in (1, 3, 6):
            assert tiny_engine.generate(prompt, mode="sd", draft_max=k, grammar=GBNF, max_tokens=40).token_ids == (
                ar.token_ids
            )


def _allowed(mask: np.ndarray, n: int) -> np.ndarray:
    return np.array([(int(mask[i >> 5]) >> (i & 31)) & 1 for i in range(n)], bool)


def _ids(target, text: str) -> list[int]:
    """The tiny vocabulary's tokens of `text` (its tokenizer puts a space in front of the text)."""
    return target.tokenize(text, add_special=False)[1:]


def _fresh_mask(s, n, target, text):
    fresh = Chain(s, n, target)
    for t in _ids(target, text):
        fresh.push(t)
    return _allowed(fresh.constraint.mask(fresh.constraint.depth), n)


def test_each_row_is_masked_with_the_state_after_the_drafts_before_it_and_rejected_ones_roll_back(tiny_engine):
    n, target = tiny_engine.n_vocab, tiny_engine.target
    s = Settings(grammar=GBNF)
    chain = Chain(s, n, target)
    drafts = _ids(target, "yes, ab")
    for j, t in enumerate(drafts):
        assert chain.allows(j, t)
        chain.push(t)
    rows = np.zeros((len(drafts) + 1, n), np.float32)
    chain.target_rows(rows, len(drafts))
    for j in range(len(drafts) + 1):
        want = _fresh_mask(s, n, target, target.detokenize(drafts[:j]))
        assert np.array_equal(np.isfinite(rows[j]), want), j
    assert np.isfinite(rows[0]).sum() < n / 10, "the first position allows little (yes / no)"
    kept = len(_ids(target, "yes"))
    chain.settle(kept, _ids(target, ",")[0])  # kept "yes", rejected the rest, emitted ","
    assert np.array_equal(_allowed(chain.constraint.mask(0), n), _fresh_mask(s, n, target, "yes,"))
    assert _allowed(chain.constraint.mask(0), n)[_ids(target, " ")[0]]


def test_prompt_lookup_drafts_are_cut_at_the_first_disallowed_token(tiny_engine):
    target = tiny_engine.target
    chain = Chain(Settings(grammar=GBNF), tiny_engine.n_vocab, target)
    tokens = _ids(target, "yes! no")
    kept = list(tokens)
    chain.admit(kept)
    assert target.detokenize(kept) == "yes"


@pytest.mark.real
def test_json_schema_replies_parse_and_validate_on_the_real_pair(real_engine):
    for settings in (dict(mode="ar"), dict(mode="sd", draft_max=4), dict(mode="fsd", tau=0.3, draft_max=4)):
        for i, who in enumerate(PEOPLE * 2):
            prompt = f"Describe {who} as JSON with the fields name, age, city and student."
            extra = dict(temperature=0.7, seed=i) if i >= len(PEOPLE) else {}
            out = real_engine.chat(
                [{"role": "user", "content": prompt}], json_schema=SCHEMA, max_tokens=64, **settings, **extra
            )
            assert out.finish_reason == "stop", (settings, out.text)
            jsonschema.validate(json.loads(out.text), SCHEMA)


def test_bad_grammars_schemas_and_files_are_refused_clearly(tmp_path, tiny_pair):
    for bad, words in (
        (dict(grammar="root ::= missing"), "not a valid GBNF grammar.*missing"),
        (dict(grammar='root ::= "a'), "GBNF"),
        (dict(json_schema="{not json"), "not valid JSON"),
        (dict(json_schema={"type": "frobnicate"}), "json_schema is not usable"),
        (dict(json_schema=[1, 2]), "must be a JSON object"),
        (dict(grammar='root ::= "a"', json_schema={"type": "object"}), "not both"),
        (dict(grammar='root ::= "a"', ignore_eos=True), "ignore_eos"),
    ):
        with pytest.raises(ConfigError, match=words):
            Settings(**bad)
    d, t = tiny_pair
    runner = CliRunner()
    args = ["generate", "--target", t, "--draft", d, "--ctx", "128", "--threads", "1", "--max-tokens", "4"]
    r = runner.invoke(cli, [*args, "--grammar-file", str(tmp_path / "nope.gbnf"), "hi"])
    assert r.exit_code == 2 and "cannot read" in r.output and "nope.gbnf" in r.output
    (tmp_path / "bad.json").write_text('{"type": "object", "properties": ')
    r = runner.invoke(cli, [*args, "--json-schema", str(tmp_path / "bad.json"), "hi"])
    assert r.exit_code != 0 and "not valid JSON" in r.output
    r = runner.invoke(cli, [*args, "--logit-bias", "12~3", "hi"])
    assert r.exit_code != 0 and "TOKEN_ID+BIAS" in r.output
    (tmp_path / "yn.gbnf").write_text(GBNF)
    r = runner.invoke(cli, [*args[:-1], "40", "--grammar-file", str(tmp_path / "yn.gbnf"), "the cat"])
    assert r.exit_code == 0, r.output
    assert GBNF_RE.fullmatch(r.stdout.strip()), r.stdout


def test_sampled_sd_under_a_grammar_follows_the_masked_target_distribution(tiny_pair, small_vocab_pair):
    """The first token of sampled sd with a grammar: the target's distribution renormalised over the tokens the
    grammar allows there (chi-square), and never a token outside them."""
    from scipy import stats as sps

    from fsd_local import Engine
    from fsd_local.llama.model import Model, ModelOptions

    draft, target = small_vocab_pair
    with Engine(target=target, draft=draft, n_ctx=128, n_threads=1) as eng:  # 36 tokens, no byte tokens
        with pytest.raises(ConfigError, match="vocabulary cannot be used for a grammar"):
            eng.generate("the sky", grammar=GBNF, max_tokens=4)
    draft, target = tiny_pair
    grammar = "root ::= [a-h] [a-z]*"
    with Engine(target=target, draft=draft, n_ctx=128, n_threads=1) as eng:
        prompt = eng.tokenize("the sky")
        n = eng.n_vocab
        allowed = _allowed(Chain(Settings(grammar=grammar), n, eng.target).constraint.mask(0), n)
        counts = np.zeros(n, np.int64)
        for seed in range(2000):
            out = eng.generate(
                prompt, mode="sd", max_tokens=4, seed=seed, temperature=1.0, draft_max=3, grammar=grammar
            )
            counts[out.token_ids[0]] += 1
    fresh = Model(ModelOptions(target, n_ctx=128, n_threads=1))
    try:
        fresh.decode(prompt, "last")
        x = fresh.logits(1)[0][:n].astype(np.float64)
    finally:
        fresh.close()
    assert 2 <= allowed.sum() < n / 2 and not counts[~allowed].any()
    p = np.where(allowed, np.exp(x - x[allowed].max()), 0.0)
    p /= p.sum()
    expected = p * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert sps.chisquare(obs, exp).pvalue > 1e-3
