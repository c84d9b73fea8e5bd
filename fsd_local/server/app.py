"""The ASGI app of `fsd-local serve`, assembled: one pair (an Engine, or a Supervisor's child process) behind its
queue, OpenAI's routes (openai.py), Ollama's (ollama.py), the chat page (web.py), /health and /metrics
(metrics.py), the error handlers (errors.py) and the access guard (security.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI
from starlette.concurrency import run_in_threadpool

from fsd_local.engine_like import EngineLike
from fsd_local.llama.options import ModelOptions
from fsd_local.server import errors, metrics, ollama, openai, web
from fsd_local.server.generation import Runner
from fsd_local.server.metrics import CountResponses, Metrics
from fsd_local.server.security import AccessPolicy, Guard, require_key
from fsd_local.server.supervisor import Supervisor
from fsd_local.server.worker import Worker, retry_after
from fsd_local.settings import SERVER_MAX_QUEUE, Settings


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
    worker = Worker(max_queue, engine.parallel)
    counters = Metrics()
    runner = Runner(engine, worker, counters)
    if engine.model_process is not None:
        counters.watch_model_process(engine.model_process)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(worker.shutdown)  # cancels what still runs and waits for it
        if close_engine:
            await run_in_threadpool(engine.close)

    app = FastAPI(title="fsd-local", summary="OpenAI-compatible API with Fuzzy Speculative Decoding", lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.engine = worker, counters, engine
    guarded = [Depends(require_key(api_key))]
    openai.install(app, runner, guarded, name)  # /v1/...
    metrics.install(app, counters, engine, worker, guarded, name)  # /health, /metrics
    web.install(app, engine, guarded, name)  # the chat page at / and the settings it may send
    ollama.install(app, runner, guarded, name)  # /api/...
    errors.install(app)
    app.add_middleware(Guard, policy=AccessPolicy(host, allow_hosts, allow_origins))
    app.add_middleware(errors.RetryAfter, seconds=lambda: retry_after(engine, worker))
    app.add_middleware(CountResponses, metrics=counters, routes=(*openai.ROUTES, *metrics.ROUTES, *ollama.ROUTES))
    return app


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
