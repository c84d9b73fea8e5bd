"""Tool calling on OpenAI's chat route (docs/tools.md): `tools`, `tool_choice` and tool messages in, `tool_calls` out;
fsd_local/tools does the work, this module speaks OpenAI's shapes. Tools the template cannot express are answered
as plain chat, said in the `X-FSD-Tools` header and `fsd.tools.ignored`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsd_local.conversation import reply_room
from fsd_local.errors import ConfigError
from fsd_local.prompting import loaded_context, splice
from fsd_local.server.errors import APIError
from fsd_local.server.openai_schema import ChatRequest, Reply, check_prompt, plain_message
from fsd_local.tools import Parsed, ToolError, ToolModel, ToolPlan, ToolStream, call_stats, plan_tools, tool_request

if TYPE_CHECKING:
    from fsd_local.engine_like import EngineLike
    from fsd_local.results import Completion, Piece
    from fsd_local.settings import Settings

HEADER = "X-FSD-Tools"


def uses_tools(req: ChatRequest) -> bool:
    """The request offers tools or its conversation holds tool calls or results (the template renders those)."""
    return bool(req.tools) or req.tool_choice is not None or any(m.tool_calls or m.role == "tool" for m in req.messages)


def tool_model(engine: EngineLike) -> ToolModel:
    return ToolModel(
        engine.chat_template(), lambda text, special: engine.tokenize(text, add_special=special), engine.token_bytes
    )


def api_error(exc: ConfigError) -> APIError:
    if isinstance(exc, ToolError):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    return APIError(400, str(exc), param="messages", code="invalid_value")


def plan(engine: EngineLike, req: ChatRequest, settings: Settings) -> tuple[ToolPlan, Settings]:
    """The request's prompt (checked like any prompt) and its settings with the tool-call constraint."""
    try:
        wanted = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)
        messages = [_message(i, m) for i, m in enumerate(req.messages)]
        n_ctx = loaded_context(engine)
        p = plan_tools(tool_model(engine), wanted, messages, n_ctx, reply_room(settings.max_tokens, n_ctx))
    except ConfigError as exc:
        raise api_error(exc) from None
    p.prompt = check_prompt(engine, splice(engine, p.prompt), "messages")  # the prompt contract, as chat_prompt
    if p.grammar is not None:
        if settings.grammar is not None or settings.json_schema is not None:
            raise APIError(
                400,
                "tools cannot be combined with response_format, json_schema or grammar: a tool call is constrained "
                "by its own schema; drop one of them (or send tool_choice 'none')",
                param="tools",
                code="invalid_value",
            )
        settings = settings.with_(grammar=p.grammar)
    return p, settings


def _message(i: int, m: Any) -> dict[str, Any]:
    out: dict[str, Any] = dict(plain_message(i, m))
    if m.tool_calls:
        out["tool_calls"] = m.tool_calls
    for key in ("tool_call_id", "name"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def headers(p: ToolPlan) -> dict[str, str] | None:
    if p.ignored:
        return {HEADER: "ignored; " + p.ignored.encode("ascii", "replace").decode()}
    return {HEADER: f"{p.family.name if p.family else 'none'}; {p.request.choice.mode}"} if p.active else None


def wire_calls(parsed: Parsed) -> list[dict[str, Any]]:
    return [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in parsed.calls
    ]


def finish_reason(parsed: Parsed, c: Completion) -> str | None:
    """tool_calls, or the completion's own reason when the last call was cut short (length: the whole calls
    before it are still returned)."""
    return c.finish_reason if parsed.truncated else "tool_calls"


def extension(p: ToolPlan, c: Completion, fsd: dict[str, Any]) -> dict[str, Any]:
    """fsd.tools; the tool-call grammar is left out of fsd.settings (the request did not send it)."""
    if p.active and fsd.get("settings"):
        fsd["settings"] = {**fsd["settings"], "grammar": None}
    out = p.summary()
    if p.active:
        out["calls"] = call_stats(p, c.token_ids, c.origins)
    return out


def full(reply: Reply, p: ToolPlan, c: Completion) -> dict[str, Any]:
    """The response object of a request on the tools path."""
    out = reply.full(c)
    choice = out["choices"][0]
    parsed = p.parse(c.token_ids) if p.active else Parsed(c.text)
    if parsed.calls:
        choice["message"] = {"role": "assistant", "content": parsed.content, "tool_calls": wire_calls(parsed)}
        choice["finish_reason"] = finish_reason(parsed, c)
    out["fsd"]["tools"] = extension(p, c, out["fsd"])
    return out


@dataclass
class StreamedTools:
    """The chunks of a streamed reply on the tools path (app._events asks for them)."""

    plan: ToolPlan

    def __post_init__(self) -> None:
        self.stream = ToolStream(self.plan)

    def piece_chunk(self, reply: Reply, piece: Piece) -> dict[str, Any]:
        out = reply.piece_chunk(piece)
        text = self.stream.content(piece.text, piece.token_ids) if self.plan.active else piece.text
        out["choices"][0]["delta"] = {"content": text} if text else {}
        return out

    def last_chunks(self, reply: Reply, c: Completion) -> list[dict[str, Any]]:
        """The content still held back, the calls (one delta each, whole), then the chunk with finish_reason."""
        chunks = []
        last = reply.last_chunk(c)
        if self.plan.active:
            rest, parsed = self.stream.finish(c.text, c.token_ids)
            if rest:
                chunks.append(reply.chunk(rest))
            for i, call in enumerate(wire_calls(parsed)):
                chunk = reply.chunk()
                chunk["choices"][0]["delta"] = {"tool_calls": [{"index": i, **call}]}
                chunks.append(chunk)
            if parsed.calls:
                last["choices"][0]["finish_reason"] = finish_reason(parsed, c)
        last["fsd"]["tools"] = extension(self.plan, c, last["fsd"])
        return [*chunks, last]
