"""OpenAI's `logprobs` objects for chat completions and (legacy) completions, built from the log-probabilities a
generation reports, with fsd-local's `origin` / `origins` extension (docs/server.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

TokenBytes = Callable[[int], bytes]
FLOOR = -9999.0  # OpenAI's stand-in for a log-probability of -inf (JSON has no infinities)


def _lp(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


def token_text(b: bytes) -> str:
    """A token's text; a token that is not whole UTF-8 (part of a character) is written as OpenAI does,
    'bytes:\\xe2\\x80', so that distinct tokens never share a string."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


def _token(token_bytes: TokenBytes, t: int) -> dict[str, Any]:
    b = token_bytes(t)
    return {"token": token_text(b), "bytes": list(b)}


def chat_logprobs(
    token_bytes: TokenBytes,
    ids: Sequence[int],
    origins: Sequence[str],
    lps: Sequence[float] | None,
    tops: Sequence[Sequence[tuple[int, float]]] | None,
) -> dict[str, Any] | None:
    """A chat choice's (or chunk's) `logprobs`; None when the request did not ask for them."""
    if lps is None:
        return None
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        top = tops[i] if tops is not None else []
        alternatives = [{**_token(token_bytes, a), "logprob": _lp(v)} for a, v in top]
        content.append(
            {**_token(token_bytes, t), "logprob": _lp(lp), "top_logprobs": alternatives, "origin": origins[i]}
        )
    return {"content": content, "refusal": None}


def text_logprobs(
    token_bytes: TokenBytes,
    ids: Sequence[int],
    origins: Sequence[str],
    lps: Sequence[float] | None,
    tops: Sequence[Sequence[tuple[int, float]]] | None,
    offset: int = 0,
) -> dict[str, Any] | None:
    """A completion choice's (or chunk's) `logprobs`; text_offset counts characters from `offset`."""
    if lps is None:
        return None
    pieces = [token_bytes(t) for t in ids]
    offsets = []
    for b in pieces:  # characters of the text before each token (a partial character counts as one, U+FFFD)
        offsets.append(offset)
        offset += len(b.decode("utf-8", "replace"))
    return {
        "tokens": [token_text(b) for b in pieces],
        "token_logprobs": [_lp(x) for x in lps],
        "top_logprobs": None if tops is None else [{token_text(token_bytes(a)): _lp(v) for a, v in t} for t in tops],
        "text_offset": offsets,
        "origins": list(origins),
    }
