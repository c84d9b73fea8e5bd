"""Tool calling on the OpenAI chat route, through the official openai client, on tiny GGUFs whose templates
(tests/support/tool_templates.py) can express tools. The weights are random: what is asserted is what the constraint
and the parse guarantee (a call with schema-valid arguments), not what a good model would choose."""

from __future__ import annotations

import json

import jinja2
import jsonschema
import openai
import pytest

from fsd_local import Engine
from fsd_local.server import BackgroundServer
from support.tool_templates import TEMPLATES, with_template

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a time zone",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}},
        },
    },
]
ASK = [{"role": "user", "content": "what is the weather in paris?"}]
SPEC = {"mode": "fsd", "tau": 0.3}


@pytest.fixture(scope="module")
def targets(tiny_pair, tmp_path_factory):
    """The tiny target with each test template: {family: path}."""
    d = tmp_path_factory.mktemp("tool-templates")
    return {name: str(with_template(tiny_pair[1], d / f"{name}.gguf", src)) for name, src in TEMPLATES.items()}


@pytest.fixture(scope="module")
def engines(targets, tiny_pair):
    engines = {
        name: Engine(target=path, draft=tiny_pair[0], n_ctx=2048, n_threads=1, draft_policy="fixed", draft_max=4)
        for name, path in targets.items()
    }
    yield engines
    for e in engines.values():
        e.close()


@pytest.fixture(scope="module")
def clients(engines):
    """{family: (openai client, server url)} over each template's engine."""
    servers = {name: BackgroundServer(e, model_name=f"tiny-{name}") for name, e in engines.items()}
    yield {
        name: (openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120), s.url)
        for name, s in servers.items()
    }
    for s in servers.values():
        s.close()


def call(client, **kw):
    body = {"model": "m", "messages": ASK, "tools": TOOLS, "max_tokens": 400, "parallel_tool_calls": False, **kw}
    return client.chat.completions.with_raw_response.create(**body)


def rendered(template: str, messages, tools) -> str:
    """The template rendered by plain Jinja, as transformers does (tojson writing plain JSON)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
    return env.from_string(template).render(
        messages=messages, tools=tools, add_generation_prompt=True, bos_token="<s>", eos_token="</s>"
    )


def schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def check_calls(message, names=("get_weather", "get_time")) -> list:
    assert message.tool_calls, message
    for c in message.tool_calls:
        assert c.type == "function" and c.id and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), schema_of(c.function.name))
        if c.function.name == "get_weather":  # the constraint closes objects (llama.cpp's default)
            assert set(json.loads(c.function.arguments)) == {"city", "unit"}
    return message.tool_calls


@pytest.mark.parametrize("mode", [{"mode": "ar"}, {"mode": "sd"}, {"mode": "fsd", "tau": 0.3}], ids=str)
def test_a_required_call_has_schema_valid_arguments_in_every_mode(clients, mode):
    raw = call(clients["hermes"][0], tool_choice="required", extra_body=mode)
    r = raw.parse()
    assert raw.headers["x-fsd-tools"] == "hermes; required"
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content is None
    assert len(check_calls(r.choices[0].message)) == 1
    assert r.model_extra["fsd"]["settings"]["grammar"] is None  # the request sent none
    stats = r.model_extra["fsd"]["tools"]
    assert stats["family"] == "hermes" and stats["constrained"] and stats["offered"] == 2
    calls = stats["calls"]  # every token of a forced reply is inside the call, and each has its origin
    assert calls["tokens"] == r.usage.completion_tokens == sum(calls["origins"].values())
    drafted = calls["origins"].get("sd", 0) + calls["origins"].get("fuzzy", 0)
    assert (drafted == 0) == (mode["mode"] == "ar")


def test_per_token_origins_cover_the_call(clients):
    r = call(clients["hermes"][0], tool_choice="required", logprobs=True, extra_body=SPEC).parse()
    entries = r.choices[0].logprobs.content
    origins = [e.model_extra["origin"] for e in entries]
    text = "".join(e.token for e in entries)
    assert text.startswith("<tool_call>") and r.choices[0].message.tool_calls[0].function.name in text
    counts = r.model_extra["fsd"]["tools"]["calls"]["origins"]
    assert {o: origins.count(o) for o in set(origins)} == counts and "fuzzy" in counts  # tau rescued some


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral", "mistral-args"])
def test_a_named_function_is_called_in_each_family_syntax(clients, family):
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = call(clients[family][0], tool_choice=choice, max_tokens=300, extra_body=SPEC).parse()
    assert r.choices[0].finish_reason == "tool_calls"
    (c,) = check_calls(r.choices[0].message, names=("get_time",))
    if family.startswith("mistral"):  # Mistral's templates want 9 letters and digits
        assert len(c.id) == 9 and c.id.isalnum()


def test_parallel_calls_are_all_returned(clients):
    r = call(clients["hermes"][0], tool_choice="required", parallel_tool_calls=True, max_tokens=600).parse()
    calls = check_calls(r.choices[0].message)
    # the random model keeps calling until max_tokens: the whole calls come back, the cut one does not
    assert len(calls) >= 2
    assert r.choices[0].finish_reason in ("tool_calls", "length")


def test_a_streamed_call_arrives_as_tool_call_deltas(clients):
    client = clients["hermes"][0]
    body = {"tool_choice": "required", "max_tokens": 400, "parallel_tool_calls": False, "extra_body": SPEC}
    stream = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, stream=True, **body)
    content, calls, finish, origins = "", {}, None, []
    for chunk in stream:
        origins += [t["origin"] for t in (chunk.model_extra.get("fsd_delta") or {}).get("tokens", [])]
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    (c,) = calls.values()
    assert c["name"] in ("get_weather", "get_time") and c["id"].startswith("call_")
    jsonschema.validate(json.loads(c["arguments"]), schema_of(c["name"]))
    # jump-forward is on for a call's constrained arguments: the grammar's forced tokens arrive as their own origin
    assert "forced" in origins and set(origins) <= {"target", "sd", "fuzzy", "forced"}


def test_auto_streams_free_text_as_content(clients):
    """Under auto the tiny model writes text (it never opens a call): all of it arrives as content."""
    client = clients["hermes"][0]
    full = call(client, max_tokens=40).parse()
    stream = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=40, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert full.choices[0].message.tool_calls is None and "<tool_call>" not in streamed
    assert streamed == full.choices[0].message.content and streamed


@pytest.mark.parametrize("family", ["hermes", "mistral", "mistral-args"])
def test_the_tool_result_goes_back_through_the_template(clients, engines, family):
    client = clients[family][0]
    first = call(client, tool_choice={"type": "function", "function": {"name": "get_time"}}).parse()
    (c,) = first.choices[0].message.tool_calls
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump()]},
        {"role": "tool", "tool_call_id": c.id, "content": "12:00"},
    ]
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the prompt is the template rendered with the call (arguments as an object) and the result
    messages[1]["tool_calls"][0]["function"]["arguments"] = json.loads(c.function.arguments)
    text = rendered(TEMPLATES[family], messages, TOOLS)
    assert '"12:00"' in text or "12:00" in text
    assert r.usage.prompt_tokens == len(engines[family].tokenize(text, add_special=not text.startswith("<s>")))


def test_tool_choice_none_answers_without_tools(clients):
    client = clients["hermes"][0]
    plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=16)
    raw = call(client, tool_choice="none", max_tokens=16)
    r = raw.parse()
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason != "tool_calls"
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens  # the tools are not in the prompt
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert "x-fsd-tools" not in raw.headers


def test_a_template_without_tools_answers_auto_as_plain_chat_and_says_so(clients, caplog):
    client = clients["none"][0]
    plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=16)
    with caplog.at_level("WARNING", logger="fsd_local.tools"):
        raw = call(client, max_tokens=16)
    r = raw.parse()
    assert raw.headers["x-fsd-tools"].startswith("ignored; ") and "does not write tools" in raw.headers["x-fsd-tools"]
    assert r.model_extra["fsd"]["tools"]["ignored"] and not r.model_extra["fsd"]["tools"]["constrained"]
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert "answering without tools" in caplog.text
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        with pytest.raises(openai.BadRequestError) as err:
            call(client, tool_choice=choice)
        assert err.value.body["param"] == "tool_choice" and "does not write tools" in err.value.body["message"]


BAD_CALL = {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{not json"}}


def _weather(**fn):
    return [{"type": "function", "function": {"name": "get_weather", **fn}}]


BAD = {
    "schema not an object": (dict(tools=_weather(parameters="a city")), "tools", "tools.0.function.parameters"),
    "schema not usable": (dict(tools=_weather(parameters={"type": "object", "required": 3})), "tools", "usable"),
    "arguments not an object": (dict(tools=_weather(parameters={"type": "string"})), "tools", "an object"),
    "no function": (dict(tools=[{"type": "function"}]), "tools", "tools.0: no 'function'"),
    "bad name": (dict(tools=_weather(name="get weather")), "tools", "function.name"),
    "not a function tool": (dict(tools=[{"type": "retrieval"}]), "tools", "only function tools"),
    "duplicate": (dict(tools=TOOLS + TOOLS[:1]), "tools", "names must be unique"),
    "unknown named": (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    "bad choice": (dict(tool_choice="always"), "tool_choice", "'always'"),
    "required without tools": (dict(tools=openai.NOT_GIVEN, tool_choice="required"), "tool_choice", "needs tools"),
    "with a schema": (dict(response_format={"type": "json_object"}), "tools", "cannot be combined"),
    "bad call in history": (dict(messages=[*ASK, {"role": "assistant", "tool_calls": [BAD_CALL]}]), "messages", "JSON"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_tool_requests_get_a_clear_400(clients, case):
    fields, param, words = BAD[case]
    body = {"tools": TOOLS, **fields}
    with pytest.raises(openai.BadRequestError) as err:
        call(clients["hermes"][0], **body)
    assert err.value.status_code == 400 and err.value.body["param"] == param
    assert words in err.value.body["message"], err.value.body["message"]


def test_legacy_functions_and_tools_on_completions_are_refused(clients):
    client = clients["hermes"][0]
    with pytest.raises(openai.BadRequestError, match="use tools"):
        client.chat.completions.create(model="m", messages=ASK, functions=[{"name": "f"}])
    with pytest.raises(openai.BadRequestError, match="tools is not supported"):
        client.completions.create(model="m", prompt="hi", extra_body={"tools": TOOLS})


def test_tools_too_big_for_the_context_name_their_token_count(targets, tiny_pair):
    many = [
        {
            "type": "function",
            "function": {"name": f"tool_{i}", "description": "does a thing " * 4, "parameters": WEATHER},
        }
        for i in range(12)
    ]
    with Engine(target=targets["hermes"], draft=tiny_pair[0], n_ctx=1024, n_threads=1) as eng:
        with BackgroundServer(eng) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            assert client.chat.completions.create(model="m", messages=ASK, max_tokens=4).choices
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="m", messages=ASK, tools=many, max_tokens=64)
            with_tools = len(eng.tokenize(rendered(TEMPLATES["hermes"], ASK, many)))
            without = len(eng.tokenize(rendered(TEMPLATES["hermes"], ASK, None)))
    body = err.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "tools"
    assert f"the 12 tool definitions take {with_tools - without} tokens" in body["message"]


def test_the_supervised_server_calls_tools(targets, tiny_pair):
    with BackgroundServer.supervised(targets["llama3"], tiny_pair[0], model_name="tiny") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = call(client, tool_choice="required", max_tokens=300, extra_body=SPEC).parse()
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message)


FUNCTIONS = '''
def get_weather(city: str) -> str:
    """The weather now in a city."""
    return "sunny"
'''


def test_llm_sends_its_tools_and_gets_the_reply(clients, tmp_path, caplog):
    """`llm` (a real agent client) against the server, as docs/tools.md shows it: its tools reach the template
    (its reply is the one the openai client gets with the same tool), and a template without tools answers it
    as plain chat and says so in the log."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    def llm(family: str) -> str:
        url = clients[family][1]
        (tmp_path / "extra-openai-models.yaml").write_text(
            f"- model_id: fsd-local\n  model_name: tiny\n  api_base: {url}/v1\n  supports_tools: true\n"
        )
        exe = Path(sys.executable).parent / "llm"
        args = [str(exe), "-m", "fsd-local", "--functions", FUNCTIONS, "-o", "max_tokens", "24", "-n", "hi"]
        env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "x"}
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fn = {"name": "get_weather", "description": "The weather now in a city.", "parameters": params}
    weather = [{"type": "function", "function": fn}]
    same = clients["hermes"][0].chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=weather, max_tokens=24
    )
    plain = clients["hermes"][0].chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=24
    )
    assert plain.choices[0].message.content != same.choices[0].message.content  # the tools change the prompt
    assert llm("hermes") == same.choices[0].message.content.strip()
    with caplog.at_level("WARNING", logger="fsd_local.tools"):
        assert llm("none")
    assert "answering without tools" in caplog.text
