"""One request's path, the same for OpenAI's and Ollama's routes: settings and prompt checked before it is queued
(`prepare`), then run on the worker and answered whole or streamed (`respond`), each API writing its own objects
(an `Answer`) and an `Encoder` framing them: server-sent events or one JSON object a line."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from fsd_local.results import CancelToken, Completion, Piece
from fsd_local.server import openai_tools
from fsd_local.server.errors import APIError, as_api_error, error_body
from fsd_local.server.generation import Runner
from fsd_local.server.openai_schema import ChatRequest, CompletionRequest, prompt_tokens, settings_for
from fsd_local.settings import Settings
from fsd_local.tools import ToolPlan

if TYPE_CHECKING:
    from fsd_local.engine_like import EngineLike


def check_available(engine: EngineLike) -> None:
    """503 when the supervisor has given up on the model process (its reason says why)."""
    if engine.state == "failed":
        raise APIError(503, str(engine.reason or ""), type="server_error", code="model_unavailable")


@dataclass
class Job:
    """A validated request, ready for the worker: its prompt, its settings and, on the tools path, its plan."""

    prompt: list[int]
    settings: Settings
    tools: ToolPlan | None = None

    def headers(self) -> dict[str, str] | None:
        return openai_tools.headers(self.tools) if self.tools is not None else None


async def prepare(engine: EngineLike, req: ChatRequest | CompletionRequest) -> Job:
    """The request's settings, then its prompt (tokenising is CPU work: off the event loop); every client error
    is raised here, before anything is queued."""
    settings = settings_for(engine, req)
    if isinstance(req, ChatRequest) and openai_tools.uses_tools(req):
        plan, settings = await run_in_threadpool(openai_tools.plan, engine, req, settings)
        return Job(plan.prompt, settings, plan)
    return Job(await run_in_threadpool(prompt_tokens, engine, req), settings)


class Answer(Protocol):
    """The objects one API writes of a generation: a stream's, in order, or the whole answer's."""

    def opening(self) -> list[dict[str, Any]]: ...

    def piece(self, piece: Piece) -> list[dict[str, Any]]: ...

    def closing(self, c: Completion) -> list[dict[str, Any]]: ...

    def whole(self, c: Completion) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Encoder:
    """How a stream's objects go on the wire; `done` follows the last object of a stream that was not cut short
    by an error."""

    media_type: str
    headers: dict[str, str]
    before: str
    after: str
    done: str = ""

    def encode(self, obj: dict[str, Any]) -> str:
        return self.before + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + self.after


SSE = Encoder(
    "text/event-stream", {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, "data: ", "\n\n", "data: [DONE]\n\n"
)
NDJSON = Encoder("application/x-ndjson", {"Cache-Control": "no-cache"}, "", "\n")


async def respond(
    runner: Runner, request: Request, job: Job, answer: Answer, encoder: Encoder, stream: bool
) -> Response:
    """Run the job on the worker: its objects streamed as they come, or the whole answer (499: the client left
    before it was ready). A client that goes away cancels the generation at its next round."""
    cancel = CancelToken()
    if stream:
        pieces = runner.stream(request.url.path, job.prompt, job.settings, cancel)
        body = _stream(answer, encoder, request.url.path, pieces, cancel)
        return StreamingResponse(
            body, media_type=encoder.media_type, headers={**encoder.headers, **(job.headers() or {})}
        )
    try:
        c = await runner.whole(request, job.prompt, job.settings, cancel)
    except Exception as exc:
        raise as_api_error(exc) from exc
    if c is None:
        return Response(status_code=499)
    return JSONResponse(answer.whole(c), headers=job.headers())


async def _stream(
    answer: Answer, encoder: Encoder, path: str, pieces: asyncio.Queue, cancel: CancelToken
) -> AsyncIterator[str]:
    """The stream's objects, encoded; an error that ends the generation is its last object, in the route's error
    shape (the clients raise it)."""
    try:
        for obj in answer.opening():
            yield encoder.encode(obj)
        while True:
            item = await pieces.get()
            if isinstance(item, BaseException):
                yield encoder.encode(error_body(path, as_api_error(item)))
                return
            for obj in answer.piece(item):
                yield encoder.encode(obj)
            if item.completion is not None:
                for obj in answer.closing(item.completion):
                    yield encoder.encode(obj)
                if encoder.done:
                    yield encoder.done
                return
    finally:  # normal end, or the client disconnected (Starlette cancels the stream): stop the generation
        cancel.cancel()
