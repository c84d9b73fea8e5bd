"""What a generation hands back (Piece, Completion) and how a caller stops one (CancelToken)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fsd_local.errors import ConfigError, ContextOverflowError


@dataclass
class Piece:
    """A streamed chunk: the text released now, the tokens that produced it with their origins ('sd', 'fuzzy', 'target',
    'draft'), log-probabilities where asked, the tokens the round drafted, (divergence, log-probability gap) per token
    tau rescued (else None), and on the final piece the Completion."""

    text: str
    token_ids: list[int]
    origins: list[str]
    completion: Completion | None = None  # set on the final piece only
    logprobs: list[float] | None = None  # with Settings.logprobs: the target's log-probability of each token
    top_logprobs: list[list[tuple[int, float]]] | None = None  # with Settings.top_logprobs: (id, log-prob) pairs
    drafted: int = 0
    rescues: list[tuple[float, float] | None] = field(default_factory=list)


@dataclass
class Emitted:
    """Tokens a round emitted (or a whole reply, extended round by round) and what rides along with each: its
    origin, the target's log-probability and top alternatives, and (divergence, log-probability gap) where tau
    rescued it, else None; `drafted`: the tokens the round drafted."""

    tokens: list[int] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    rescues: list[tuple[float, float] | None] = field(default_factory=list)
    drafted: int = 0

    def head(self, n: int) -> Emitted:
        """The first n tokens (what is shown of a round that ended the reply)."""
        return Emitted(
            self.tokens[:n], self.origins[:n], self.logprobs[:n], self.top[:n], self.rescues[:n], self.drafted
        )

    def extend(self, other: Emitted) -> None:
        self.tokens += other.tokens
        self.origins += other.origins
        self.logprobs += other.logprobs
        self.top += other.top
        self.rescues += other.rescues
        self.drafted += other.drafted

    def logprob_fields(self, logprobs: bool, top: bool) -> tuple[list[float] | None, list | None]:
        """What a Piece or Completion carries: the log-probabilities (and alternatives) if they were asked for."""
        return (self.logprobs, self.top if top else None) if logprobs else (None, None)

    def piece(self, text: str, logprobs: bool, top: bool) -> Piece:
        return Piece(
            text, self.tokens, self.origins, None, *self.logprob_fields(logprobs, top), self.drafted, self.rescues
        )


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | cancelled
    stats: dict
    settings: dict
    prompt_tokens: int
    origins: list[str] = field(default_factory=list)
    logprobs: list[float] | None = None  # as Piece, for the whole reply
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_detail: str | None = None  # why 'length': max_tokens | context_full (the context window is full)
    dropped_messages: int = 0  # chat: the oldest messages left out so that the conversation fits the context

    def to_dict(self) -> dict:
        out: dict[str, Any] = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "finish_detail": self.finish_detail,
            "dropped_messages": self.dropped_messages,
            "prompt_tokens": self.prompt_tokens,
            "stats": self.stats,
            "settings": self.settings,
        }
        if self.logprobs is not None:
            out.update(origins=self.origins, logprobs=self.logprobs, top_logprobs=self.top_logprobs)
        return out


class CancelToken(threading.Event):
    """Set it (from any thread) to stop a running generation at the next round; finish_reason 'cancelled'."""

    def cancel(self) -> None:
        self.set()


def final_completion(pieces: Iterable[Piece]) -> Completion:
    """Run a stream to its end and return the Completion its last piece carries (generate = stream + this)."""
    for piece in pieces:
        if piece.completion is not None:
            return piece.completion
    raise AssertionError("unreachable: a stream always ends with a completion")


def length_detail(finish: str | None, tokens: int, max_tokens: int) -> str | None:
    """Why a generation stopped at 'length': it reached max_tokens, or else the context window was full."""
    if finish != "length":
        return None
    return "max_tokens" if tokens >= max_tokens else "context_full"


def check_prompt_ids(tokens: list[int], n_vocab: int, n_ctx: int) -> list[int]:
    """The prompt checks every caller shares (engine, supervised server): ids inside the vocabulary, not
    empty, short enough for the context."""
    bad = [t for t in tokens if not 0 <= t < n_vocab]
    if bad:
        raise ConfigError(f"prompt token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
    if not tokens:
        raise ConfigError("the prompt is empty and the model adds no BOS token: give at least one token")
    if len(tokens) > n_ctx:
        raise ContextOverflowError(
            f"the prompt has {len(tokens)} tokens but the context holds {n_ctx}; shorten the prompt or raise --ctx"
        )
    return tokens
