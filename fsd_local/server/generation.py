"""The worker's side of a request: `Runner` queues a validated generation and hands its pieces to the event loop,
or awaits its completion while watching for the client to leave (which cancels it at its next round)."""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Any

from fastapi import Request

from fsd_local.results import CancelToken, Completion, Piece
from fsd_local.server.metrics import Metrics
from fsd_local.server.worker import Worker
from fsd_local.settings import Settings

if TYPE_CHECKING:
    from fsd_local.engine_like import EngineLike


class Runner:
    """The engine, its queue and its metrics, as the routes use them."""

    def __init__(self, engine: EngineLike, worker: Worker, metrics: Metrics):
        self.engine, self.worker, self.metrics = engine, worker, metrics
        self._ids = itertools.count(1)

    def about(self, path: str, prompt: list[int], settings: Settings, stream: bool) -> dict[str, Any]:
        """A request as its slot reports it (/health, /api/ps, the page); `tokens` grows as it generates."""
        return {
            "id": next(self._ids),
            "path": path,
            "mode": settings.mode,
            "stream": stream,
            "prompt_tokens": len(prompt),
            "max_tokens": settings.max_tokens,
            "tokens": 0,
        }

    def _pieces(self, prompt: list[int], settings: Settings, cancel: CancelToken, about: dict[str, Any]):
        """The generation's pieces, its slot's token count kept, its completion counted in the metrics."""
        for piece in self.engine.stream(prompt, cancel=cancel, settings=settings):
            about["tokens"] += len(piece.token_ids)
            if piece.completion is not None:
                self.metrics.observe(piece.completion)
            yield piece

    def stream(self, path: str, prompt: list[int], settings: Settings, cancel: CancelToken) -> asyncio.Queue:
        """Queue the generation; its pieces (the last carries .completion), or the exception that ended it,
        arrive on the returned queue. Raises APIError 503 at once when the queue is full."""
        pieces: asyncio.Queue[Piece | BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        about = self.about(path, prompt, settings, True)

        def job() -> None:
            try:
                for piece in self._pieces(prompt, settings, cancel, about):
                    loop.call_soon_threadsafe(pieces.put_nowait, piece)
            except Exception as exc:  # handed to the response, which tells the client
                loop.call_soon_threadsafe(pieces.put_nowait, exc)

        self.worker.submit(job, cancel, about)
        return pieces

    async def whole(
        self, request: Request, prompt: list[int], settings: Settings, cancel: CancelToken
    ) -> Completion | None:
        """Run the generation to its end; None when the client went away first (the generation is cancelled).
        An error of the generation is raised here."""
        about = self.about(request.url.path, prompt, settings, False)

        def job() -> Completion:
            *_, last = self._pieces(prompt, settings, cancel, about)
            assert last.completion is not None
            return last.completion

        done = asyncio.wrap_future(self.worker.submit(job, cancel, about))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not done.done():  # the client left: stop its generation, nobody reads this answer
            cancel.cancel()
            done.add_done_callback(_consume)
            return None
        return done.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _consume(fut: asyncio.Future) -> None:
    """Fetch an abandoned job's outcome so that asyncio does not log it as never retrieved."""
    if not fut.cancelled():
        fut.exception()
