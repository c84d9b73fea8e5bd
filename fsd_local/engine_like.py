"""`EngineLike`: what serving a pair needs of it, provided by an in-process `Engine` (engine.py) and by a `Supervisor`
running one in a child process (server/supervisor.py), under one prompt contract (prompting.py). The server is
written against it and never asks which it has; mypy checks that both satisfy it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from fsd_local.llama.chat_template import ChatTemplate
    from fsd_local.results import CancelToken, Completion, Piece
    from fsd_local.settings import Settings


class LoadedModel(Protocol):
    """What the server reads of each loaded model: a llama/model.py Model, or the Supervisor's ModelInfo."""

    @property
    def path(self) -> str: ...

    @property
    def n_ctx(self) -> int: ...


class ModelProcess(Protocol):
    """The supervised model process, as /health and /metrics report it."""

    @property
    def state(self) -> str: ...

    @property
    def restarts(self) -> int: ...

    @property
    def deaths(self) -> Counter[str]: ...

    @property
    def last_start_seconds(self) -> float: ...


class EngineLike(Protocol):
    @property
    def defaults(self) -> Settings: ...

    @property
    def target(self) -> LoadedModel: ...

    @property
    def draft(self) -> LoadedModel | None: ...

    @property
    def n_vocab(self) -> int:
        """The vocabulary both models share (the smaller size: the draft and target may differ by padding)."""
        ...

    @property
    def parallel(self) -> int:
        """Generations it runs at once (batched in each round): the server's slots."""
        ...

    @property
    def state(self) -> str:
        """Whether generations can run: "ok" (an Engine always), "starting" or "restarting" while a model process
        loads, "failed" once the supervisor has given up."""
        ...

    @property
    def reason(self) -> str | None:
        """Why the state is not "ok"."""
        ...

    @property
    def last_start_seconds(self) -> float:
        """How long the last model process took to load (0 for an Engine)."""
        ...

    @property
    def model_process(self) -> ModelProcess | None:
        """The model process the pair runs in (None: this process)."""
        ...

    def cached_tokens(self) -> Sequence[int]:
        """What the target's KV cache holds (as far as known: a Supervisor learns it when a generation ends)."""
        ...

    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...

    def detokenize(self, tokens: Sequence[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes: ...

    def chat_template(self) -> ChatTemplate: ...

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]: ...

    def prompt_tokens(self, prompt: str | Sequence[int]) -> list[int]: ...

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        cancel: CancelToken | None = None,
        settings: Settings | None = None,
        **overrides: Any,
    ) -> Completion: ...

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        cancel: CancelToken | None = None,
        settings: Settings | None = None,
        **overrides: Any,
    ) -> Iterator[Piece]: ...

    def close(self) -> None: ...
