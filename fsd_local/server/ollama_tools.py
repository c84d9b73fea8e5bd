"""Tool calling on Ollama's /api/chat (docs/tools.md): the plan is the OpenAI route's (openai_tools.plan); only the
reply is shaped here, with the arguments as an object, and a stream's calls come in one chunk once complete."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsd_local.llama.chat_template import ChatTemplate
from fsd_local.server.openai_tools import extension
from fsd_local.tools import Parsed, ToolPlan, ToolStream, detect
from fsd_local.tools.render import supports_tools

if TYPE_CHECKING:
    from fsd_local.engine_like import EngineLike
    from fsd_local.results import Completion, Piece


def can_call_tools(engine: EngineLike) -> bool:
    """Whether /api/show lists the `tools` capability: the target's template writes tools and its calls parse."""
    from fsd_local.server.openai_tools import tool_model

    template: ChatTemplate = tool_model(engine).template
    return supports_tools(template) and detect(template.source) is not None


def calls(parsed: Parsed) -> list[dict[str, Any]]:
    return [{"function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]


def message(plan: ToolPlan, c: Completion) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole reply."""
    parsed = plan.parse(c.token_ids) if plan.active else Parsed(c.text)
    return (parsed.content or "", calls(parsed)) if parsed.calls else (c.text, [])


class Streamed:
    """The content of each streamed piece, then the calls."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.stream = plan, ToolStream(plan)

    def content(self, piece: Piece) -> str:
        return self.stream.content(piece.text, piece.token_ids) if self.plan.active else piece.text

    def rest(self, c: Completion) -> tuple[str, list[dict[str, Any]]]:
        """(the content not sent yet, the calls) once the reply is complete."""
        if not self.plan.active:
            return "", []
        rest, parsed = self.stream.finish(c.text, c.token_ids)
        return rest, calls(parsed)


def fsd_tools(plan: ToolPlan, c: Completion, fsd: dict[str, Any]) -> dict[str, Any]:
    """The final chunk's fsd.tools (as the OpenAI route's)."""
    return extension(plan, c, fsd)
