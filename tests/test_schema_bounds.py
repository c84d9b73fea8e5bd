"""JSON-schema replies cannot run away: numbers and strings a schema leaves open are bounded (schema_bounds.py),
checked on the compiled grammar itself (llguidance, fed the token ids of a text on a real vocabulary), and on the
demo pair, whose greedy reply to the baker prompt wrote digits (then an unclosed string) until max_tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest

from fsd_local.constrain import compile_grammar, tokenizer_for
from fsd_local.schema_bounds import INTEGER_MAX, STRING_MAX, bound_schema

BAKER = "Invent a baker from Lyon: name, age and city."
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}


@pytest.fixture(scope="module")
def accepts(tiny_engine):
    """accepts(schema, text): whether the grammar compiled for `schema` takes `text` whole (tiny pair's vocabulary:
    byte tokens, so any text can be spelled)."""
    import llguidance

    tok = tokenizer_for(tiny_engine.target)

    def check(schema, text):
        m = llguidance.LLMatcher(tok, compile_grammar(None, json.dumps(schema)), log_level=0)
        ids = tok.tokenize_str(text)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    return check


def test_integers_have_at_most_16_digits(accepts):
    s = {"type": "integer"}
    assert accepts(s, "9999999999999999") and accepts(s, "-9999999999999999") and accepts(s, "0")
    assert not accepts(s, "12345678901234567") and not accepts(s, "1231231111111111111")
    assert accepts({"type": "integer", "maximum": 10**20}, "9999999999999999")  # a looser bound is tightened
    assert not accepts({"type": "integer", "maximum": 10**20}, "99999999999999999")
    assert not accepts({"type": "integer", "maximum": 5}, "6")  # the schema's own, tighter bound stays


def test_numbers_are_bounded_and_written_plainly(accepts):
    s = {"type": "number"}
    assert accepts(s, "3.5") and accepts(s, "-0.25") and accepts(s, "1234567890123456.5")
    assert accepts(s, "0.0123456789") and not accepts(s, "0.01234567891")  # at most 10 decimals
    assert not accepts(s, "12345678901234567") and not accepts(s, "1e5")
    assert accepts({"type": "number", "multipleOf": 0.5}, "2.5") and not accepts(
        {"type": "number", "multipleOf": 0.5}, "2.25"
    )
    assert not accepts({"type": ["number", "null"]}, "1" * 17) and accepts({"type": ["number", "null"]}, "null")


def test_strings_end_unless_the_schema_says_how_long(accepts):
    s = {"type": "string"}
    assert accepts(s, json.dumps("a" * STRING_MAX)) and not accepts(s, json.dumps("a" * (STRING_MAX + 1)))
    long = {"type": "string", "maxLength": 2000}
    assert accepts(long, json.dumps("a" * 2000))  # the schema's own maxLength wins
    assert accepts({"type": "string", "minLength": 600}, json.dumps("b" * 600))


def test_values_the_schema_leaves_free_are_bounded_too(accepts):
    free = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    assert accepts(free, '{"a":true,"b":12}') and not accepts(free, '{"a":true,"b":' + "1" * 17 + "}")
    assert not accepts({}, "1" * 17) and accepts({}, '"x"')
    nested = {"type": "array", "items": {"$ref": "#/$defs/n"}, "$defs": {"n": {"type": "integer"}}}
    assert accepts(nested, "[1,2]") and not accepts(nested, "[" + "1" * 17 + "]")


def test_bound_schema_keeps_what_it_does_not_need_to_change():
    s = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "c": {"const": 3}}, "additionalProperties": False}
    assert bound_schema(s) == s
    assert bound_schema({"type": "integer", "exclusiveMinimum": 0}) == {
        "type": "integer",
        "exclusiveMinimum": 0,
        "maximum": INTEGER_MAX,
    }


@pytest.mark.real
def test_the_baker_from_lyon_is_valid_json_5_of_5(real_engine):
    """The issue's case at temperature 0 through Ollama's API (format = the schema, num_predict unset: up to the
    context's end) in five settings that give five different greedy replies; each must be an instance."""
    import ollama

    from fsd_local.server import BackgroundServer

    runs = [{"mode": "ar"}, {"mode": "sd"}, {"tau": 0.2}, {"tau": 0.5}, {"drafter": "ngram", "tau": 0.3}]
    with BackgroundServer(real_engine) as srv:
        client = ollama.Client(host=srv.url, timeout=300)
        replies = []
        for extra in runs:
            r = client.chat(
                model="demo",
                messages=[{"role": "user", "content": BAKER}],
                format=PERSON,
                options={"temperature": 0, **extra},
            )
            assert r.done_reason == "stop", (extra, r.message.content[-200:])
            reply = json.loads(r.message.content)
            jsonschema.validate(reply, PERSON)
            assert abs(reply["age"]) <= INTEGER_MAX
            replies.append(reply)
    assert len(replies) == 5
