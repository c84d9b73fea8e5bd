"""Tool calling on Ollama's /api/chat through the official `ollama` client, unchanged: a Python function as a
tool, calls in Ollama's shape (arguments an object), streamed and not, the tool result sent back, the `tools`
capability, and a template without tools. On tiny GGUFs with the test templates (tests/support/tool_templates.py);
Ollama's API has no tool_choice, so fsd-local takes one in `options` to force a call of the random model."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import openai
import pytest

from fsd_local import Engine
from fsd_local.server import BackgroundServer
from support.tool_templates import TEMPLATES, with_template

TIMEOUT = 120
ASK = [{"role": "user", "content": "what time is it in paris?"}]
# an enum keeps the random model's call short (the ollama client sends type, enum and description of a property)
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": ZONE}}
]


def get_weather(city: str) -> str:
    """The weather now in a city.

    Args:
      city: the city's name
    """
    return "sunny"


@pytest.fixture(scope="module")
def servers(tiny_pair, tmp_path_factory):
    """{template: server URL} for a Hermes and a no-tools template on the tiny target."""
    d = tmp_path_factory.mktemp("ollama-tools")
    out, opened = {}, []
    for name in ("hermes", "none"):
        target = with_template(tiny_pair[1], d / f"{name}.gguf", TEMPLATES[name])
        eng = Engine(target=str(target), draft=tiny_pair[0], n_ctx=2048, n_threads=1, draft_policy="fixed", draft_max=4)
        srv = BackgroundServer(eng, model_name=f"tiny-{name}")
        opened.append((eng, srv))
        out[name] = srv.url
    yield out
    for eng, srv in opened:
        srv.close()
        eng.close()


def client(url: str) -> ollama.Client:
    return ollama.Client(host=url, timeout=TIMEOUT)


FORCED = {"tool_choice": "required", "num_predict": 300, "temperature": 0, "mode": "fsd", "tau": 0.3}


def test_a_python_function_is_called_with_object_arguments(servers):
    r = client(servers["hermes"]).chat(model="tiny", messages=ASK, tools=[get_weather], options=FORCED)
    call = r.message.tool_calls[0]  # the random model writes long strings: the whole calls before max_tokens
    assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    jsonschema.validate(
        dict(call.function.arguments), {**ZONE, "properties": {"city": {"type": "string"}}, "required": ["city"]}
    )
    assert r.done and r.done_reason in ("stop", "length") and "<tool_call>" not in (r.message.content or "")


def test_a_named_function_and_the_extension_fields(servers):
    options = {**FORCED, "tool_choice": "get_time"}
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "options": options, "stream": False}
    r = httpx.post(servers["hermes"] + "/api/chat", json=body, timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["x-fsd-tools"] == "hermes; named"
    out = r.json()
    calls = out["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_time"] * len(calls)
    for c in calls:
        jsonschema.validate(c["function"]["arguments"], ZONE)
    tools = out["fsd"]["tools"]
    assert tools["family"] == "hermes" and tools["calls"]["tokens"] == out["eval_count"]


def test_a_streamed_call_comes_in_one_chunk_and_no_call_text_is_streamed(servers):
    chunks = list(client(servers["hermes"]).chat(model="tiny", messages=ASK, tools=TOOLS, options=FORCED, stream=True))
    assert chunks[-1].done and not any(c.message.tool_calls for c in chunks[-1:])
    with_calls = [c for c in chunks if c.message.tool_calls]
    assert len(with_calls) == 1 and "".join(c.message.content or "" for c in chunks) == ""
    for call in with_calls[0].message.tool_calls:
        assert call.function.name == "get_time"
        jsonschema.validate(dict(call.function.arguments), ZONE)


def test_the_tool_result_goes_back_as_on_the_openai_route(servers):
    oc = client(servers["hermes"])
    first = oc.chat(model="tiny", messages=ASK, tools=TOOLS, options={**FORCED, "tool_choice": "get_time"})
    call = first.message.tool_calls[0]
    convo = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]}]
    answered = oc.chat(
        model="tiny",
        messages=[*convo, {"role": "tool", "content": "12:00", "tool_name": "get_time"}],
        tools=TOOLS,
        options={"num_predict": 4, "temperature": 0},
    )
    arguments = json.dumps(dict(call.function.arguments))
    openai_call = {"id": "x", "type": "function", "function": {"name": "get_time", "arguments": arguments}}
    same = openai.OpenAI(base_url=servers["hermes"] + "/v1", api_key="x").chat.completions.create(
        model="tiny",
        max_tokens=4,
        tools=TOOLS,
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [openai_call]},
            {"role": "tool", "tool_call_id": "x", "content": "12:00"},
        ],
    )
    assert answered.prompt_eval_count == same.usage.prompt_tokens  # the same prompt through both APIs


def test_the_tools_capability_follows_the_template(servers):
    assert "tools" in client(servers["hermes"]).show("tiny").capabilities
    assert "tools" not in client(servers["none"]).show("tiny").capabilities


def test_a_template_without_tools(servers):
    oc = client(servers["none"])
    r = oc.chat(model="tiny", messages=ASK, tools=TOOLS, options={"num_predict": 8})
    assert r.done and not r.message.tool_calls
    with pytest.raises(ollama.ResponseError) as err:
        oc.chat(model="tiny", messages=ASK, tools=TOOLS, options={"tool_choice": "required"})
    assert err.value.status_code == 400 and "does not write tools" in err.value.error
