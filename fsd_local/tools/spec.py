"""Tool definitions and tool_choice read from a request (OpenAI's and Ollama's shapes are the same) and checked once:
`parameters` must be a JSON schema object the constraint can compile (left out: no arguments); every refusal is a
`ToolError` naming the request field at fault, so each API renders it in its own error shape."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from fsd_local.errors import ConfigError

NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI's function names (plus '.' and ':', as MCP tools use)
NO_ARGUMENTS = {"type": "object", "properties": {}}


class ToolError(ConfigError):
    """A request's tools, tool_choice or tool messages cannot be used; `param` names the request field."""

    def __init__(self, message: str, param: str = "tools", code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # the JSON schema of the arguments object

    def definition(self) -> dict[str, Any]:
        """The definition as chat templates receive it (transformers' and llama.cpp's convention)."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str | None = None  # the function of mode 'named'

    @property
    def forced(self) -> bool:
        """A call must come from the reply's first token on."""
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tools: the definitions, the choice and whether one reply may hold several calls."""

    tools: tuple[Tool, ...] = ()
    choice: ToolChoice = field(default_factory=ToolChoice)
    parallel: bool = True

    @property
    def active(self) -> bool:
        """The model is offered tools (none offered, or tool_choice 'none': a plain reply)."""
        return bool(self.tools) and self.choice.mode != "none"

    def offered(self) -> tuple[Tool, ...]:
        """The tools a call may name (a named choice: that one)."""
        if self.choice.mode == "named":
            return tuple(t for t in self.tools if t.name == self.choice.name)
        return self.tools


def parse_tools(raw: Any) -> tuple[Tool, ...]:
    """The request's `tools` list, checked: each a function with a name and a usable schema."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ToolError("tools must be a list of {'type': 'function', 'function': {...}} objects")
    tools: list[Tool] = []
    for i, entry in enumerate(raw):
        tool = _tool(i, entry)
        if any(t.name == tool.name for t in tools):
            raise ToolError(f"tools.{i}: a second function named {tool.name!r}; names must be unique")
        tools.append(tool)
    return tuple(tools)


def _tool(i: int, entry: Any) -> Tool:
    where = f"tools.{i}"
    if not isinstance(entry, dict) or entry.get("type", "function") != "function":
        kind = entry.get("type") if isinstance(entry, dict) else type(entry).__name__
        raise ToolError(f"{where}: only function tools are supported ({{'type': 'function', ...}}), got {kind!r}")
    fn = entry.get("function")
    if not isinstance(fn, dict):
        raise ToolError(f"{where}: no 'function' object: give {{'name', 'description', 'parameters'}}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ToolError(f"{where}.function.name must be 1 to 64 letters, digits, '_', '-', '.' or ':', got {name!r}")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise ToolError(f"{where}.function.description must be a string")
    params = fn.get("parameters")
    if params is None:
        params = dict(NO_ARGUMENTS)
    if not isinstance(params, dict):
        raise ToolError(
            f"{where}.function.parameters of {name!r} must be a JSON schema object (e.g. {{'type': 'object', "
            f"'properties': {{...}}}}), got {type(params).__name__}: the arguments need a schema to be checked"
        )
    _check_schema(where, name, params)
    return Tool(name, description, params)


def _check_schema(where: str, name: str, params: dict[str, Any]) -> None:
    from fsd_local.constrain import compile_grammar

    if params.get("type", "object") != "object":
        raise ToolError(f"{where}.function.parameters of {name!r}: the arguments are an object, not {params['type']!r}")
    try:
        compile_grammar(None, json.dumps(params, sort_keys=True))
    except ConfigError as exc:
        raise ToolError(f"{where}.function.parameters of {name!r} is not a usable JSON schema: {exc}") from None


def parse_tool_choice(raw: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    """auto (the default) | none | required | {'type': 'function', 'function': {'name': ...}}."""
    if raw is None:
        return ToolChoice("auto")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise ToolError(
                f"tool_choice {raw!r}: one of 'auto', 'none', 'required' or {{'type': 'function', 'function': "
                "{'name': ...}}",
                param="tool_choice",
            )
        choice = ToolChoice(raw)  # type: ignore[arg-type]  # checked just above
    else:
        fn = raw.get("function") if isinstance(raw, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ToolError(
                "tool_choice: name the function as {'type': 'function', 'function': {'name': ...}}", param="tool_choice"
            )
        if name not in {t.name for t in tools}:
            known = ", ".join(t.name for t in tools) or "none"
            raise ToolError(f"tool_choice names {name!r}, which is not in tools (given: {known})", param="tool_choice")
        choice = ToolChoice("named", name)
    if choice.forced and not tools:
        raise ToolError(f"tool_choice {choice.mode!r} needs tools: give the functions in tools", param="tool_choice")
    return choice


def tool_request(tools: Any, tool_choice: Any = None, parallel: bool | None = None) -> ToolRequest:
    """A request's three tool fields, checked together."""
    parsed = parse_tools(tools)
    return ToolRequest(parsed, parse_tool_choice(tool_choice, parsed), True if parallel is None else bool(parallel))
