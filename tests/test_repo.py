"""The repository's own contract: CI runs exactly the README's test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_exactly_the_readme_test_command():
    test_command = readme_commands()[1]
    assert "pytest" in test_command
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command.strip() in ci


def test_readme_names_every_mode_and_divergence():
    from fsd_local.kernels.accept import MODES
    from fsd_local.kernels.divergence import DIVERGENCES

    text = (ROOT / "README.md").read_text()
    for name in MODES + DIVERGENCES:
        assert f"`{name}`" in text, name
