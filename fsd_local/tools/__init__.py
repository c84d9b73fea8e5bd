"""Tool calling for any API: definitions and tool_choice (spec), the template families' call syntax and
grammar (families), rendering through the model's chat template (render), one request's plan (plan), and a
streamed reply's content and calls (stream). docs/tools.md describes the behaviour."""

from fsd_local.tools.families import Call, Family, Parsed, detect
from fsd_local.tools.plan import ToolModel, ToolPlan, plan_tools
from fsd_local.tools.spec import Tool, ToolChoice, ToolError, ToolRequest, tool_request
from fsd_local.tools.stream import ToolStream, call_stats

__all__ = [
    "Call",
    "Family",
    "Parsed",
    "Tool",
    "ToolChoice",
    "ToolError",
    "ToolModel",
    "ToolPlan",
    "ToolRequest",
    "ToolStream",
    "call_stats",
    "detect",
    "plan_tools",
    "tool_request",
]
