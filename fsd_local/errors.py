"""Errors a user can act on. Every message names the problem and what to do about it."""


class FSDError(Exception):
    """Base class: the CLI prints these as one line, apps can catch them."""


class ConfigError(FSDError, ValueError):
    """A setting is out of range or unknown (tau, mode, divergence, sampling parameters...)."""


class ModelLoadError(FSDError):
    """A GGUF file is missing, unreadable, not GGUF, or llama.cpp refused it."""


class VocabularyMismatchError(FSDError):
    """The draft cannot draft for the target: too little of its vocabulary is shared, or its text cannot be
    aligned with the target's."""


class ContextOverflowError(FSDError):
    """The prompt does not fit in the context window."""


class CacheTruncationError(FSDError):
    """A model's KV cache cannot drop a partial range (recurrent / hybrid architectures)."""


class RegistryError(FSDError):
    """models.toml is malformed, or names a pair that it does not define."""


class DownloadError(FSDError):
    """A model file could not be fetched or failed its checksum (no network, offline mode, disk full...)."""
