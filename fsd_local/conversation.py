"""Fitting a conversation into the context window: drop the oldest turns, never the system message, never the
newest message.

A turn is a user message and the replies after it, dropped together so that the conversation still alternates
as chat templates expect. The engine then cuts the same span out of both KV caches (Model.reuse_after_cut), so
what is left of the conversation is not evaluated again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from fsd_local.errors import ContextOverflowError

Messages = Sequence[Mapping[str, str]]


def reply_room(max_tokens: int, n_ctx: int) -> int:
    """Room kept free for the reply: max_tokens, but at most half the context (a reply that needs more stops
    with finish_reason 'length', finish_detail 'context_full', instead of the history being dropped for it)."""
    return max(1, min(max_tokens, n_ctx // 2))


def fit_conversation(render: Callable[[Messages], list[int]], messages: Messages, n_ctx: int, room: int):
    """(token ids, number of messages dropped from the start): the rendered conversation leaving `room` tokens
    free in a context of n_ctx. When even the system message and the newest message leave less room, they are
    kept as they are and the reply gets what is left; when they do not fit at all, ContextOverflowError."""
    msgs = list(messages)
    first = 1 if msgs and msgs[0].get("role") == "system" else 0
    dropped = 0
    while True:
        tokens = render(msgs)
        if len(tokens) + room <= n_ctx or len(msgs) - first <= 1:
            break
        end = first + 1  # the oldest turn: its user message and whatever follows up to the next user message
        while end < len(msgs) - 1 and msgs[end].get("role") != "user":
            end += 1
        del msgs[first:end]
        dropped += end - first
    if len(tokens) > n_ctx:
        kept = "the system message and the newest message take" if first else "the newest message alone takes"
        raise ContextOverflowError(
            f"{kept} {len(tokens)} tokens (with the chat template) but the context holds {n_ctx}; shorten the "
            "message or raise --ctx"
        )
    return tokens, dropped
