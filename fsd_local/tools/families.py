"""The tool-call syntaxes of the template families (hermes, llama3, mistral, mistral-args: docs/tools.md): for each,
the llguidance Lark grammar that constrains a call, from its first token or after the family's trigger, and the
parse back; a `Lit` writes a marker as a string literal or, held as one special token, as that token (`<[id]>`)."""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsd_local.tools.spec import Tool, ToolRequest

Lit = Callable[[str], str]  # a marker string -> its Lark form (a string literal, or <[id]> for a special token)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TEXT = "TEXT: /(.|\\n)*/"


@dataclass
class Call:
    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass
class Parsed:
    content: str | None
    calls: list[Call] = field(default_factory=list)
    malformed: bool = False  # a call was opened but does not parse: the reply is kept as content
    truncated: bool = False  # the last call was cut short (max_tokens): the whole calls before it are kept


def closed(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that does not say (llama.cpp's default for
    tool arguments: a call names the parameters its function declares, and a small model cannot ramble on in
    extra keys)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k not in ("const", "enum", "default", "examples") else v for k, v in schema.items()}
    if "properties" in out and isinstance(out["properties"], dict):
        out["properties"] = {k: closed(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in out and "patternProperties" not in out:
            out["additionalProperties"] = False
    return out


def call_schema(tools: tuple[Tool, ...], args_key: str) -> dict[str, Any]:
    """One call object of any of these tools: {"name": const, args_key: the tool's parameters}."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, args_key: closed(t.parameters)},
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def _head(lit: Lit, trigger: str) -> str:
    """The auto mode's free text up to the trigger: lazy (ends at the trigger's first appearance), or followed by
    the trigger's special token (which text cannot contain)."""
    form = lit(trigger)
    return f"head: TEXT {form}" if form.startswith("<[") else f"head[lazy]: TEXT {form}"


def _suffix_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (text that may still become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class Family:
    name = ""
    trigger = ""  # what opens a call in free text
    args_key = "arguments"

    def grammar(self, req: ToolRequest, lit: Lit) -> str:
        raise NotImplementedError

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Where in the reply the first call begins (None: no call yet)."""
        i = text.find(self.trigger)
        return None if i < 0 else i

    def releasable(self, text: str) -> int:
        """How much of a reply being streamed is content for sure (text after it may still open a call)."""
        start = self.call_start(text)
        return start if start is not None else len(text) - _suffix_prefix(text, self.trigger)

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def _content(self, text: str, start: int) -> str | None:
        return text[:start].strip() or None

    def _start(self, req: ToolRequest, lit: Lit, calls: str) -> str:
        """The start rule: the calls from the first token (forced), or free text until the trigger (auto)."""
        if req.choice.forced:
            return f"start: {lit(self.trigger)} {calls}"
        return f"start: TEXT | head {calls}\n{_head(lit, self.trigger)}"

    def _blocks(self, text: str, start: int, one: Callable[[str], Call | None]) -> Parsed:
        """The calls of a reply written as one block per call, each opened by the trigger."""
        calls: list[Call] = []
        blocks = text[start:].split(self.trigger)[1:]
        for i, block in enumerate(blocks):
            call = one(block)
            if call is None:
                if i == len(blocks) - 1 and calls:  # cut short after whole calls
                    return Parsed(self._content(text, start), calls, truncated=True)
                return Parsed(text, malformed=True)
            calls.append(call)
        return Parsed(self._content(text, start), calls)


class Hermes(Family):
    name, trigger = "hermes", "<tool_call>"
    close = "</tool_call>"

    def grammar(self, req: ToolRequest, lit: Lit) -> str:
        body = _json(call_schema(req.offered(), self.args_key))
        more = f' ("\\n" {lit(self.trigger)} call)*' if req.parallel else ""
        start = self._start(req, lit, "call" + more)
        return f'%llguidance {{}}\n{start}\ncall: "\\n" body "\\n" {lit(self.close)}\nbody: {body}\n{TEXT}\n'

    def parse(self, text: str) -> Parsed:
        start = self.call_start(text)
        return Parsed(text) if start is None else self._blocks(text, start, self._one)

    def _one(self, block: str) -> Call | None:
        inner, closed, _ = block.partition(self.close)
        return _call(inner, self.args_key) if closed else None


class Mistral(Family):
    name, trigger = "mistral", "[TOOL_CALLS]"

    def grammar(self, req: ToolRequest, lit: Lit) -> str:
        schema = {"type": "array", "items": call_schema(req.offered(), self.args_key), "minItems": 1}
        if not req.parallel:
            schema["maxItems"] = 1
        return f"%llguidance {{}}\n{self._start(req, lit, 'calls')}\ncalls: {_json(schema)}\n{TEXT}\n"

    def parse(self, text: str) -> Parsed:
        start = self.call_start(text)
        if start is None:
            return Parsed(text)
        body = text[start + len(self.trigger) :].strip()
        items, whole = _objects(body[1:] if body.startswith("[") else body, ",")
        calls = [_as_call(item, self.args_key) for item in items]
        if not calls or any(c is None for c in calls):
            return Parsed(text, malformed=True)
        complete = whole.strip() == "]" if body.startswith("[") else not whole.strip()
        return Parsed(self._content(text, start), [c for c in calls if c is not None], truncated=not complete)

    def new_id(self) -> str:
        # Mistral's templates require 9 letters and digits
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class MistralArgs(Mistral):
    name, args = "mistral-args", "[ARGS]"

    def grammar(self, req: ToolRequest, lit: Lit) -> str:
        tools = req.offered()
        rules = [
            f"call_{i}: {json.dumps(t.name)} {lit(self.args)} {_json(closed(t.parameters))}"
            for i, t in enumerate(tools)
        ]
        start = self._start(req, lit, "call" + (f" ({lit(self.trigger)} call)*" if req.parallel else ""))
        calls = " | ".join(f"call_{i}" for i in range(len(tools)))
        return f"%llguidance {{}}\n{start}\ncall: {calls}\n" + "\n".join(rules) + f"\n{TEXT}\n"

    def parse(self, text: str) -> Parsed:
        start = self.call_start(text)
        return Parsed(text) if start is None else self._blocks(text, start, self._one)

    def _one(self, block: str) -> Call | None:
        name, sep, rest = block.partition(self.args)
        args, tail = _objects(rest, "\0")
        if not sep or len(args) != 1 or not isinstance(args[0], dict) or tail.strip():
            return None
        return Call(name.strip(), args[0])


class Llama3(Family):
    """The JSON form: the reply is the call (free text must not start with '{')."""

    name, trigger, args_key = "llama3", "{", "parameters"
    python_tag = "<|python_tag|>"

    def grammar(self, req: ToolRequest, lit: Lit) -> str:
        tag = lit(self.python_tag)
        tag = f" {tag}?" if tag.startswith("<[") else ""  # the tag only where it is a token of its own
        body = _json(call_schema(req.offered(), self.args_key))
        if req.choice.forced:
            start = f"start:{tag} body"
        else:
            start = f"start: TEXT | WS?{tag} body\nWS: /\\s+/"
        return f"%llguidance {{}}\n{start}\nbody: {body}\nTEXT: /\\s*([^{{\\s](.|\\n)*)?/\n"

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.python_tag) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def releasable(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or self.python_tag.startswith(stripped[: len(self.python_tag)]):
            return 0  # nothing yet, or maybe the tag: wait
        return 0 if stripped.startswith("{") else len(text)

    def parse(self, text: str) -> Parsed:
        start = self.call_start(text)
        if start is None:
            return Parsed(text)
        body = text[start:].removeprefix(self.python_tag).strip()
        items, rest = _objects(body, ";")  # several calls: joined by ';'
        calls = [_as_call(item, self.args_key) for item in items]
        if not calls or any(c is None for c in calls):
            return Parsed(text, malformed=True)
        return Parsed(None, [c for c in calls if c is not None], truncated=bool(rest.strip()))


def _objects(text: str, sep: str) -> tuple[list[Any], str]:
    """The JSON values at the start of `text`, separated by `sep`, and what follows the last whole one."""
    decoder, i = json.JSONDecoder(), 0
    items: list[Any] = []
    while True:
        j = len(text) - len(text[i:].lstrip())
        try:
            value, end = decoder.raw_decode(text, j)
        except ValueError:
            return items, text[i:]
        items.append(value)
        rest = text[end:].lstrip()
        if not rest.startswith(sep):
            return items, rest
        i = len(text) - len(rest) + len(sep)


def _call(text: str, args_key: str) -> Call | None:
    try:
        return _as_call(json.loads(text.strip()), args_key)
    except ValueError:
        return None


def _as_call(obj: Any, args_key: str) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return Call(obj["name"], args) if isinstance(args, dict) else None


FAMILIES: tuple[Family, ...] = (Hermes(), Mistral(), Llama3(), MistralArgs())


def detect(source: str) -> Family | None:
    """The family whose syntax a chat template writes tool calls in (None: none that fsd-local knows)."""
    if "<tool_call>" in source:
        return FAMILIES[0]
    if "[TOOL_CALLS]" in source:
        return FAMILIES[3] if "[ARGS]" in source else FAMILIES[1]
    if "<|start_header_id|>" in source and ("parameters" in source or "<|python_tag|>" in source):
        return FAMILIES[2]
    return None
