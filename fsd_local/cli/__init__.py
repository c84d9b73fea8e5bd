"""The `fsd-local` command: a thin click layer over the library (fsd_local.Engine)."""

from fsd_local.cli.main import cli, main

__all__ = ["cli", "main"]
