"""`fsd-local serve`: the OpenAI API over HTTP (FastAPI + uvicorn) in front of one loaded draft/target pair, with
Ollama's routes (ollama.py) and the chat page (web.py) installed next to it.

A pair runs one generation at a time, so requests wait in a bounded queue and ONE worker thread runs them in
order; the event loop only parses, streams and waits, and is never blocked by a decode. Everything a request
needs (settings, prompt tokens, context check) is validated before it is queued, so a streaming response can
start at once and every client error is a 4xx with OpenAI's error body. A client that goes away (mid-stream,
or while waiting) sets its generation's CancelToken: the engine stops at its next round and the caches stay a
prefix of the accepted text, so the next request is answered as if nothing happened.

`fsd-local serve` runs the models in a supervised child process (supervisor.py): a crash in llama.cpp costs the
request it was running, not the server. The app serves an in-process Engine or a Supervisor alike; apps that
embed the server (create_app, BackgroundServer) keep the in-process Engine unless they ask for the child.
`open_page` is `fsd-local chat --web`: a BackgroundServer on a free loopback port and the chat page (web.py) in the
browser.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import threading
import time
import webbrowser
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from fsd_local.engine_like import EngineLike
from fsd_local.llama.options import ModelOptions
from fsd_local.results import CancelToken
from fsd_local.server import openai_tools
from fsd_local.server.generation import Runner, as_api_error, check_available
from fsd_local.server.metrics import Metrics
from fsd_local.server.ollama import ROUTES as OLLAMA_ROUTES
from fsd_local.server.ollama import install as install_ollama
from fsd_local.server.ollama_schema import error_body
from fsd_local.server.openai_schema import APIError, ChatRequest, Reply, parse, prompt_tokens, settings_for
from fsd_local.server.security import AccessPolicy, Guard
from fsd_local.server.supervisor import Supervisor
from fsd_local.server.web import TokenTrail, install
from fsd_local.server.worker import Worker, retry_after
from fsd_local.settings import SERVER_MAX_QUEUE, Settings

log = logging.getLogger("fsd_local.server")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def create_app(
    engine: EngineLike,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_queue: int = SERVER_MAX_QUEUE,
    close_engine: bool = False,
    host: str = "127.0.0.1",
    allow_hosts: Sequence[str] = (),
    allow_origins: Sequence[str] = (),
) -> FastAPI:
    """The ASGI app serving `engine` (in this process, or a Supervisor's child). It closes the engine when it
    shuts down only if `close_engine`; otherwise close it after the server has stopped. `host` is the address
    it listens on; with `allow_hosts` and `allow_origins` it says who may use it (security.py)."""
    name = model_name or Path(engine.target.path).stem
    worker = Worker(max_queue)
    metrics = Metrics()
    runner = Runner(engine, worker, metrics)
    if isinstance(engine, Supervisor):
        metrics.watch_model_process(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(worker.shutdown)  # cancels what still runs and waits for it
        if close_engine:
            await run_in_threadpool(engine.close)

    app = FastAPI(title="fsd-local", summary="OpenAI-compatible API with Fuzzy Speculative Decoding", lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.engine = worker, metrics, engine

    async def authorised(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    guarded = [Depends(authorised)]

    _install_openai(app, runner, guarded, name)  # OpenAI's API under /v1/, /health and /metrics
    install(app, engine, guarded, name)  # the chat page at / and the settings it may send
    install_ollama(app, runner, guarded, name)  # Ollama's API under /api/
    _install_error_handlers(app)
    app.add_middleware(Guard, policy=AccessPolicy(host, allow_hosts, allow_origins))
    app.add_middleware(_CountResponses, metrics=metrics, retry_after=lambda: retry_after(engine, worker))
    return app


def _install_openai(app: FastAPI, runner: Runner, guarded: list[Any], name: str) -> None:
    """OpenAI's routes (/v1/...), /health and /metrics."""
    engine, worker, metrics = runner.engine, runner.worker, runner.metrics

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

    @app.get("/health")
    async def health() -> JSONResponse:
        # ok | restarting (the model process died and a new one is loading) | failed (gave up; reason says why)
        state, reason = engine.state, engine.reason
        body: dict[str, Any] = {
            "status": state,
            "model": name,
            "queue": {"running": worker.running, "waiting": worker.waiting, "max_queue": worker.max_queue},
        }
        if reason:
            body["reason"] = reason
        if isinstance(engine, Supervisor):
            body["model_process"] = {"restarts": engine.restarts, "start_seconds": engine.last_start_seconds}
        return JSONResponse(body, status_code=200 if state == "ok" else 503)

    @app.get("/metrics", dependencies=guarded)
    async def prometheus(request: Request) -> Response:
        body, content_type = metrics.render(
            worker.running, worker.waiting, worker.max_queue, request.headers.get("accept")
        )
        return Response(body, media_type=content_type)

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
    """One OpenAI request: validated before it is queued, then streamed as server-sent events or answered whole."""
    engine = runner.engine
    req = parse(kind, await request.body())
    check_available(engine)
    settings = settings_for(engine, req)
    tools = None  # the tools path's plan (tools offered, or tool calls and results in the conversation)
    if isinstance(req, ChatRequest) and openai_tools.uses_tools(req):
        tools, settings = await run_in_threadpool(openai_tools.plan, engine, req, settings)
        prompt = tools.prompt
    else:
        prompt = await run_in_threadpool(prompt_tokens, engine, req)  # tokenising is CPU work: off the loop
    reply = Reply(kind, req.model or name, engine.token_bytes)
    headers = openai_tools.headers(tools) if tools is not None else None
    cancel = CancelToken()
    if req.stream:
        pieces = runner.stream(prompt, settings, cancel)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        streamed = openai_tools.StreamedTools(tools) if tools is not None else None
        return StreamingResponse(
            _events(reply, pieces, cancel, include_usage, TokenTrail(engine.token_bytes), streamed),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
    try:
        c = await runner.whole(request, prompt, settings, cancel)
    except Exception as exc:
        raise as_api_error(exc) from exc
    if c is None:  # the client left
        return Response(status_code=499)
    return JSONResponse(reply.full(c) if tools is None else openai_tools.full(reply, tools, c), headers=headers)


async def _events(
    reply: Reply,
    pieces: asyncio.Queue,
    cancel: CancelToken,
    include_usage: bool,
    trail: TokenTrail,
    tools: openai_tools.StreamedTools | None = None,
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; each chunk with new tokens
    carries them in the `fsd_delta` extension field (web.py). On the tools path, `tools` shapes the chunks."""
    try:
        if reply.kind == "chat":
            yield _sse(reply.chunk(role=True))
        while True:
            item = await pieces.get()
            if isinstance(item, BaseException):
                yield _sse(as_api_error(item).body())  # the openai client raises on an error event
                return
            if item.text or item.token_ids:
                chunk = reply.piece_chunk(item) if tools is None else tools.piece_chunk(reply, item)
                yield _sse({**chunk, "fsd_delta": trail.delta(item)})
            if item.completion is not None:
                last = (
                    [reply.last_chunk(item.completion)] if tools is None else tools.last_chunks(reply, item.completion)
                )
                for chunk in last:
                    yield _sse(chunk)
                if include_usage:
                    yield _sse(reply.usage_chunk(item.completion))
                yield "data: [DONE]\n\n"
                return
    finally:  # normal end, or the client disconnected (Starlette cancels the stream): stop the generation
        cancel.cancel()


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _install_error_handlers(app: FastAPI) -> None:
    """Every error, ours or the framework's, answers with the error body of the route's API (Ollama's under
    /api/, else OpenAI's); none stops the server."""

    def answer(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(error_body(request.url.path, err), status_code=err.status, headers=err.headers())

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return answer(request, APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, APIError(400, str(exc), code="invalid_value"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return answer(request, as_api_error(exc))


class _CountResponses:
    """ASGI middleware counting responses by path and status for /metrics (unknown paths share one label), and
    adding Retry-After (seconds, from `retry_after`) to every 503 that has none."""

    def __init__(self, app: Any, metrics: Metrics, retry_after: Callable[[], int]):
        self.app, self.metrics, self.retry_after = app, metrics, retry_after

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        known = path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", *OLLAMA_ROUTES)
        label = path if known else ("/v1/models/{model}" if path.startswith("/v1/models/") else "other")

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_response(label, message["status"])
                headers = list(message.get("headers", []))
                if message["status"] == 503 and not any(k.lower() == b"retry-after" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"retry-after", str(self.retry_after()).encode())]}
            await send(message)

        await self.app(scope, receive, counted)


def _uvicorn_config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    # after a stop request, open streams get 5 s to end before they are cancelled (which cancels generation)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


def create_supervised_app(
    target: str | Path | ModelOptions,
    draft: str | Path | ModelOptions | None = None,
    settings: Settings | None = None,
    *,
    supervisor_options: dict[str, Any] | None = None,
    **app_options: Any,
) -> FastAPI:
    """The app with the models in a supervised child process (as `fsd-local serve` runs them); it owns the
    Supervisor and stops the child when it shuts down. Returns once the child has loaded the models."""
    sup = Supervisor(target, draft, settings=settings, **(supervisor_options or {}))
    try:
        return create_app(sup, close_engine=True, **app_options)
    except BaseException:
        sup.close()
        raise


def serve(
    engine: EngineLike,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    max_queue: int = SERVER_MAX_QUEUE,
    model_name: str | None = None,
    log_level: str = "info",
    allow_hosts: Sequence[str] = (),
    allow_origins: Sequence[str] = (),
) -> None:
    """Serve until interrupted (Ctrl-C)."""
    if host not in LOOPBACK and api_key is None:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the models", host)
    app = create_app(
        engine,
        model_name=model_name,
        api_key=api_key,
        max_queue=max_queue,
        host=host,
        allow_hosts=allow_hosts,
        allow_origins=allow_origins,
    )
    uvicorn.Server(_uvicorn_config(app, host, port, log_level)).run()


class BackgroundServer:
    """The server in a thread of this process, for apps that embed it (and for tests).

    with BackgroundServer(engine, port=0) as srv:   # port 0: a free port
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    """

    def __init__(
        self,
        engine: EngineLike | None = None,
        *,
        app: FastAPI | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        start_timeout: float = 30.0,
        **app_options: Any,
    ):
        if app is None:
            assert engine is not None, "give an engine or an app"
            app = create_app(engine, host=host, **app_options)
        self.app = app
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.port = sock.getsockname()[1]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{self.port}"
        self._server = uvicorn.Server(_uvicorn_config(self.app, host, self.port, log_level))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="fsd-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + start_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.01)

    @classmethod
    def supervised(
        cls,
        target: str | Path | ModelOptions,
        draft: str | Path | ModelOptions | None = None,
        settings: Settings | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        supervisor_options: dict[str, Any] | None = None,
        **app_options: Any,
    ) -> BackgroundServer:
        """The server with the models in a supervised child process (`.app.state.engine` is the Supervisor)."""
        app = create_supervised_app(target, draft, settings, supervisor_options=supervisor_options, **app_options)
        try:
            return cls(app=app, host=host, port=port, log_level=log_level)
        except BaseException:
            app.state.engine.close()
            raise

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_page(engine: EngineLike, say: Callable[[str], None], stop: threading.Event | None = None) -> None:
    """`fsd-local chat --web`: serve `engine` on a free loopback port, open the chat page (web.py) in the browser,
    and serve until Ctrl-C (or until `stop` is set)."""
    with BackgroundServer(engine, host="127.0.0.1", port=0, model_name=Path(engine.target.path).stem) as srv:
        url = srv.url + "/"
        say(f"the chat page is at {url} (Ctrl-C stops the server)")
        if not webbrowser.open(url):
            say("no browser could be started here: open the address above yourself")
        (stop or threading.Event()).wait()
