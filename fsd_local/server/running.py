"""Running the app: `serve` (the command's server, until Ctrl-C), `BackgroundServer` (in a thread of this process,
for apps that embed it and for tests) and `open_page` (`fsd-local chat --web`: the chat page in the browser)."""

from __future__ import annotations

import logging
import socket
import threading
import time
import webbrowser
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from fsd_local.engine_like import EngineLike
from fsd_local.llama.options import ModelOptions
from fsd_local.server.app import create_app, create_supervised_app
from fsd_local.settings import SERVER_MAX_QUEUE, Settings

log = logging.getLogger("fsd_local.server")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _uvicorn_config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    # after a stop request, open streams get 5 s to end before they are cancelled (which cancels generation)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


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
    """The server in a thread of this process, for apps that embed it and for tests:
    `with BackgroundServer(engine, port=0) as srv:` serves at `srv.url` (port 0: a free port)."""

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
