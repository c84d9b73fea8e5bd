"""The sampling chain and constrained output through the OpenAI-compatible server, sent with the official `openai`
client: penalties, logit_bias and response_format (json_object, json_schema) give what the engine gives when
called directly (greedy), streamed or not, and bad values are a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from fsd_local import Engine
from fsd_local.server import BackgroundServer

HELLO = [{"role": "user", "content": "hello there"}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}, "tag": {"enum": ["red", "blue"]}},
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_pair):
    d, t = tiny_pair
    with Engine(target=t, draft=d, n_ctx=512, n_threads=1) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    with BackgroundServer(engine, model_name="tiny-pair") as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_penalties_and_logit_bias_through_the_client_equal_the_engine(client, engine):
    banned = engine.chat(HELLO, max_tokens=30).token_ids[2]
    r = client.chat.completions.create(
        model="tiny-pair",
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=30,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={str(banned): -100},
        extra_body={"repeat_penalty": 1.3, "repeat_last_n": 32},
    )
    want = engine.chat(
        HELLO,
        max_tokens=30,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={banned: -100},
        repeat_penalty=1.3,
        repeat_last_n=32,
    )
    assert r.choices[0].message.content == want.text
    assert banned not in want.token_ids
    assert want.text != engine.chat(HELLO, max_tokens=30).text
    settings = r.model_extra["fsd"]["settings"]  # type: ignore[index]
    assert settings["presence_penalty"] == 0.5 and settings["logit_bias"] == {str(banned): -100.0}


def test_response_format_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}
    for mode in ("ar", "sd", "fsd"):
        r = client.chat.completions.create(
            model="tiny-pair",
            messages=HELLO,  # type: ignore[arg-type]
            max_tokens=60,
            response_format=fmt,  # type: ignore[arg-type]
            extra_body={"mode": mode, "tau": 0.3},
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)
    chunks = client.chat.completions.create(
        model="tiny-pair",
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=60,
        response_format=fmt,  # type: ignore[arg-type]
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    # json_object: any object; the completions endpoint takes llama.cpp's json_schema field
    r2 = client.completions.create(model="tiny-pair", prompt="a", max_tokens=60, extra_body={"json_schema": SCHEMA})
    jsonschema.validate(json.loads(r2.choices[0].text), SCHEMA)
    r3 = client.chat.completions.create(
        model="tiny-pair",
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=200,
        response_format={"type": "json_object"},
    )
    assert r3.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r3.choices[0].message.content or ""), dict)


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"logit_bias": {"999999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "token id"),
        ({"presence_penalty": 5}, "presence_penalty", "presence_penalty"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, None, "nope"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="tiny-pair",
            messages=HELLO,  # type: ignore[arg-type]
            max_tokens=5,
            extra_body=extra,
        )
    assert words in str(exc.value)
    if param:
        assert exc.value.body["param"] == param  # type: ignore[index]
