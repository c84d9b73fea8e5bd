"""llama-cpp-python, initialised once per process: its log goes to a ring buffer (shown in load errors) instead
of the terminal, and the backends of a GGML_BACKEND_DL build are loaded from libllama's folder.
FSD_LOCAL_VERBOSE=1 prints llama.cpp's log on stderr."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections import deque

from fsd_local.errors import ModelLoadError
from fsd_local.llama.ggml import load_backend_modules

try:
    import llama_cpp as lc
except ImportError as exc:  # pragma: no cover - the package is a hard dependency
    raise ImportError("llama-cpp-python is required: pip install llama-cpp-python") from exc

_LOG: deque[str] = deque(maxlen=64)
_init_lock = threading.Lock()
_initialised = False


@lc.llama_log_callback
def _log_sink(level, text, user_data):  # pragma: no cover - called from C
    line = text.decode("utf-8", "replace") if text else ""
    _LOG.append(line)
    if os.environ.get("FSD_LOCAL_VERBOSE"):  # stderr, as llama.cpp's own logger: stdout may be --json output
        print(line, end="", file=sys.stderr, flush=True)


def route_log() -> None:
    """Send llama.cpp's (and ggml's) log to the ring buffer, without initialising any backend: enough for
    reading GGUF headers quietly."""
    lc.llama_log_set(_log_sink, ctypes.c_void_p(0))


def init_backend() -> None:
    global _initialised
    with _init_lock:
        if not _initialised:
            route_log()
            lc.llama_backend_init()
            try:
                load_backend_modules()
            except ModelLoadError:  # a build without the registry exports: llama.cpp finds its backends itself
                pass
            _initialised = True


def clear_log() -> None:
    _LOG.clear()


def recent_log(lines: int = 6) -> str:
    useful = [ln.strip() for ln in _LOG if ln.strip() and not ln.strip() == "."]
    return " | ".join(useful[-lines:])


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS / Windows
        return max(1, os.cpu_count() or 1)
