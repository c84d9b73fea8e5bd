"""fsd-local: Fuzzy Speculative Decoding for local GGUF models (llama.cpp through llama-cpp-python).
The public names load on first use, so `import fsd_local.cli` (and `fsd-local --help`) loads neither Numba nor
llama.cpp."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "Engine": "fsd_local.engine",
    "CancelToken": "fsd_local.engine",
    "Completion": "fsd_local.engine",
    "Piece": "fsd_local.engine",
    "Settings": "fsd_local.settings",
    "ModelOptions": "fsd_local.llama.options",
    "FSDError": "fsd_local.errors",
    "ConfigError": "fsd_local.errors",
    "ModelLoadError": "fsd_local.errors",
    "VocabularyMismatchError": "fsd_local.errors",
    "ContextOverflowError": "fsd_local.errors",
    "CacheTruncationError": "fsd_local.errors",
}
__all__ = [
    "Engine",
    "CancelToken",
    "Completion",
    "Piece",
    "Settings",
    "ModelOptions",
    "FSDError",
    "ConfigError",
    "ModelLoadError",
    "VocabularyMismatchError",
    "ContextOverflowError",
    "CacheTruncationError",
]

if TYPE_CHECKING:
    from fsd_local.engine import CancelToken, Completion, Engine, Piece
    from fsd_local.errors import (
        CacheTruncationError,
        ConfigError,
        ContextOverflowError,
        FSDError,
        ModelLoadError,
        VocabularyMismatchError,
    )
    from fsd_local.llama.options import ModelOptions
    from fsd_local.settings import Settings


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fsd_local' has no attribute {name!r}")
