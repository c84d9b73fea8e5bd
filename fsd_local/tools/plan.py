"""The tools path of one request, for any API (docs/tools.md, "For developers"): tools -> prompt and constraint
(`plan_tools`) -> parsed reply (`ToolPlan.parse`). A template that cannot express tools gets plain chat and
`plan.ignored` says why, unless tool_choice demands a call (a ToolError)."""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsd_local.llama.chat_template import ChatTemplate
from fsd_local.prompting import template_ids
from fsd_local.tools.families import Family, Parsed, detect
from fsd_local.tools.render import render, supports_tools, template_messages
from fsd_local.tools.spec import ToolError, ToolRequest

log = logging.getLogger("fsd_local.tools")


@dataclass
class ToolModel:
    """What the tools path needs of a loaded target: its template, its tokenizer, its tokens' bytes."""

    template: ChatTemplate
    tokenize: Callable[[str, bool], list[int]]  # (text, add_special) -> ids, special tokens parsed
    token_bytes: Callable[[int], bytes]  # special tokens: b""

    def prompt(self, text: str) -> list[int]:
        return template_ids(self.tokenize, self.template, text)  # never a second BOS


@dataclass
class ToolPlan:
    request: ToolRequest
    prompt: list[int]
    family: Family | None = None
    grammar: str | None = None  # the constraint of the reply (None: plain chat)
    ignored: str | None = None  # why the tools were not offered to the model (signalled to the client)
    markers: dict[int, str] = field(default_factory=dict)  # special token id -> the marker it writes
    token_bytes: Callable[[int], bytes] = lambda t: b""
    tools_tokens: int = 0  # prompt tokens the tool definitions take

    @property
    def active(self) -> bool:
        return self.grammar is not None

    def text(self, ids: Sequence[int]) -> str:
        """The reply's text with the markers that are special tokens written out (they render as nothing)."""
        return b"".join(self._bytes(t) for t in ids).decode("utf-8", "replace")

    def _bytes(self, t: int) -> bytes:
        marker = self.markers.get(t)
        return marker.encode() if marker is not None else self.token_bytes(t)

    def parse(self, ids: Sequence[int]) -> Parsed:
        text = self.text(ids)
        if self.family is None:
            return Parsed(text)
        parsed = self.family.parse(text)
        for call in parsed.calls:
            call.id = self.family.new_id()
        return parsed

    def call_tokens(self, ids: Sequence[int]) -> int:
        """The index of the reply's first token inside a tool call (len(ids): none)."""
        if self.family is None:
            return len(ids)
        start = self.family.call_start(self.text(ids))
        if start is None:
            return len(ids)
        decoder, n = codecs.getincrementaldecoder("utf-8")("replace"), 0
        for i, t in enumerate(ids):
            n += len(decoder.decode(self._bytes(t)))
            if n > start:
                return i
        return len(ids)

    def summary(self) -> dict[str, Any]:
        """For the response's extension field: what was offered and how."""
        out: dict[str, Any] = {"offered": len(self.request.tools), "choice": self.request.choice.mode}
        out["family"] = self.family.name if self.family else None
        out["constrained"] = self.active
        out["prompt_tokens"] = self.tools_tokens
        if self.ignored:
            out["ignored"] = self.ignored
        return out


def plan_tools(
    model: ToolModel,
    req: ToolRequest,
    messages: Sequence[Mapping[str, Any]],
    n_ctx: int,
    room: int,
) -> ToolPlan:
    """The prompt (tools rendered by the template) and the constraint for this request."""
    msgs = template_messages(messages)
    if not req.active:
        return ToolPlan(req, model.prompt(render(model.template, msgs, None)), token_bytes=model.token_bytes)
    template = model.template
    family = detect(template.source) if supports_tools(template) else None
    if family is None:
        why = _unusable(template)
        if req.choice.forced:
            raise ToolError(f"tool_choice {req.choice.mode!r} cannot be honoured: {why}", param="tool_choice")
        log.warning("answering without tools: %s", why)
        return ToolPlan(req, model.prompt(render(template, msgs, None)), ignored=why, token_bytes=model.token_bytes)
    ids = model.prompt(render(template, msgs, [t.definition() for t in req.tools]))
    plain = len(model.prompt(render(template, msgs, None)))
    if len(ids) + room > n_ctx and plain + room <= n_ctx:
        raise ToolError(
            f"the {len(req.tools)} tool definitions take {len(ids) - plain} tokens of the prompt (with the chat "
            f"template; the conversation alone takes {plain}): with {room} tokens kept for the reply that is more "
            f"than the context of {n_ctx}; send fewer tools or start the server with a larger --ctx",
            code="context_length_exceeded",
        )
    markers: dict[int, str] = {}
    grammar = family.grammar(req, _lit(model, markers))
    return ToolPlan(req, ids, family, grammar, None, markers, model.token_bytes, len(ids) - plain)


def _unusable(template: ChatTemplate) -> str:
    if template.is_fallback:
        return "the model has no chat template (ChatML is used), so it cannot be shown tools"
    if not supports_tools(template):
        return "the model's chat template does not write tools into the prompt"
    return "the model's chat template writes tool calls in a syntax fsd-local does not parse (docs/tools.md)"


def _lit(model: ToolModel, markers: dict[int, str]) -> Callable[[str], str]:
    """A marker's Lark form: its special token where the vocabulary holds it as one, else the string."""

    def lit(marker: str) -> str:
        ids = model.tokenize(marker, False)
        if len(ids) == 1 and model.token_bytes(ids[0]) == b"":
            markers[ids[0]] = marker
            return f"<[{ids[0]}]>"
        return json.dumps(marker)

    return lit
