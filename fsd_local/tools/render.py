"""A conversation with tools -> the prompt, through the model's own chat template: OpenAI's JSON-text arguments are
parsed back into the objects templates expect (as llama.cpp does), and a template that renders the same text with
and without a probe tool cannot express tools (llama.cpp's capability test)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from fsd_local.errors import ConfigError
from fsd_local.llama.chat_template import ChatTemplate
from fsd_local.tools.spec import ToolError

PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "fsd_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
    },
}


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates expect them: content a string, tool calls with object arguments and an id."""
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        calls = m.get("tool_calls")
        if calls:
            msg["tool_calls"] = [_template_call(i, j, c) for j, c in enumerate(calls)]
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    return out


def _template_call(i: int, j: int, call: Any) -> dict[str, Any]:
    where = f"messages.{i}.tool_calls.{j}"
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ToolError(
            f"{where}: a tool call is {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", "messages"
        )
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ToolError(f"{where}.function.arguments is not valid JSON: {args[:80]!r}", "messages") from None
    if not isinstance(args, Mapping):
        raise ToolError(f"{where}.function.arguments must be a JSON object", "messages")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": dict(args)}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def supports_tools(template: ChatTemplate) -> bool:
    """Whether the template writes the tools it is given into the prompt."""
    known = getattr(template, "_supports_tools", None)
    if known is None:
        if template.is_fallback:
            known = False
        else:
            convo = [{"role": "user", "content": "hi"}]
            try:
                known = template.render(convo, tools=[PROBE_TOOL]) != template.render(convo)
            except ConfigError:
                known = False
        template._supports_tools = known  # type: ignore[attr-defined]  # cached on the instance
    return bool(known)


def render(template: ChatTemplate, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    return template.render(messages, add_generation_prompt=True, tools=tools)
