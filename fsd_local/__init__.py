"""fsd-local: Fuzzy Speculative Decoding for local GGUF models (llama.cpp through llama-cpp-python)."""
from fsd_local.settings import Settings
from fsd_local.engine import CancelToken, Completion, Engine, Piece
from fsd_local.errors import (CacheTruncationError, ConfigError, ContextOverflowError, FSDError, ModelLoadError,
                     VocabularyMismatchError)
from fsd_local.llama.model import ModelOptions

__version__ = "0.1.0"
__all__ = ["Engine", "Settings", "ModelOptions", "Completion", "Piece", "CancelToken", "FSDError", "ConfigError",
           "ModelLoadError", "VocabularyMismatchError", "ContextOverflowError", "CacheTruncationError"]
