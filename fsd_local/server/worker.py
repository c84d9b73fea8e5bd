"""The server's queue: ONE worker thread runs generations in order, a bounded number wait behind it, and a
refused request (503) is told when to come back (Retry-After, docs/server.md "Load, faults and crashes")."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from fsd_local.results import CancelToken
from fsd_local.server.errors import APIError
from fsd_local.settings import SERVER_MAX_QUEUE

if TYPE_CHECKING:
    from fsd_local.engine_like import EngineLike


class Worker:
    """Runs generations one at a time in its own thread. At most `max_queue` wait behind the running one; more
    are refused (503 queue_full, with Retry-After: the mean duration of recent generations, when a place is
    likely to be free) rather than queued without bound."""

    def __init__(self, max_queue: int = SERVER_MAX_QUEUE):
        self.max_queue = max_queue
        self.running = self.waiting = 0
        self._mean_seconds = 0.0  # moving average of a generation's duration
        self._lock = threading.Lock()
        self._tokens: set[CancelToken] = set()  # of admitted jobs, to stop them at shutdown
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsd-generate")

    def submit(self, job: Callable[[], Any], cancel: CancelToken) -> Future:
        with self._lock:
            if self.running + self.waiting > self.max_queue:
                raise APIError(
                    503,
                    f"the server is busy: {self.max_queue} requests are already waiting; retry later",
                    type="server_error",
                    code="queue_full",
                    retry_after=self.retry_after(),
                )
            self.waiting += 1
            self._tokens.add(cancel)

        def run() -> Any:
            with self._lock:
                self.waiting -= 1
                self.running += 1
            t = time.monotonic()
            try:
                return job()
            finally:
                with self._lock:
                    self.running -= 1
                    self._tokens.discard(cancel)
                    self._mean_seconds += 0.2 * (time.monotonic() - t - self._mean_seconds)

        return self._pool.submit(run)

    def retry_after(self) -> int:
        """Seconds until a place in the queue is likely to be free: one generation's mean duration, 1 to 60."""
        return int(min(60, max(1, math.ceil(self._mean_seconds))))

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
