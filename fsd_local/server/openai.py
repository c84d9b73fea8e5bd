"""OpenAI's API on `fsd-local serve` (docs/server.md): /v1/chat/completions and /v1/completions (server-sent events
when streamed, a chunk's new tokens in its `fsd_delta`) and /v1/models; parsed by openai_schema.py, run on the
one request path (request.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response

from fsd_local.results import Completion, Piece
from fsd_local.server import openai_tools
from fsd_local.server.generation import Runner
from fsd_local.server.openai_schema import Reply, parse
from fsd_local.server.request import SSE, check_available, prepare, respond
from fsd_local.server.web import TokenTrail
from fsd_local.tools import ToolPlan

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}")


def install(app: FastAPI, runner: Runner, guarded: list[Any], name: str) -> None:
    """Add OpenAI's routes to the server's app."""
    engine = runner.engine

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        return await _complete(runner, request, "chat", name)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        return await _complete(runner, request, "text", name)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=guarded)
    async def model(model: str) -> dict[str, Any]:
        return _model_card(model)  # one pair answers whatever name a client uses

    def _model_card(model_id: str | None = None) -> dict[str, Any]:
        return {
            "id": model_id or name,
            "object": "model",
            "created": int(Path(engine.target.path).stat().st_mtime),
            "owned_by": "fsd-local",
            "target": engine.target.path,
            "draft": engine.draft.path if engine.draft else None,
        }


async def _complete(runner: Runner, request: Request, kind: Literal["chat", "text"], name: str) -> Response:
    engine = runner.engine
    req = parse(kind, await request.body())
    check_available(engine)
    job = await prepare(engine, req)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    answer = OpenAIAnswer(
        Reply(kind, req.model or name, engine.token_bytes), job.tools, usage, TokenTrail(engine.token_bytes)
    )
    return await respond(runner, request, job, answer, SSE, req.stream)


class OpenAIAnswer:
    """OpenAI's objects of one generation: a response, or the chunks of a stream (a chat's opens with the role,
    the last carries finish_reason, usage and `fsd`; `include_usage` adds OpenAI's usage chunk). On the tools
    path, `tools` shapes them (openai_tools.py)."""

    def __init__(self, reply: Reply, tools: ToolPlan | None, include_usage: bool, trail: TokenTrail):
        self.reply, self.tools, self.include_usage, self.trail = reply, tools, include_usage, trail
        self.streamed = openai_tools.StreamedTools(tools) if tools is not None else None

    def opening(self) -> list[dict[str, Any]]:
        return [self.reply.chunk(role=True)] if self.reply.kind == "chat" else []

    def piece(self, piece: Piece) -> list[dict[str, Any]]:
        if not (piece.text or piece.token_ids):
            return []
        chunk = self.reply.piece_chunk(piece) if self.streamed is None else self.streamed.piece_chunk(self.reply, piece)
        return [{**chunk, "fsd_delta": self.trail.delta(piece)}]

    def closing(self, c: Completion) -> list[dict[str, Any]]:
        last = [self.reply.last_chunk(c)] if self.streamed is None else self.streamed.last_chunks(self.reply, c)
        return [*last, self.reply.usage_chunk(c)] if self.include_usage else last

    def whole(self, c: Completion) -> dict[str, Any]:
        return self.reply.full(c) if self.tools is None else openai_tools.full(self.reply, self.tools, c)
