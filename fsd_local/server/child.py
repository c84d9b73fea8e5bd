"""The model process of `fsd-local serve`: one Engine (its `parallel` calls batched), started as
`python -m fsd_local.server.child FD` and driven over that socket with pickled tuples, every call's messages
tagged with its id (docs/design.md, "The server", lists them); it exits when the parent closes its end."""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection


def main(fd: int) -> None:
    # Ctrl-C in a terminal reaches the whole process group; the server decides when this process ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.enable()  # a crash in llama.cpp prints every thread's Python stack before the process dies
    conn = Connection(fd)
    _, target, draft, settings, parallel = conn.recv()
    try:
        from fsd_local.engine import Engine

        engine = Engine(target=target, draft=draft, settings=settings, parallel=parallel)
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    conn.send(
        (
            "ready",
            {
                "pid": os.getpid(),
                "n_vocab": engine.n_vocab,
                "parallel": engine.parallel,
                "target": _info(engine.target),
                "draft": _info(engine.draft),
            },
        )
    )
    lock = threading.Lock()

    def send(msg: tuple) -> None:
        with lock:  # one message at a time on the socket, from every call's thread
            conn.send(msg)

    _read(conn, engine, send)


def _read(conn: Connection, engine, send: Callable[[tuple], None]) -> None:
    """Messages from the parent: each call runs in its own thread (the engine batches them, or takes them in
    turn); a cancel reaches only the call whose id it names, by that call's own CancelToken."""
    from fsd_local.results import CancelToken

    cancels: dict[int, CancelToken] = {}
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "generate":
                _, rid, prompt, settings = msg
                token = cancels[rid] = CancelToken()
                args = (engine, send, rid, prompt, settings, token, cancels)
                threading.Thread(target=_generate, args=args, name=f"fsd-call-{rid}", daemon=True).start()
            elif msg[0] == "cancel" and (stop := cancels.get(msg[1])) is not None:
                stop.cancel()
    except (EOFError, OSError):  # the parent closed the connection or died: nobody is left to answer
        os._exit(0)


def _generate(engine, send, rid: int, prompt, settings, cancel, cancels: dict) -> None:
    """One call's pieces, then "done" (or "error": a failed call, not a dead process; the others go on)."""
    try:
        for piece in engine.stream(prompt, cancel=cancel, settings=settings):
            if piece.completion is None:
                send(("piece", rid, _fields(piece)))
            else:
                c = piece.completion
                send(("done", rid, piece.text, dataclasses.asdict(c), _cached(engine, prompt, c.token_ids)))
    except Exception as exc:
        send(("error", rid, type(exc).__name__, str(exc)))
    finally:
        cancels.pop(rid, None)


def _cached(engine, prompt, generated: list[int]) -> list[int]:
    """What the call's sequence holds now: the target's cache alone, or with several sequences the call's ids."""
    if engine.parallel == 1:
        return engine.cached_tokens()
    return [*prompt, *generated] if isinstance(prompt, list) else []


def _fields(piece) -> dict:
    """A streamed Piece as a message: every field but the completion (the parent rebuilds it: Piece(**fields))."""
    return {f.name: getattr(piece, f.name) for f in dataclasses.fields(piece) if f.name != "completion"}


def _info(model) -> dict | None:
    return None if model is None else {"path": model.path, "n_ctx": model.n_ctx}


if __name__ == "__main__":
    main(int(sys.argv[1]))
