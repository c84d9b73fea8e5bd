"""Fitting a conversation into the context window: whole turns dropped oldest first, never the system message or the
newest message, preferring a cut the caches already hold (`fit_conversation`); and a prompt continued from the
cached tokens where they spell the same bytes (`splice_cached`). Why: docs/design.md, "The KV-cache contract"."""

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
    """The prompt `ids` with the cached tokens in place of another split of the same bytes: where the cached tokens past
    the common prefix render to exactly the bytes of the prompt's next tokens, up to a token boundary of the prompt.
    A span holding a special token (which renders as nothing) is never matched."""
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
    """(token ids, messages dropped after the system message): the conversation rendered with `room` tokens free in
    n_ctx, turns dropped (once any must go) until a quarter of n_ctx is free besides `room`, preferring a cut `cached`
    holds. The system and newest messages stay even with less room; ContextOverflowError when they exceed n_ctx."""
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
