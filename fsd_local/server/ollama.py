"""Ollama's API on `fsd-local serve` (docs/server.md): /api/chat and /api/generate (NDJSON streams by default),
/api/tags, /api/show, /api/ps and /api/version; a request is translated to the OpenAI request it means
(ollama_schema.py) and runs on the same path (request.py), its errors in Ollama's shape."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fsd_local.results import Completion, Piece
from fsd_local.server import ollama_models, ollama_tools
from fsd_local.server.errors import APIError
from fsd_local.server.generation import Runner
from fsd_local.server.ollama_schema import OLLAMA_VERSION, OllamaReply, parse_body, translate
from fsd_local.server.request import NDJSON, check_available, prepare, respond
from fsd_local.settings import Settings
from fsd_local.tools import ToolPlan

ROUTES = ("/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/ps", "/api/version")
# Ollama's routes that manage models or compute embeddings: fsd-local serves the pair it was started with
MANAGING = ("pull", "push", "create", "delete", "copy", "blobs")
EMBEDDING = ("embed", "embeddings")


def install(app: FastAPI, runner: Runner, guarded: list[Any], name: str) -> None:
    """Add Ollama's routes to the server's app."""
    engine = runner.engine

    @app.get("/api/version")
    @app.head("/api/version", include_in_schema=False)
    async def version() -> dict[str, str]:
        from fsd_local import __version__

        return {"version": OLLAMA_VERSION, "fsd_local": __version__}

    @app.head("/", include_in_schema=False)
    async def alive() -> Response:  # Ollama's clients probe the root with HEAD
        return Response(status_code=200)

    @app.get("/api/tags", dependencies=guarded)
    async def tags() -> dict[str, Any]:
        return {"models": [ollama_models.tag(engine, name)]}

    @app.get("/api/ps", dependencies=guarded)
    async def ps() -> dict[str, Any]:
        worker = runner.worker
        return {"models": [ollama_models.running(engine, name, worker.report(), worker.waiting)]}

    @app.post("/api/show", dependencies=guarded)
    async def show(request: Request) -> dict[str, Any]:
        body = _json_object(await request.body())
        model = body.get("model") or body.get("name")  # `name`: older clients
        if not isinstance(model, str) or not model:
            raise APIError(400, 'model is required: send {"model": "<name>"}')
        return ollama_models.show(engine)  # one pair answers whatever name a client uses

    @app.post("/api/chat", dependencies=guarded)
    async def chat(request: Request) -> Response:
        return await _answer(runner, request, "chat")

    @app.post("/api/generate", dependencies=guarded)
    async def generate(request: Request) -> Response:
        return await _answer(runner, request, "generate")

    @app.api_route("/api/{rest:path}", methods=["GET", "POST", "DELETE", "PUT", "HEAD"], include_in_schema=False)
    async def elsewhere(rest: str) -> Response:
        first = rest.split("/", 1)[0]
        if first in MANAGING:
            raise APIError(
                501,
                f"/api/{first} is not available: fsd-local serves the draft/target pair it was started with and does "
                "not manage models; restart `fsd-local serve` with --target (and --draft) to serve others",
            )
        if first in EMBEDDING:
            raise APIError(501, f"/api/{first} is not available: fsd-local generates text and computes no embeddings")
        raise APIError(404, f"no route /api/{rest}: Ollama's routes here are {', '.join(ROUTES)}")


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


async def _answer(runner: Runner, request: Request, route: Literal["chat", "generate"]) -> Response:
    started = time.perf_counter()
    engine = runner.engine
    body = parse_body("chat" if route == "chat" else "text", await request.body())
    check_available(engine)
    asked = translate(body, engine.defaults, engine.target.n_ctx)
    reply = OllamaReply(route, body.model, started, asked.ignored, engine.token_bytes)
    stream = asked.request.stream
    if asked.empty:  # Ollama's way to load a model: it is loaded
        loaded = reply.loaded()
        return Response(NDJSON.encode(loaded), media_type=NDJSON.media_type) if stream else JSONResponse(loaded)
    job = await prepare(engine, asked.request)
    job.settings = _within(job.settings, len(job.prompt), asked.num_ctx)
    return await respond(runner, request, job, OllamaAnswer(reply, job.tools), NDJSON, stream)


def _within(settings: Settings, prompt_len: int, num_ctx: int | None) -> Settings:
    """A request's own, smaller context (options.num_ctx): prompt and reply must fit in it."""
    if num_ctx is None:
        return settings
    room = num_ctx - prompt_len
    if room <= 0:
        why = f"the prompt is {prompt_len} tokens: options.num_ctx={num_ctx} leaves no room for a reply"
        raise APIError(400, why + "; raise num_ctx or shorten the prompt")
    return settings.with_(max_tokens=min(settings.max_tokens, room))


class OllamaAnswer:
    """Ollama's objects of one generation: each piece's text, then the final object with the counters (`whole`: the
    answer in one object). With tools, a call is never sent as text: the calls come in one chunk once complete,
    before the final object."""

    def __init__(self, reply: OllamaReply, tools: ToolPlan | None):
        self.reply, self.tools = reply, tools
        self.streamed = ollama_tools.Streamed(tools) if tools is not None else None

    def opening(self) -> list[dict[str, Any]]:
        return []

    def piece(self, piece: Piece) -> list[dict[str, Any]]:
        text = piece.text if self.streamed is None else self.streamed.content(piece)
        return [self.reply.chunk(text, piece)] if text or (piece.token_ids and piece.logprobs is not None) else []

    def closing(self, c: Completion) -> list[dict[str, Any]]:
        if self.streamed is None:
            return [self.reply.final(c)]
        rest, calls = self.streamed.rest(c)
        out = [self._with_calls(self.reply.chunk(rest), calls, c)] if rest or calls else []
        return [*out, self._with_calls(self.reply.final(c), [], c)]

    def whole(self, c: Completion) -> dict[str, Any]:
        if self.tools is None:
            return self.reply.final(c, c.text, whole=True)
        content, calls = ollama_tools.message(self.tools, c)
        return self._with_calls(self.reply.final(c, content, whole=True), calls, c)

    def _with_calls(self, out: dict[str, Any], calls: list[dict[str, Any]], c: Completion) -> dict[str, Any]:
        """A chunk with the reply's tool calls (Ollama's shape) and, on the final one, fsd.tools."""
        assert self.tools is not None, "only the tools path has calls"
        if calls:
            out["message"]["tool_calls"] = calls
        if "fsd" in out:
            out["fsd"]["tools"] = ollama_tools.fsd_tools(self.tools, c, out["fsd"])
        return out
