"""What Ollama's model routes say of the served pair (/api/tags, /api/show, /api/ps), read from the GGUF headers
without loading anything: the target is the model (its details, model_info, chat template), the draft rides
along in fsd-local's extension field."""

from __future__ import annotations

import hashlib
import os
import re
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsd_local.llama.gguf_info import metadata, read
from fsd_local.server.ollama_schema import route_defaults
from fsd_local.server.ollama_tools import can_call_tools

if TYPE_CHECKING:
    from fsd_local.engine_like import EngineLike

_BLOB = re.compile(r"sha256-([0-9a-f]{64})$")  # a file in Ollama's store is named by its digest
# what the pair can do in Ollama's terms (no vision, embedding, insert, thinking); "tools" where the template can
CAPABILITIES = ["completion"]
NEVER = "9999-12-31T23:59:59Z"  # /api/ps expires_at: the pair stays loaded while the server runs


def ollama_name(name: str) -> str:
    """A model name as Ollama lists it: with a tag (`:latest` when it has none)."""
    return name if ":" in name else f"{name}:latest"


@lru_cache(maxsize=8)
def _header(path: str, mtime: float) -> dict[str, Any]:
    return metadata(path)


@lru_cache(maxsize=8)
def _quantisation(path: str, mtime: float) -> str:
    return read(path).quantisation  # the file type, or else the blocks' dominant tensor type


def header(path: str) -> dict[str, Any]:
    """The GGUF header of `path` (read again when the file changes)."""
    return _header(path, os.stat(path).st_mtime)


def _size_label(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def details(path: str) -> dict[str, Any]:
    meta = header(path)
    arch = meta.get("general.architecture") or "unknown"
    return {
        "parent_model": "",
        "format": "gguf",
        "family": arch,
        "families": [arch],
        "parameter_size": _size_label(int(meta.get("general.parameter_count") or 0)),
        "quantization_level": _quantisation(path, os.stat(path).st_mtime),
    }


def digest(path: str) -> str:
    """Ollama's blob digest where the file is one; else a digest of its path, size and time (not its bytes:
    hashing gigabytes for a listing would take minutes)."""
    m = _BLOB.search(Path(path).name)
    if m:
        return m.group(1)
    st = os.stat(path)
    return hashlib.sha256(f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()


def _modified(path: str) -> str:
    return datetime.fromtimestamp(os.stat(path).st_mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _pair(engine: EngineLike) -> dict[str, Any]:
    """fsd-local's extension: the two files of the pair."""
    draft = engine.draft.path if engine.draft else None
    return {"target": engine.target.path, "draft": draft, "draft_details": details(draft) if draft else None}


def _sizes(engine: EngineLike) -> int:
    paths = [engine.target.path] + ([engine.draft.path] if engine.draft else [])
    return sum(os.path.getsize(p) for p in paths)


def tag(engine: EngineLike, name: str) -> dict[str, Any]:
    """The pair's entry in /api/tags."""
    path = engine.target.path
    return {
        "name": ollama_name(name),
        "model": ollama_name(name),
        "modified_at": _modified(path),
        "size": _sizes(engine),
        "digest": digest(path),
        "details": details(path),
        "fsd": _pair(engine),
    }


def running(engine: EngineLike, name: str, slots: list[dict[str, Any]], waiting: int) -> dict[str, Any]:
    """The pair's entry in /api/ps (size_vram 0: fsd-local does not report where llama.cpp placed layers); its
    slots and queue in fsd-local's extension field."""
    path = engine.target.path
    return {
        "name": ollama_name(name),
        "model": ollama_name(name),
        "size": _sizes(engine),
        "digest": digest(path),
        "details": details(path),
        "expires_at": NEVER,
        "size_vram": 0,
        "context_length": engine.target.n_ctx,
        "fsd": {**_pair(engine), "slots": slots, "waiting": waiting},
    }


def show(engine: EngineLike) -> dict[str, Any]:
    """/api/show: details, model_info (the target's GGUF header; long arrays such as the vocabulary as null),
    the chat template, the defaults the Ollama routes use as `parameters`, capabilities."""
    path = engine.target.path
    meta = dict(header(path))
    template = meta.pop("tokenizer.chat_template", None) or ""
    defaults = route_defaults(engine.defaults, engine.target.n_ctx)
    params = {**defaults, "num_ctx": engine.target.n_ctx, "tau": engine.defaults.tau, "mode": engine.defaults.mode}
    params["num_predict"] = params.pop("max_tokens")
    lines = [f"{k} {v}" for k, v in params.items()] + [f'stop "{s}"' for s in engine.defaults.stop]
    modelfile = [f"# served by fsd-local with the draft {_pair(engine)['draft']}", f"FROM {path}"]
    modelfile += [f"PARAMETER {line}" for line in lines]
    return {
        "modelfile": "\n".join(modelfile) + "\n",
        "parameters": "\n".join(lines),
        "template": template,
        "details": details(path),
        "model_info": meta,
        "capabilities": [*CAPABILITIES, "tools"] if can_call_tools(engine) else list(CAPABILITIES),
        "modified_at": _modified(path),
        "fsd": _pair(engine),
    }
