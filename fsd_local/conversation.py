"""Fitting a conversation into the context window: drop the oldest turns, never the system message, never the
newest message.

A turn is a user message and the replies after it, dropped together so that the conversation still alternates
as chat templates expect. When a conversation outgrows the context, turns are dropped until a quarter of the
context is free besides the room for the reply, so that the next few turns fit again as they are: their
prompts then extend what both KV caches hold and only the new text is evaluated. The turn that drops
re-evaluates what it keeps (exact: the caches hold what a fresh evaluation of the shortened conversation gives)
unless the settings' `context_shift` cuts the dropped span out of the caches instead (Model.reuse_after_cut:
nothing is evaluated again, but the kept entries were computed with the dropped turns present, as llama.cpp's
context shift does).

A caller that sends the whole history every time (an API client) gets the same cut as the previous call while
it still fits: among the cuts that fit, the one whose tokens the caches already hold is preferred.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from fsd_local.errors import ContextOverflowError

Messages = Sequence[Mapping[str, str]]


def reply_room(max_tokens: int, n_ctx: int) -> int:
    """Room kept free for the reply: max_tokens, but at most half the context (a reply that needs more stops
    with finish_reason 'length', finish_detail 'context_full', instead of the history being dropped for it)."""
    return max(1, min(max_tokens, n_ctx // 2))


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def splice_cached(ids: list[int], cached: Sequence[int], piece: Callable[[int], bytes]) -> list[int]:
    """The prompt `ids` with the cached tokens in place of another split of the same text. A sampled reply is often
    not the tokenizer's own split of its text (" Par" + "is" where the tokenizer writes " Paris"): rendered back
    into the next turn's prompt and tokenized again, it would differ from what both caches hold from its first
    such token on, and everything after would be evaluated again. Where the cached tokens past the common
    prefix render to exactly the bytes of the prompt's next tokens, ending on a token boundary of the prompt,
    the prompt continues from the cached tokens (the text is the same, byte for byte). Special tokens render as
    nothing, so a span holding one is never matched."""
    p = _common(ids, cached)
    if p == len(cached) or p == len(ids):
        return ids
    want = [piece(t) for t in cached[p:]]
    if not all(want):
        return ids
    target, got, j = b"".join(want), b"", p
    while j < len(ids) and len(got) < len(target):
        b = piece(ids[j])
        if not b:
            return ids
        got, j = got + b, j + 1
    return list(cached) + ids[j:] if got == target else ids


def fit_conversation(
    render: Callable[[Messages], list[int]],
    messages: Messages,
    n_ctx: int,
    room: int,
    cached: Sequence[int] = (),
) -> tuple[list[int], int]:
    """(token ids, number of messages dropped after the system message): the rendered conversation leaving
    `room` tokens free in a context of n_ctx. `cached`: what the target's KV cache holds (prefers a cut it
    already holds). When even the system message and the newest message leave less room, they are kept as they
    are and the reply gets what is left; when they do not fit at all, ContextOverflowError."""
    msgs = list(messages)
    first = 1 if msgs and msgs[0].get("role") == "system" else 0
    starts = [first] + [i for i in range(first + 1, len(msgs)) if msgs[i].get("role") == "user"]
    if len(msgs) - 1 > starts[-1]:
        starts.append(len(msgs) - 1)  # the newest message always stays, whatever its role
    fitting: list[tuple[list[int], int]] = []
    tokens: list[int] = []
    for s in starts:
        tokens = render(msgs[:first] + msgs[s:])
        if len(tokens) + room <= n_ctx:
            if s == first:
                return tokens, 0
            fitting.append((tokens, s - first))
            if len(tokens) + room <= n_ctx - n_ctx // 4:  # the low-water mark: the next turns fit as they are
                break
    if fitting:
        best = max(fitting, key=lambda f: _common(f[0], cached))
        low = fitting[-1]
        return best if _common(best[0], cached) > _common(low[0], cached) else low
    if len(tokens) > n_ctx:
        kept = "the system message and the newest message take" if first else "the newest message alone takes"
        raise ContextOverflowError(
            f"{kept} {len(tokens)} tokens (with the chat template) but the context holds {n_ctx}; shorten the "
            "message or raise --ctx"
        )
    return tokens, starts[-1] - first
