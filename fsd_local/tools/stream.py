"""A streamed reply with tools: its content is released as soon as it cannot be the start of a tool call, the
calls themselves once the reply is complete (a call's JSON is only known to be whole at its end)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fsd_local.tools.families import Parsed
from fsd_local.tools.plan import ToolPlan


class ToolStream:
    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.ids: list[int] = []
        self.shown = ""  # the pieces' text (a stop string already held back)
        self.released = 0  # characters of it sent as content

    def content(self, text: str, token_ids: Sequence[int]) -> str:
        """The content to send for one piece ('' while the text may still open a call)."""
        self.ids.extend(token_ids)
        self.shown += text
        family = self.plan.family
        if family is None:
            safe = len(self.shown)
        else:
            safe = min(len(self.shown), family.releasable(self.plan.text(self.ids)))
        out = self.shown[self.released : max(safe, self.released)]
        self.released = max(safe, self.released)
        return out

    def finish(self, text: str, token_ids: Sequence[int]) -> tuple[str, Parsed]:
        """(the content not sent yet, the parsed reply) once the reply is complete."""
        parsed = self.plan.parse(token_ids)
        if parsed.calls:
            family = self.plan.family
            assert family is not None
            full = self.plan.text(token_ids)
            start = family.call_start(full)
            content = full[: start if start is not None else len(full)]
        else:
            content = text
        return content[self.released :], parsed


def call_stats(plan: ToolPlan, token_ids: Sequence[int], origins: Sequence[str]) -> dict[str, Any]:
    """How the tokens inside the reply's tool calls came to be: their number and origins (target / sd / fuzzy /
    forced), and the share of them that were drafted and accepted (forced tokens are the grammar's, not drafted)."""
    first = plan.call_tokens(token_ids)
    inside = list(origins[first:])
    counts = {o: inside.count(o) for o in sorted(set(inside))}
    drafted = sum(n for o, n in counts.items() if o in ("sd", "fuzzy"))
    return {"tokens": len(inside), "origins": counts, "drafted_share": drafted / len(inside) if inside else None}
