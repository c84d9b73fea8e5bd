"""Ollama's API on `fsd-local serve` (docs/server.md): /api/chat and /api/generate (NDJSON streams by default),
/api/tags, /api/show, /api/ps and /api/version, next to the OpenAI routes on the same port, with the same
engine, API key and queue. A request is translated to the OpenAI request it means (ollama_schema.py) and
validated by the same code; errors answer in Ollama's shape, {"error": "..."}, with its status codes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from fsd_local.results import CancelToken, Completion
from fsd_local.server import ollama_models, ollama_tools, openai_tools
from fsd_local.server.generation import Runner, as_api_error, check_available
from fsd_local.server.ollama_schema import OLLAMA_VERSION, OllamaReply, parse_body, translate
from fsd_local.server.openai_schema import APIError, ChatRequest, prompt_tokens, settings_for
from fsd_local.settings import Settings
from fsd_local.tools import ToolPlan

ROUTES = ("/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/ps", "/api/version")
NDJSON = "application/x-ndjson"
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
        return {"models": [ollama_models.running(engine, name)]}

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
        return _single(reply.loaded(), stream)
    settings = settings_for(engine, asked.request)
    tools = None  # the tools path (openai_tools.py): tools offered, or tool calls and results in the messages
    if isinstance(asked.request, ChatRequest) and openai_tools.uses_tools(asked.request):
        tools, settings = await run_in_threadpool(openai_tools.plan, engine, asked.request, settings)
        prompt = tools.prompt
    else:
        prompt = await run_in_threadpool(prompt_tokens, engine, asked.request)  # tokenising is CPU work
    settings = _within(settings, len(prompt), asked.num_ctx)
    headers = openai_tools.headers(tools) if tools is not None else None
    cancel = CancelToken()
    if stream:
        pieces = runner.stream(prompt, settings, cancel)
        return StreamingResponse(
            _ndjson(reply, pieces, cancel, tools),
            media_type=NDJSON,
            headers={"Cache-Control": "no-cache", **(headers or {})},
        )
    try:
        c = await runner.whole(request, prompt, settings, cancel)
    except Exception as exc:
        raise as_api_error(exc) from exc
    if c is None:  # the client left
        return Response(status_code=499)
    if tools is None:
        return JSONResponse(reply.final(c, c.text, whole=True))
    content, calls = ollama_tools.message(tools, c)
    return JSONResponse(_with_calls(reply.final(c, content, whole=True), calls, tools, c), headers=headers)


def _with_calls(out: dict[str, Any], calls: list[dict[str, Any]], plan: ToolPlan, c: Completion) -> dict[str, Any]:
    """A chunk with the reply's tool calls (Ollama's shape) and, on the final one, fsd.tools."""
    if calls:
        out["message"]["tool_calls"] = calls
    if "fsd" in out:
        out["fsd"]["tools"] = ollama_tools.fsd_tools(plan, c, out["fsd"])
    return out


def _within(settings: Settings, prompt_len: int, num_ctx: int | None) -> Settings:
    """A request's own, smaller context (options.num_ctx): prompt and reply must fit in it."""
    if num_ctx is None:
        return settings
    room = num_ctx - prompt_len
    if room <= 0:
        why = f"the prompt is {prompt_len} tokens: options.num_ctx={num_ctx} leaves no room for a reply"
        raise APIError(400, why + "; raise num_ctx or shorten the prompt")
    return settings.with_(max_tokens=min(settings.max_tokens, room))


def _single(obj: dict[str, Any], stream: bool) -> Response:
    if stream:
        return Response(_line(obj), media_type=NDJSON)
    return JSONResponse(obj)


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


async def _ndjson(
    reply: OllamaReply, pieces: asyncio.Queue, cancel: CancelToken, tools: ToolPlan | None = None
) -> AsyncIterator[str]:
    """One JSON object a line: each piece's text, then the final object with the counters; an error that ends
    the generation is a last line {"error": "..."} (Ollama's clients raise it). With tools, a call is never
    sent as text: the calls come in one chunk once complete, before the final object."""
    streamed = ollama_tools.Streamed(tools) if tools is not None else None
    try:
        while True:
            item = await pieces.get()
            if isinstance(item, BaseException):
                yield _line({"error": as_api_error(item).message})
                return
            text = item.text if streamed is None else streamed.content(item)
            if text or (item.token_ids and item.logprobs is not None):
                yield _line(reply.chunk(text, item))
            if item.completion is not None:
                c = item.completion
                if streamed is None:
                    yield _line(reply.final(c))
                    return
                rest, calls = streamed.rest(c)
                if rest or calls:
                    yield _line(_with_calls(reply.chunk(rest), calls, streamed.plan, c))
                yield _line(_with_calls(reply.final(c), [], streamed.plan, c))
                return
    finally:  # normal end, or the client disconnected (Starlette cancels the stream): stop the generation
        cancel.cancel()
