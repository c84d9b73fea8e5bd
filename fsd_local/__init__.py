"""fsd-local: Fuzzy Speculative Decoding for local GGUF models (llama.cpp through llama-cpp-python)."""
from .config import Settings
from .engine import CancelToken, Completion, Engine, Piece
from .errors import (CacheTruncationError, ConfigError, ContextOverflowError, FSDError, ModelLoadError,
                     VocabularyMismatchError)
from .model import ModelOptions

__version__ = "0.1.0"
__all__ = ["Engine", "Settings", "ModelOptions", "Completion", "Piece", "CancelToken", "FSDError", "ConfigError",
           "ModelLoadError", "VocabularyMismatchError", "ContextOverflowError", "CacheTruncationError"]
