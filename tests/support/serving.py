"""Starting `fsd-local serve` as a real process on a free loopback port (the server and supervisor tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ctrl_c_on() -> None:
    """A child's SIGINT as a terminal's (a suite started as a background job hands its children SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_serve(draft: str, target: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """`fsd-local serve` on the tiny pair (context 256, one thread) with `extra` options; returns the process,
    its stdout and stderr merged and unbuffered, and the server's base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "fsd_local.cli", "serve", "--target", target, "--draft", draft]
    cmd += ["--ctx", "256", "--threads", "1", "--port", str(port), *extra]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=ctrl_c_on,
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_up(proc: subprocess.Popen, base: str, seconds: float = 120, path: str = "/health") -> None:
    """Until the server at `base` answers `path` (fails if the process exits first, or after `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(base + path, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "fsd-local serve did not start"
        time.sleep(0.2)
