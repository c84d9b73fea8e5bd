"""Tool calling on the SmolLM2 demo pair: the request shape of Open WebUI (36 built-in tools, tool_choice unset,
streamed) gets a normal reply, with SmolLM2's own template (which cannot express tools) and with a Hermes
template the test writes into a copy of the target; a required call is schema-valid in ar, sd and fsd."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from fsd_local import Engine
from fsd_local.server import BackgroundServer
from support.tool_templates import TEMPLATES, with_template

pytestmark = pytest.mark.real

# Open WebUI's built-in tools as its chat requests list them (names from its 0.12 request; short schemas)
OPEN_WEBUI = [
    ("get_current_timestamp", {}),
    ("calculate_timestamp", {"days_ago": "integer", "weeks_ago": "integer"}),
    ("search_web", {"query": "string", "count": "integer"}),
    ("fetch_url", {"url": "string"}),
    ("search_memories", {"query": "string", "count": "integer"}),
    ("add_memory", {"content": "string"}),
    ("replace_memory_content", {"memory_id": "string", "content": "string"}),
    ("delete_memory", {"memory_id": "string"}),
    ("list_memories", {}),
    ("search_notes", {"query": "string", "count": "integer"}),
    ("view_note", {"note_id": "string"}),
    ("write_note", {"title": "string", "content": "string"}),
    ("replace_note_content", {"note_id": "string", "content": "string"}),
    ("search_chats", {"query": "string", "count": "integer"}),
    ("view_chat", {"chat_id": "string"}),
    ("search_channels", {"query": "string"}),
    ("search_channel_messages", {"channel_id": "string", "query": "string"}),
    ("view_channel_message", {"message_id": "string"}),
    ("view_channel_thread", {"message_id": "string"}),
    ("list_knowledge_bases", {}),
    ("search_knowledge_bases", {"query": "string"}),
    ("query_knowledge_bases", {"query": "string", "count": "integer"}),
    ("search_knowledge_files", {"query": "string"}),
    ("query_knowledge_files", {"query": "string", "file_ids": "array"}),
    ("view_file", {"file_id": "string"}),
    ("view_knowledge_file", {"file_id": "string"}),
    ("generate_image", {"prompt": "string"}),
    ("edit_image", {"prompt": "string", "image_urls": "array"}),
    ("execute_code", {"code": "string"}),
    ("create_calendar_event", {"title": "string", "start": "string", "end": "string", "location": "string"}),
    ("list_calendar_events", {"start": "string", "end": "string"}),
    ("update_calendar_event", {"event_id": "string", "title": "string", "start": "string"}),
    ("delete_calendar_event", {"event_id": "string"}),
    ("list_tasks", {}),
    ("create_task", {"title": "string", "due": "string"}),
    ("complete_task", {"task_id": "string"}),
]


def _param(kind: str) -> dict:
    return {"type": "array", "items": {"type": "string"}} if kind == "array" else {"type": kind}


def open_webui_tools() -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": name.replace("_", " ").capitalize() + ".",
                "parameters": {
                    "type": "object",
                    "properties": {k: _param(v) for k, v in params.items()},
                    "required": [k for k, v in params.items() if v != "integer"],
                },
            },
        }
        for name, params in OPEN_WEBUI
    ]


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}
GET_WEATHER = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": WEATHER},
    }
]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def serve(target: str, draft: str, n_ctx: int = 4096):
    engine = Engine(target=target, draft=draft, n_ctx=n_ctx, n_threads=2, draft_policy="fixed", draft_max=8)
    return engine, BackgroundServer(engine, model_name="demo")


def client_of(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=600)


def streamed(client, **body) -> tuple[str, list, str | None]:
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(model="m", stream=True, **body):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            calls += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def test_open_webui_requests_get_a_normal_reply_from_a_template_without_tools(real_pair):
    engine, srv = serve(real_pair[1], real_pair[0])
    with engine, srv:
        client = client_of(srv)
        tools = open_webui_tools()
        content, calls, finish = streamed(client, messages=ASK, tools=tools, max_tokens=40)
        plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=1)
        raw = client.chat.completions.with_raw_response.create(model="m", messages=ASK, tools=tools, max_tokens=1)
    assert content.strip() and not calls and finish in ("stop", "length")
    assert raw.headers["x-fsd-tools"].startswith("ignored; ")
    r = raw.parse()
    assert r.model_extra["fsd"]["tools"]["offered"] == 36
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens  # the tools are not in the prompt


@pytest.fixture(scope="module")
def hermes_demo(real_pair, tmp_path_factory):
    target = with_template(real_pair[1], tmp_path_factory.mktemp("demo-hermes") / "target.gguf", TEMPLATES["hermes"])
    engine, srv = serve(str(target), real_pair[0], n_ctx=8192)
    with engine, srv:
        yield client_of(srv)


def test_open_webui_requests_get_a_normal_reply_from_a_tools_template(hermes_demo):
    tools = open_webui_tools()
    content, calls, finish = streamed(hermes_demo, messages=ASK, tools=tools, max_tokens=96)
    names = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if calls:  # the model chose a tool: a valid one
        assert finish in ("tool_calls", "length")
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), names[c.function.name])
    else:
        assert content.strip() and "<tool_call>" not in content and finish in ("stop", "length")


@pytest.mark.parametrize("mode", [{"mode": "ar"}, {"mode": "sd"}, {"mode": "fsd", "tau": 0.3}], ids=str)
def test_a_required_call_on_the_demo_pair(hermes_demo, mode):
    body = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 80, "extra_body": mode}
    r = hermes_demo.chat.completions.create(model="m", messages=ASK, tools=GET_WEATHER, **body)
    assert r.choices[0].finish_reason == "tool_calls"
    (c,) = r.choices[0].message.tool_calls
    args = json.loads(c.function.arguments)
    jsonschema.validate(args, WEATHER)
    assert "paris" in args["city"].lower()  # the demo model reads the question
    calls = r.model_extra["fsd"]["tools"]["calls"]
    assert calls["tokens"] == r.usage.completion_tokens
    if mode["mode"] != "ar":  # the call's tokens are highly predictable: most are proposed (drafted, or forced by
        o = calls["origins"]  # its grammar: jump-forward is on for constrained arguments) and accepted
        assert o.get("forced", 0) > 0 and calls["drafted_share"] > 0
        assert (o.get("sd", 0) + o.get("fuzzy", 0) + o["forced"]) / calls["tokens"] > 0.5
