"""Supervisor: an EngineLike whose pair runs in a child process (child.py), restarted with back-off when it dies;
it tokenises here, on the target's vocabulary loaded without weights, under the prompt contract (prompting.py).
Why it is built so: docs/design.md, "The server"."""

from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, TypeVar

from fsd_local import errors
from fsd_local.errors import FSDError, ModelLoadError
from fsd_local.llama.chat_template import ChatTemplate
from fsd_local.llama.model import Model
from fsd_local.llama.options import ModelOptions
from fsd_local.prompting import chat_ids, checked_ids
from fsd_local.results import CancelToken, Completion, Piece, final_completion
from fsd_local.server.child_link import DIED, ChildLink
from fsd_local.server.process_errors import ModelProcessDied, ModelProcessError, ModelUnavailable, _how, describe_exit  # noqa: F401
from fsd_local.settings import Settings
from fsd_local.stats import Stats

if TYPE_CHECKING:
    from fsd_local.engine import Engine
    from fsd_local.engine_like import EngineLike

log = logging.getLogger("fsd_local.server.supervisor")
T = TypeVar("T")


@dataclass
class ModelInfo:
    """What the server needs to know of a model loaded in the child."""

    path: str
    n_ctx: int


class _StartFailed(Exception):
    def __init__(self, cause: str, detail: str | None):
        super().__init__(f"{_how(cause)}: {detail}" if detail else _how(cause))
        self.cause = cause


class Supervisor:
    """A draft/target pair in a supervised child process, with the Engine surface the server uses:
    `with Supervisor(target=ModelOptions("big.gguf"), draft=..., tau=0.2) as sup:` then `sup.generate(prompt)`."""

    def __init__(
        self,
        target: str | os.PathLike | ModelOptions,
        draft: str | os.PathLike | ModelOptions | None = None,
        *,
        settings: Settings | None = None,
        backoff_s: float = 0.5,
        backoff_max_s: float = 8.0,
        max_failures: int = 5,
        healthy_after_s: float = 30.0,
        start_timeout_s: float | None = None,
        parallel: int = 1,
        **setting_overrides: Any,
    ):
        self.defaults = (settings or Settings()).with_(**setting_overrides)
        self._target_opts = target if isinstance(target, ModelOptions) else ModelOptions(path=str(target))
        self._draft_opts = draft if draft is None or isinstance(draft, ModelOptions) else ModelOptions(path=str(draft))
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.max_failures, self.healthy_after_s, self.start_timeout_s = max_failures, healthy_after_s, start_timeout_s
        self.parallel = parallel  # calls the model process runs at once, batched (Engine(parallel=N))
        self.state: str = "starting"
        self.reason: str | None = None  # ok | restarting | failed (reason: why, for /health)
        self.restarts, self.deaths = 0, Counter[str]()  # for /metrics
        self.last_start_seconds = 0.0
        self._streak = 0  # deaths in a row of children that never proved themselves
        self._cond = threading.Condition()
        self._closed = False
        self._cached: list[int] = []  # what the child's target holds, as its last "done" said
        # the child imports fsd_local from where this process did (multiprocessing's spawn does the same)
        self._env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._vocab_lock = threading.Lock()
        self._vocab = Model(replace(self._target_opts, vocab_only=True, rpc_servers=None), "target")
        try:
            self._child = self._spawn()
        except _StartFailed as exc:
            self._vocab.close()
            raise ModelLoadError(f"the model process did not start: {exc}") from None
        self._publish(self._child)
        self._watcher = threading.Thread(target=self._watch, name="fsd-supervisor", daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------------ the Engine surface
    @property
    def pid(self) -> int:
        """The model process's pid (a direct child of this process)."""
        return self._child.proc.pid

    @property
    def model_process(self) -> Supervisor:
        """This supervisor: its counters are the model process's (restarts, deaths, state, start time)."""
        return self

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self._with_vocab(lambda v: v.tokenize(text, add_special=add_special))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._with_vocab(lambda v: v.detokenize(tokens))

    def token_bytes(self, token: int) -> bytes:
        """As Engine.token_bytes."""
        return self._with_vocab(lambda v: v.piece(token))

    def chat_template(self) -> ChatTemplate:
        """The target's chat template (read from the vocabulary-only copy, once)."""
        return self._with_vocab(ChatTemplate.of)

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """As Engine.chat_prompt (prompting.py), spliced against what the child's target held at its last reply."""
        return chat_ids(self, messages)

    def cached_tokens(self) -> list[int]:
        """What the child's target held when its last generation ended (none after a failure or a restart)."""
        return self._cached

    def prompt_tokens(self, prompt: str | Sequence[int]) -> list[int]:
        """As Engine.prompt_tokens: the shared vocabulary and the contexts the child loaded (prompting.py)."""
        return checked_ids(self, prompt)

    def _with_vocab(self, read: Callable[[Model], T]) -> T:
        with self._vocab_lock:  # close() must not free the vocabulary under a tokenizing thread
            self._check_open()
            return read(self._vocab)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        cancel: CancelToken | None = None,
        settings: Settings | None = None,
        **overrides: Any,
    ) -> Completion:
        return final_completion(self.stream(prompt, cancel=cancel, settings=settings, **overrides))

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        cancel: CancelToken | None = None,
        settings: Settings | None = None,
        **overrides: Any,
    ) -> Iterator[Piece]:
        """As Engine.stream. Raises ModelProcessDied if the child dies meanwhile, ModelUnavailable if the
        supervisor has given up; while the child restarts, waits for the new one."""
        s = settings or self.defaults
        if overrides:
            s = s.with_(**overrides)  # a bad setting fails here, as in Engine.stream, not in the child
        s.check_draft(self._draft_opts is not None)
        prompt = prompt if isinstance(prompt, str) else [int(t) for t in prompt]
        return self._run(prompt, s, cancel)

    def close(self) -> None:
        """Stop the child (a generation running there ends with ModelUnavailable) and free the vocabulary."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            child = self._child
        child.proc.terminate()  # the watcher's wait() returns; a restart in progress sees _closed and stops
        self._watcher.join(timeout=30)
        child = self._child  # _publish refuses new children once closed: this is the last one
        child.proc.terminate()
        try:
            child.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
        with self._vocab_lock:
            self._vocab.close()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise FSDError("this Supervisor is closed; start a new one")

    # ------------------------------------------------------------------ one generation
    def _run(self, prompt, settings: Settings, cancel: CancelToken | None) -> Iterator[Piece]:
        while True:
            child = self._ready_child(cancel)
            if child is None:  # cancelled while the child restarted: nothing ran, nothing to run
                yield Piece("", [], [], self._cancelled(prompt, settings))
                return
            call = child.open()
            if call is None:  # it died before this call could start: wait for its successor
                continue
            rid, messages = call
            last, ended = None, False
            try:
                child.send(("generate", rid, prompt, settings))
                last = yield from self._pieces(child, rid, messages, cancel)
                ended = True
            except (EOFError, OSError):
                ended = True
                raise self._died(child) from None
            except Exception:  # the call's own error: it ended in the child (GeneratorExit is no Exception)
                ended = True
                raise
            finally:
                if last is None:  # what the target holds now is not known: splice nothing into the next prompt
                    self._cached = []
                child.forget(rid, cancel=not ended)  # the consumer stopped reading: the child stops the call
            # outside the call: a caller that stops at the completion (generate) need not close the stream
            yield last
            return

    def _pieces(self, child: ChildLink, rid: int, messages: queue.Queue, cancel: CancelToken | None):
        """The call's pieces as the child sends them; returns its last piece (the completion's)."""
        forwarded = False
        while True:
            if not forwarded and cancel is not None and cancel.is_set():
                child.send(("cancel", rid))
                forwarded = True
            try:
                msg = messages.get(timeout=0.05)  # a piece wakes this at once; the timeout only serves cancel
            except queue.Empty:
                continue
            if msg[0] == "piece":
                yield Piece(**msg[2])
            elif msg[0] == "done":
                child.healthy = True
                self._cached = msg[4]
                return Piece(msg[2], [], [], Completion(**msg[3]))
            elif msg is DIED:
                raise self._died(child)
            else:  # "error": the call failed, the child and its other calls live on
                raise _rebuild(msg[2], msg[3])

    def _ready_child(self, cancel: CancelToken | None) -> ChildLink | None:
        with self._cond:
            while True:
                if self._closed:
                    raise ModelUnavailable("the server is shutting down")
                if self.state == "failed":
                    raise ModelUnavailable(self.reason)
                if self.state == "ok":
                    return self._child
                if cancel is not None and cancel.is_set():
                    return None
                self._cond.wait(0.1)

    def _died(self, child: ChildLink) -> ModelProcessError:
        if not child.exited.wait(10):  # it closed the socket but lives on: end it, it cannot be trusted
            child.proc.kill()
            child.exited.wait(10)
        if self._closed:
            return ModelUnavailable("the server is shutting down")
        return ModelProcessDied(
            f"the model process died ({_how(child.cause)}) while generating this response; "
            "it is being restarted: retry the request"
        )

    def _cancelled(self, prompt, settings: Settings) -> Completion:
        n = len(self.tokenize(prompt)) if isinstance(prompt, str) else len(prompt)
        return Completion(
            text="",
            token_ids=[],
            finish_reason="cancelled",
            stats=Stats(prompt_tokens=n).to_dict(),
            settings=settings.to_dict(),
            prompt_tokens=n,
        )

    # ------------------------------------------------------------------ the child's life
    def _spawn(self) -> ChildLink:
        """Start a model process and wait until it has loaded the models; _StartFailed says how it failed."""
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fsd_local.server.child", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                env=self._env,
            )
        finally:
            theirs.close()  # the child holds the only other copy: when it dies, reading ours gives EOF
        child = ChildLink(proc, Connection(ours.detach()))
        t0 = time.monotonic()
        msg, stuck = None, False
        try:
            child.conn.send(("start", self._target_opts, self._draft_opts, self.defaults, self.parallel))
            while not child.conn.poll(0.1):
                if self._closed or (self.start_timeout_s and time.monotonic() - t0 > self.start_timeout_s):
                    stuck = True
                    break
            else:
                msg = child.conn.recv()
        except (EOFError, OSError):
            pass  # it died while starting
        if msg is not None and msg[0] == "ready":
            child.info, child.ready_at = msg[1], time.monotonic()
            self.last_start_seconds = child.ready_at - t0
            child.listen()
            return child
        if stuck:
            proc.kill()
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        child.conn.close()
        detail = msg[1] if msg is not None and msg[0] == "failed" else ("start timed out" if stuck else None)
        raise _StartFailed(describe_exit(code), detail)

    def _publish(self, child: ChildLink) -> bool:
        """Make a ready child the one that serves; False (and the child is stopped) if closing meanwhile."""
        info = child.info
        self.target = ModelInfo(**info["target"])  # as loaded: the context may be larger than the one asked for
        self.draft = ModelInfo(**info["draft"]) if info["draft"] else None
        self.n_vocab = info["n_vocab"]  # the shared vocabulary
        self.parallel = info["parallel"]
        self._cached = []  # a new child holds nothing
        with self._cond:
            if self._closed:
                child.proc.kill()  # its link's reader closes the socket at the EOF this gives
                child.proc.wait()
                return False
            self._child, self.state, self.reason = child, "ok", None
            self._cond.notify_all()
        return True

    def _watch(self) -> None:
        """Wait for the child to end (which also reaps it: no zombies), then restart it."""
        while True:
            child = self._child
            child.cause = describe_exit(child.proc.wait())
            if self._closed:
                child.exited.set()
                return
            proved = child.healthy or time.monotonic() - child.ready_at >= self.healthy_after_s
            with self._cond:  # before the running generation hears of it: its client may ask /health next
                self.deaths[child.cause] += 1
                self._streak = 1 if proved else self._streak + 1
                self.state, self.reason = "restarting", f"the model process died ({_how(child.cause)}); restarting it"
                self._cond.notify_all()
            child.exited.set()
            log.error("the model process (pid %d) died (%s); restarting it", child.proc.pid, _how(child.cause))
            if not self._restart(_how(child.cause)):
                return

    def _restart(self, last: str) -> bool:
        """Start a new child, waiting longer after each young death; False when giving up (or closing)."""
        while True:
            if self._streak >= self.max_failures:
                reason = (
                    f"the model process died {self._streak} times in a row without completing a request "
                    f"(the last time: {last}); it is not restarted again. See the server's log, then restart "
                    "fsd-local serve"
                )
                with self._cond:
                    self.state, self.reason = "failed", reason
                    self._cond.notify_all()
                log.error("%s", reason)
                return False
            delay = 0.0 if self._streak <= 1 else min(self.backoff_s * 2 ** (self._streak - 2), self.backoff_max_s)
            with self._cond:
                if self._cond.wait_for(lambda: self._closed, timeout=delay):
                    return False
            self.restarts += 1
            t0 = time.monotonic()
            try:
                child = self._spawn()
            except _StartFailed as exc:
                if self._closed:
                    return False
                last = str(exc)
                with self._cond:
                    self.deaths[exc.cause] += 1
                    self._streak += 1
                    self.reason = f"the model process failed to start ({last}); restarting it"
                log.error("the model process failed to start (%s)", last)
                continue
            if not self._publish(child):
                return False
            log.warning("the model process is back (pid %d) after %.1f s", child.proc.pid, time.monotonic() - t0)
            return True


def _rebuild(name: str, message: str) -> Exception:
    """The child's exception, as the same class when it is one of ours (ConfigError -> 400, ...)."""
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, FSDError):
        return cls(message)
    return RuntimeError(f"{message} ({name} in the model process)")


if TYPE_CHECKING:  # mypy checks that both things a server may serve satisfy its protocol (engine_like.py)

    def _serves(engine: Engine, supervisor: Supervisor) -> tuple[EngineLike, EngineLike]:
        return engine, supervisor
