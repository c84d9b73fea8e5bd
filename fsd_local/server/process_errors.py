"""How the model process can fail, as the server answers it, and an exit code in words."""

from __future__ import annotations

import signal

from fsd_local.errors import FSDError


class ModelProcessError(FSDError):
    """The model process cannot answer; `status` and `code` are what the server replies."""

    status, code = 500, "model_process_died"


class ModelProcessDied(ModelProcessError):
    """The model process died while it was generating this answer (it is being restarted)."""


class ModelUnavailable(ModelProcessError):
    """No model process will answer: the supervisor gave up restarting it, or the server is shutting down."""

    status, code = 503, "model_unavailable"


def describe_exit(code: int) -> str:
    """Popen's return code in words for labels and messages: 'SIGSEGV' (killed by a signal) or 'exit 1'."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def _how(cause: str) -> str:
    return (
        f"killed by {cause}"
        if cause.startswith("SIG") or cause.startswith("signal")
        else f"exited with code {cause.split()[-1]}"
    )
