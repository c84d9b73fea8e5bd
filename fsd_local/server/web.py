"""The chat page (docs/chat.md, "The chat page"): `/` and `/static/...` from the package, `/v1/fsd/settings` (the
settings a request may send, generated from settings.py, for the page's controls), and `TokenTrail`, the
`fsd_delta` field of each streamed chunk (each new token's id, text, origin and rescue)."""

from __future__ import annotations

import codecs
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import FileResponse

from fsd_local.results import Piece
from fsd_local.server.errors import APIError
from fsd_local.server.openai_schema import SETTING_FIELDS
from fsd_local.settings import FIELDS, chat_sampling, field_type, spec

if TYPE_CHECKING:
    from fsd_local.engine_like import EngineLike

STATIC = Path(__file__).resolve().parent / "static"
MEDIA_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".png": "image/png"}
TYPE_NAMES = {float: "number", int: "integer", bool: "boolean", str: "string", tuple: "strings"}


def install(app: FastAPI, engine: EngineLike, guarded: list[Any], model_name: str) -> None:
    """Add the page's routes to the server's app."""
    files = {p.name: p for p in STATIC.iterdir() if p.suffix in MEDIA_TYPES}  # nothing else is served

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> FileResponse:
        path = files.get(name)
        if path is None:
            raise APIError(404, f"no static file {name!r}", code="not_found")
        return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})

    @app.get("/v1/fsd/settings", dependencies=guarded)
    async def settings() -> dict[str, Any]:
        return {"model": model_name, "has_draft": engine.draft is not None, "settings": describe_settings(engine)}


def describe_settings(engine: EngineLike) -> list[dict[str, Any]]:
    """Every setting a request body may carry, with this server's default (max_tokens included) and, for chat's
    sampling settings, the value the page starts with (`start`: chat's defaults over the server's)."""
    defaults = engine.defaults.to_dict()
    start = chat_sampling(engine.defaults)
    out = []
    for f in FIELDS:
        s = spec(f)
        if f.name not in SETTING_FIELDS and f.name != "max_tokens":
            continue
        out.append(
            {
                "name": f.name,
                "type": TYPE_NAMES[field_type(f)],
                "default": defaults[f.name],
                "min": s.lo,
                "max": s.hi,
                "min_open": s.lo_open,
                "max_open": s.hi_open,
                "choices": list(s.choices) if s.choices else None,
                "help": s.help,
                **({"start": start[f.name]} if f.name in start else {}),
            }
        )
    return out


class TokenTrail:
    """Builds the `fsd_delta` field of one stream's chunks. A token's text is its bytes decoded in order (a
    character split across tokens belongs to the token that completes it), so the chunks' `content` is always a
    prefix of the tokens' texts joined: text held back for a stop string comes later, text past it never."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def delta(self, piece: Piece) -> dict[str, Any]:
        tokens = []
        for i, (token, origin) in enumerate(zip(piece.token_ids, piece.origins)):
            rescue = piece.rescues[i] if i < len(piece.rescues) else None  # none for the round's last token
            entry: dict[str, Any] = {"id": token, "text": self._utf8.decode(self._bytes(token)), "origin": origin}
            if rescue is not None:
                divergence, gap = rescue
                entry["divergence"] = divergence if math.isfinite(divergence) else None
                entry["logprob_gap"] = gap
            tokens.append(entry)
        return {"tokens": tokens, "drafted": piece.drafted}
