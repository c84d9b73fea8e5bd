"""The server's queue: `slots` worker threads run that many generations at once (the pair batches them), a
bounded number wait behind them, and a refused request (503) is told when to come back (Retry-After,
docs/server.md "Load, faults and crashes")."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from fsd_local.results import CancelToken
from fsd_local.server.errors import APIError
from fsd_local.settings import SERVER_MAX_QUEUE, SERVER_PARALLEL, SERVER_SLOT_CONTEXT

if TYPE_CHECKING:
    from fsd_local.engine_like import EngineLike


def default_parallel(n_ctx: int) -> int:
    """`serve --parallel`'s default: SERVER_PARALLEL slots where each would have SERVER_SLOT_CONTEXT tokens of
    the shared context, fewer on a smaller one, 1 on a tiny one."""
    return max(1, min(SERVER_PARALLEL, n_ctx // SERVER_SLOT_CONTEXT))


class Worker:
    """Runs up to `slots` generations at once, each in its own thread and slot. At most `max_queue` wait behind
    them; more are refused (503 queue_full, with Retry-After: when a place is likely to be free) rather than
    queued without bound."""

    def __init__(self, max_queue: int = SERVER_MAX_QUEUE, slots: int = 1):
        self.max_queue, self.slots = max_queue, slots
        self.running = self.waiting = 0
        self._mean_seconds = 0.0  # moving average of a generation's duration
        self._lock = threading.Lock()
        self._tokens: set[CancelToken] = set()  # of admitted jobs, to stop them at shutdown
        self._busy: list[dict[str, Any] | None] = [None] * slots  # each slot's request, None when idle
        self._pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="fsd-generate")

    def submit(self, job: Callable[[], Any], cancel: CancelToken, about: dict[str, Any] | None = None) -> Future:
        """Queue `job`; `about` (a dict the job may update, e.g. its tokens so far) is its slot's report."""
        with self._lock:
            if self.running + self.waiting >= self.slots + self.max_queue:
                raise APIError(
                    503,
                    f"the server is busy: {self.slots} requests are running and {self.max_queue} waiting; retry later",
                    type="server_error",
                    code="queue_full",
                    retry_after=self.retry_after(),
                )
            self.waiting += 1
            self._tokens.add(cancel)
        info = about if about is not None else {}

        def run() -> Any:
            with self._lock:
                self.waiting -= 1
                self.running += 1
                slot = self._busy.index(None)  # a pool thread per slot: one is free
                self._busy[slot] = info
                info["started"] = time.time()
            t = time.monotonic()
            try:
                return job()
            finally:
                with self._lock:
                    self.running -= 1
                    self._busy[slot] = None
                    self._tokens.discard(cancel)
                    self._mean_seconds += 0.2 * (time.monotonic() - t - self._mean_seconds)

        return self._pool.submit(run)

    def report(self) -> list[dict[str, Any]]:
        """Each slot: its id, "active" with its request's report, or "idle"."""
        with self._lock:
            busy = [dict(b) if b is not None else None for b in self._busy]
        now = time.time()
        return [
            {"id": i, "state": "idle"}
            if b is None
            else {"id": i, "state": "active", "request": {**b, "seconds": round(now - b["started"], 3)}}
            for i, b in enumerate(busy)
        ]

    def retry_after(self) -> int:
        """Seconds until a place in the queue is likely to be free: one generation's mean duration over the
        slots, 1 to 60."""
        return int(min(60, max(1, math.ceil(self._mean_seconds / self.slots))))

    def shutdown(self) -> None:
        with self._lock:
            for token in self._tokens:
                token.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)


def retry_after(engine: EngineLike, worker: Worker) -> int:
    """Retry-After of a 503 that did not set its own: while the model process restarts, its last start time;
    when the supervisor has given up, a minute; otherwise when a place in the queue is likely to be free."""
    state = engine.state
    if state == "restarting":
        return int(min(60, max(1, math.ceil(engine.last_start_seconds))))
    return 60 if state == "failed" else worker.retry_after()
