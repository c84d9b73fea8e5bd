"""The command line in this process (click's runner), for the tests of its commands."""

from __future__ import annotations

from click.testing import CliRunner, Result

from fsd_local.cli import cli


def invoke(args: list[str], input: str | None = None) -> Result:
    """`fsd-local ARGS`: its exit code and output; an exception other than a usage error's exit is raised."""
    result = CliRunner().invoke(cli, args, input=input)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def tiny_models(tiny_pair: tuple[str, str]) -> list[str]:
    """The model options for the tests' tiny (draft, target) pair: one thread, a small context."""
    draft, target = tiny_pair
    return ["--target", target, "--draft", draft, "--threads", "1", "--ctx", "256"]
