"""The model process of `fsd-local serve`: one Engine, started as `python -m fsd_local.server.child FD` and driven
over that socket with pickled tuples (docs/design.md, "The server", lists them); it exits when the parent closes
its end."""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import queue
import signal
import sys
import threading
from multiprocessing.connection import Connection


def main(fd: int) -> None:
    # Ctrl-C in a terminal reaches the whole process group; the server decides when this process ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.enable()  # a crash in llama.cpp prints every thread's Python stack before the process dies
    conn = Connection(fd)
    _, target, draft, settings = conn.recv()
    try:
        from fsd_local.engine import Engine

        engine = Engine(target=target, draft=draft, settings=settings)
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    conn.send(
        (
            "ready",
            {
                "pid": os.getpid(),
                "n_vocab": engine.n_vocab,
                "target": _info(engine.target),
                "draft": _info(engine.draft),
            },
        )
    )

    jobs: queue.Queue = queue.Queue()
    threading.Thread(target=_read, args=(conn, jobs), name="fsd-child-reader", daemon=True).start()
    while True:
        prompt, settings, cancel = jobs.get()
        try:
            for piece in engine.stream(prompt, cancel=cancel, settings=settings):
                if piece.completion is None:
                    conn.send(("piece", _fields(piece)))
                else:
                    conn.send(("done", piece.text, dataclasses.asdict(piece.completion), engine.cached_tokens()))
        except Exception as exc:  # a failed generation, not a dead process: the parent answers it, we go on
            conn.send(("error", type(exc).__name__, str(exc)))


def _read(conn: Connection, jobs: queue.Queue) -> None:
    """Messages from the parent. Cancels must arrive while the main thread is busy generating, hence a thread;
    each job gets its own CancelToken, made here, so a late cancel can only reach the job it was meant for."""
    from fsd_local.results import CancelToken

    current = CancelToken()
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "generate":
                current = CancelToken()
                jobs.put((msg[1], msg[2], current))
            elif msg[0] == "cancel":
                current.cancel()
    except (EOFError, OSError):  # the parent closed the connection or died: nobody is left to answer
        os._exit(0)


def _fields(piece) -> dict:
    """A streamed Piece as a message: every field but the completion (the parent rebuilds it: Piece(**fields))."""
    return {f.name: getattr(piece, f.name) for f in dataclasses.fields(piece) if f.name != "completion"}


def _info(model) -> dict | None:
    return None if model is None else {"path": model.path, "n_ctx": model.n_ctx}


if __name__ == "__main__":
    main(int(sys.argv[1]))
