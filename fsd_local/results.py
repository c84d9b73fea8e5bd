"""What a generation hands back (Piece, Completion) and how a caller stops one (CancelToken)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Piece:
    """A streamed chunk: the text released now and the tokens that produced it, with their origins
    ('sd' = draft token that passed the SD test, 'fuzzy' = draft token rescued by tau, 'target' = the
    target's own token, 'draft' = draft-only baseline)."""

    text: str
    token_ids: list[int]
    origins: list[str]
    completion: Completion | None = None  # set on the final piece only


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | cancelled
    stats: dict
    settings: dict
    prompt_tokens: int
    origins: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "stats": self.stats,
            "settings": self.settings,
        }


class CancelToken(threading.Event):
    """Set it (from any thread) to stop a running generation at the next round; finish_reason 'cancelled'."""

    def cancel(self) -> None:
        self.set()
