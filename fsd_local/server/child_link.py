"""The parent's end of one model process (child.py): its Popen and socket, and the calls in flight over it, each
with its own queue of messages; one reader thread hands every message to the call it names, and when the
socket ends, tells every call in flight that the process died."""

from __future__ import annotations

import itertools
import queue
import subprocess
import threading
from multiprocessing.connection import Connection
from typing import Any

DIED = ("died",)  # what a call in flight reads once the process is gone


class ChildLink:
    """One model process: its Popen, its end of the socket, its calls in flight, and (once it ended) how."""

    def __init__(self, proc: subprocess.Popen, conn: Connection):
        self.proc, self.conn = proc, conn
        self.info: dict[str, Any] = {}
        self.ready_at = 0.0
        self.healthy = False  # completed a generation: it works, so its death is not part of a crash loop
        self.exited = threading.Event()  # the process ended (set by the supervisor's watcher, which reaps it)
        self.cause = ""
        self._lock = threading.Lock()  # the socket's writers, and `calls`
        self._calls: dict[int, queue.Queue] = {}
        self._ids = itertools.count()
        self._gone = False  # the socket ended: no call may start on it

    def listen(self) -> None:
        """Start reading the socket (once the process said it is ready)."""
        threading.Thread(target=self._read, name=f"fsd-link-{self.proc.pid}", daemon=True).start()

    def open(self) -> tuple[int, queue.Queue] | None:
        """A new call's id and the queue its messages arrive on; None once the socket has ended."""
        with self._lock:
            if self._gone:
                return None
            rid = next(self._ids)
            q: queue.Queue = queue.Queue()
            self._calls[rid] = q
            return rid, q

    def send(self, msg: tuple) -> None:
        """Raises OSError (or EOFError) when the socket is gone."""
        with self._lock:
            if self._gone:
                raise EOFError("the model process's socket is closed")
            self.conn.send(msg)

    def forget(self, rid: int, cancel: bool) -> None:
        """The call ended here; with `cancel` (its reader left first) the process is told to stop it, and its
        later messages are dropped."""
        with self._lock:
            self._calls.pop(rid, None)
            if cancel and not self._gone:
                try:
                    self.conn.send(("cancel", rid))
                except (EOFError, OSError):
                    pass  # it died: the watcher restarts it

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    def _read(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                with self._lock:
                    q = self._calls.get(msg[1])
                if q is not None:  # else a call that was abandoned: nobody reads it
                    q.put(msg)
        except (EOFError, OSError):  # the process died, or closed its end: the calls in flight end with it
            pass
        with self._lock:
            self._gone = True
            calls, self._calls = list(self._calls.values()), {}
            try:
                self.conn.close()
            except OSError:
                pass
        for q in calls:
            q.put(DIED)
